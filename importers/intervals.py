"""Interval arithmetic over NumPy arrays for trace importers: which interval holds a time,
overlapping spans made disjoint, and intervals minus cuts. Times in any one unit (the profiler's
µs)."""

from __future__ import annotations

import numpy as np


def lookup(t: np.ndarray, starts: np.ndarray, ends: np.ndarray, values: np.ndarray, missing):
    """values[i] of the interval [starts[i], ends[i]) holding each t (sorted, disjoint starts)."""
    i = np.searchsorted(starts, t, side="right") - 1
    j = np.clip(i, 0, None)
    inside = (i >= 0) & (t < ends[j]) if len(starts) else np.zeros(len(t), bool)
    return np.where(inside, values[j] if len(values) else missing, missing)


def disjoint(spans: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(phase, start, end) of the phase spans, trimmed so an earlier, outer span owns overlaps."""
    if not spans:
        return np.array([], dtype=object), np.array([]), np.array([])
    phase = np.array([s[0] for s in spans], dtype=object)
    start = np.array([s[1] for s in spans])
    end = start + np.array([s[2] for s in spans])
    order = np.lexsort((-end, start))
    phase, start, end = phase[order], start[order], end[order]
    covered = np.concatenate([[-np.inf], np.maximum.accumulate(end)[:-1]])
    start = np.maximum(start, covered)
    keep = end > start
    return phase[keep], start[keep], end[keep]


def minus(starts, ends, cut_starts, cut_ends) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of the intervals outside every cut: (index of the interval, start, end)."""
    order = np.argsort(cut_starts, kind="stable")
    # Running max of the cut ends: cut j and those before it cover [cut_starts[j], cut_ends[j]].
    cut_starts, cut_ends = cut_starts[order], np.maximum.accumulate(cut_ends[order])
    first = np.searchsorted(cut_ends, starts, "right")  # the cuts each interval may meet
    stop = np.searchsorted(cut_starts, ends)
    cut_starts, cut_ends = cut_starts.tolist(), cut_ends.tolist()
    pieces = []
    for k, (s, e, lo, hi) in enumerate(
        zip(starts.tolist(), ends.tolist(), first.tolist(), stop.tolist(), strict=True)
    ):
        cursor = s
        for j in range(lo, hi):
            if cut_starts[j] > cursor:
                pieces.append((k, cursor, cut_starts[j]))
            cursor = max(cursor, cut_ends[j])
        if cursor < e:
            pieces.append((k, cursor, e))
    index, start, end = zip(*pieces, strict=True) if pieces else ((), (), ())
    return np.array(index, dtype=np.int64), np.array(start), np.array(end)
