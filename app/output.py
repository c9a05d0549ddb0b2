"""Printing query results for people (aligned table) and programs (CSV, JSON)."""

from __future__ import annotations

import csv
import io
import json

FORMATS = ("table", "csv", "json")


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
