"""Comparing two reports (or any JSON-like values) key by key."""

from __future__ import annotations

import math


def assert_same(a, b, path: str = "") -> None:
    """Equal, floats within 1e-9 relative (every key, in every nested dict and list): two
    computations of one report differ at most in the last digits of DuckDB's parallel sums."""
    if isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), (path, a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (path, a.keys() ^ b.keys())
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)
