"""Printing query results for people (aligned table) and programs (CSV, JSON), and the rule
for programs: a command asked for a document prints exactly that one document on stdout."""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import sys
from collections.abc import Iterator

FORMATS = ("table", "csv", "json")
DOCUMENT_FORMATS = ("csv", "json")
"""The --format values (and --json) a program reads whole: one document on stdout."""


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def render(columns: list[str], rows: list[tuple], fmt: str) -> str:
    """The result as text in `fmt` (one of FORMATS)."""
    if fmt == "json":
        return json.dumps([dict(zip(columns, row, strict=True)) for row in rows], default=str)
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([_cell(v) for v in row] for row in rows)
        return buffer.getvalue().rstrip("\n")
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines)


def _plain(value):
    """numpy scalars and other non-JSON values as plain JSON values."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def to_json(obj) -> str:
    """`obj` (dicts, lists, numbers, numpy scalars) as indented JSON; NaN becomes null."""
    return json.dumps(_nan_to_none(obj), indent=2, default=_plain)


def _nan_to_none(obj):
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_nan_to_none(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


def wants_document(args: argparse.Namespace) -> bool:
    """The command was asked for a document: `--json`, or `--format csv|json` (`import`'s
    positional format is a trace format, never one of these)."""
    return bool(getattr(args, "json", False)) or getattr(args, "format", None) in DOCUMENT_FORMATS


class CommandResult:
    """What a command prints as its result: at once, or, for a document, held until the command
    has ended (`document_output`)."""

    def __init__(self, is_document: bool) -> None:
        self.is_document = is_document
        self.document: str | None = None

    def print(self, text: str) -> None:
        """Print the result `text` (a document is printed by `document_output`, once)."""
        if not self.is_document:
            print(text, flush=True)
            return
        if self.document is not None:
            raise RuntimeError("a command asked for a document printed a second one")
        self.document = text


@contextlib.contextmanager
def document_output(is_document: bool) -> Iterator[CommandResult]:
    """The command's result printer; for a document, stdout is stderr while the command runs.

    Descriptor 1 itself points at stderr, not only `sys.stdout`: rank processes the command
    starts inherit it (their step lines, app/jobs.py), as do libraries writing to it. Put back
    when the command ends, however it ends (one process runs many commands in the tests'
    launcher); then the document, if the command printed one, is written to the real stdout."""
    result = CommandResult(is_document)
    if not is_document:
        yield result
        return
    real_stdout = sys.stdout
    real_stdout.flush()
    try:
        saved_fd = os.dup(1)
    except OSError:  # descriptor 1 closed (`>&-`): nothing to keep the document from
        saved_fd = None
    if saved_fd is not None:
        os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield result
    finally:
        with contextlib.suppress(OSError, ValueError):  # what was buffered goes to stderr too
            real_stdout.flush()
            sys.stderr.flush()
        if saved_fd is not None:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
        sys.stdout = real_stdout
    if result.document is not None:
        print(result.document, flush=True)
