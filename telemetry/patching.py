"""Attributes of torch replaced by wrappers, and put back exactly as they were.

A wrapper must pass every check torch and libraries make on what it replaces (`ranktrace run`
lives inside other people's jobs):
- identity: torch compares functions with `is` (`P2POp` takes only `isend`/`irecv`,
  `batch_isend_irecv` picks its peer argument by `op.op is isend`, pipelining's `_batch_p2p`
  groups by `{dist.isend}`). `replace_function` therefore rebinds the function in every loaded
  module that holds it under its name (`torch.distributed`, `distributed_c10d`, a job's `from
  torch.distributed import isend`), so every name torch and the job compare sees one object;
- signature and pickling: wrappers are made with `functools.wraps` (their signature is the
  original's; a function pickles by module and name, which now find the wrapper);
- `torch.compile`: a wrapper's first test is `torch.compiler.is_compiling()`, and while Dynamo
  traces it calls the original at once, so Dynamo sees the call it would see without us (its
  remapping of collectives to traceable ones included) and breaks no graph we did not.

A replacement that fails (an attribute torch no longer has, one that cannot be set) is not
made: the job runs as it would, that part is not recorded, and `notes` says which.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class Patches:
    """The attributes replaced so far, restored in reverse order by `restore()`; `notes` names
    the replacements that could not be made."""

    def __init__(self) -> None:
        self._originals: list[tuple[object, str, object]] = []
        self.notes: list[str] = []

    def replace(self, owner, name: str, wrapper) -> None:
        """Set `owner.name` to `wrapper`, remembering what it was."""
        original = getattr(owner, name)
        setattr(owner, name, wrapper)
        self._originals.append((owner, name, original))

    def replace_together(self, replacements: list[tuple[object, str, object]]) -> None:
        """Each (owner, name, wrapper) replaced: all of them or, when one cannot be, none."""
        made = len(self._originals)
        try:
            for owner, name, wrapper in replacements:
                self.replace(owner, name, wrapper)
        except Exception:
            self._restore(made)
            raise

    def replace_function(self, module, name: str, make_wrapper: Callable) -> None:
        """Rebind `module.name` (a function) to `make_wrapper(function)` in `module` and in every
        other loaded module whose global `name` is the same function, together (a half-made
        replacement would fail torch's identity checks)."""
        original = vars(module)[name]
        wrapper = make_wrapper(original)
        holders = []
        for holder in list(sys.modules.values()):
            try:
                namespace = vars(holder)
            except TypeError:  # not a module (sys.modules may hold anything)
                continue
            if namespace.get(name) is original:
                holders.append((holder, name, wrapper))
        self.replace_together(holders)

    def attempt(self, what: str, install: Callable, *args) -> None:
        """Run `install(*args)`; if it fails, note that `what` is not recorded."""
        try:
            install(*args)
        except Exception as error:
            self.notes.append(f"{what} not recorded: {type(error).__name__}: {error}")

    def restore(self) -> None:
        """Put back everything replaced."""
        self._restore(0)

    def _restore(self, keep: int) -> None:
        """Undo the replacements after the first `keep`, latest first."""
        for owner, name, original in reversed(self._originals[keep:]):
            setattr(owner, name, original)
        del self._originals[keep:]
