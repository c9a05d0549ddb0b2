"""Reading many trace files at once. A job's traces are one file per rank, each parsed on its own,
so a pool of processes parses them side by side when there is enough to parse to repay starting
it (a 1,024-rank profiler folder would otherwise take one core minutes)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

PARALLEL_MIN_BYTES = 32 * 2**20
"""Less input than this is read in this process: starting the pool (a forkserver importing the
reader, about 0.4 s on the 2-core dev machine) would cost more than it saves."""


def map_files(read: Callable[[Path], T], files: list[Path]) -> list[T]:
    """`read(file)` for each file, in order: in a pool of processes (one per core, at most one
    per file) when the files hold at least PARALLEL_MIN_BYTES, else here. `read` must be a
    module-level function; an exception it raises in a worker is raised here.

    The pool forks from a forkserver, not from this process: a caller with threads (DuckDB's)
    could leave a plainly forked child holding a lock no thread will release."""
    processes = min(len(files), os.cpu_count() or 1)
    if processes < 2 or sum(f.stat().st_size for f in files) < PARALLEL_MIN_BYTES:
        return [read(f) for f in files]
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([read.__module__])
    with ProcessPoolExecutor(processes, mp_context=context) as pool:
        return list(pool.map(read, files))
