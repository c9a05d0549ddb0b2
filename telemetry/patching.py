"""Attributes of torch replaced by wrappers, and put back exactly as they were."""

from __future__ import annotations


class Patches:
    """The attributes replaced so far, restored in reverse order by `restore()`."""

    def __init__(self) -> None:
        self._originals: list[tuple[object, str, object]] = []

    def replace(self, owner, name: str, wrapper) -> None:
        """Set `owner.name` to `wrapper`, remembering what it was."""
        self._originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    def restore(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals = []
