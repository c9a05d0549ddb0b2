"""The process that `ranktrace train` forks its rank processes from, started early.

Ranks fork from a forkserver that imported torch, pandas (pyarrow imports it when it first builds
a table) and the trainer once, so no rank imports them again: an 8-rank launch on 2 cores takes
10 s instead of 20 s with "spawn". Not plain "fork": a launching process with threads (DuckDB's,
after an ingest in a sweep or the demo) can leave a forked rank deadlocked on a lock no thread
will release. Started before the launcher itself imports torch, the server's imports overlap
the launcher's on another core (2.5 s less per launch on 2 cores).
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import forkserver

RANK_PRELOAD = ["torch", "pandas", "ranktrace.trainer.train"]
"""Modules the server imports once for every rank forked from it."""


def start_rank_server() -> None:
    """Start (once per process) the forkserver that rank processes fork from.

    Sets OMP_NUM_THREADS=1 first (many ranks share few cores): the server and every rank it
    forks inherit it."""
    os.environ["OMP_NUM_THREADS"] = "1"
    multiprocessing.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    forkserver.ensure_running()
