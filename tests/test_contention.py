"""Host contention is not compute: a rank whose core another process keeps busy waits for the
core (its wall time grows, its CPU time does not) and is a `host` straggler caused by
`contention`, never a compute one. Real ranks, pinned one per core, and a real busy process on
the core of rank 1, started mid-run by this test (no injector: nothing in the trainer knows)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import ranktrace
from tests.margins import at_least, at_most, only_findings

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores"),
]


BUSY_PROCESSES = 3
"""Busy programs on rank 1's core, each in a session of its own like any program another user or
service starts. Linux shares a core fairly between sessions (autogroups), not processes: loops
in this test's session took little from rank 1 (measured: its compute 1.15x its CPU time with
two such loops, 2.1x with two in sessions of their own). Three, not two: with two the finding's
slowdown was 1.56-1.82 alone but 1.299 once in a CI run, at the 1.3 this test asks; with three
it was 2.45-2.63 (4 runs each)."""


BUSY_CORE_STANDS_OUT = 0.5
"""The setup took effect where rank 0's wait for a core in the median step is under half of
rank 1's (rank 1's core the busy one): alone here 0.0005-0.0006 s against 0.074-0.080 s."""
BUSY_CORE_MIN_WAIT_S = 0.02
"""The busy processes take rank 1's core whatever else runs: its median wait for a core is at
least this (0.074-0.09 s measured, alone and beside a 2-rank training job)."""


def _rank_pids(runs_dir: Path, world: int, timeout: float = 60) -> dict[int, int]:
    """The pids the ranks recorded in their telemetry metadata, once all have started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {}
        for path in runs_dir.glob("*/telemetry/rank=*/rank-*.parquet"):
            row = pq.read_table(path, columns=["rank", "pid"]).to_pylist()[0]
            found[row["rank"]] = row["pid"]
        if len(found) == world:
            return found
        time.sleep(0.05)
    raise AssertionError(f"ranks did not start within {timeout} s")


def _pin(pid: int, core: int) -> None:
    """Every thread of `pid` on `core` only."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), {core})


@pytest.mark.timing
def test_a_busy_process_on_one_ranks_core_is_host_contention_not_compute(tmp_path):
    runs_dir = tmp_path / "runs"
    result = {}
    train = threading.Thread(target=lambda: result.update(done=ranktrace(
        "train", "--dp", "2", "--model", "tiny", "--steps", "40", "--run-name", "busy",
        runs_dir=runs_dir)))  # fmt: skip
    train.start()
    first, second = sorted(os.sched_getaffinity(0))[:2]
    pids = _rank_pids(runs_dir, 2)
    _pin(pids[0], first)
    _pin(pids[1], second)
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, {second}))
        for _ in range(BUSY_PROCESSES)
    ]  # fmt: skip
    try:
        train.join(timeout=300)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert result["done"].returncode == 0, result["done"].stderr[-2000:]
    report = ranktrace("report", "busy", "--runs-dir", str(runs_dir), "--json", runs_dir=runs_dir)
    assert report.returncode == 0, report.stderr
    findings = json.loads(report.stdout)["stragglers"]
    compute = [f for f in findings if f["kind"] == "compute"]
    at_most("compute findings", len(compute), 0, findings)  # a wait for a core is never compute
    # The busy processes take rank 1's core only; another job on this machine takes a share of
    # rank 0's (a 2-rank training job beside this test: rank 0's wait for a core 0.08 s in the
    # median step against rank 1's 0.09 s, in one timing-loop run; nothing then set rank 1
    # apart, and no finding named it). Which rank the report singles out is asserted only
    # where the run's own waits show the busy core was the one that stood out.
    waits = {row["rank"]: row["wait"] for row in json.loads(ranktrace(
        "sql", "SELECT rank, median(work_core_wait_s) AS wait FROM step_breakdown "
        "WHERE step >= 1 GROUP BY rank", "--runs-dir", str(runs_dir), "--format", "json",
        runs_dir=runs_dir).stdout)}  # fmt: skip
    if None in waits.values():
        pytest.skip("no /proc schedstat here: the ranks' waits for a core are not recorded")
    at_least("rank 1's median wait for a core (s)", waits[1], BUSY_CORE_MIN_WAIT_S, waits)
    if waits[0] >= BUSY_CORE_STANDS_OUT * waits[1]:
        only_findings(findings, [])  # nothing but the machine's waits for a core
        pytest.skip(
            f"another job took rank 0's core too (its median wait for a core "
            f"{waits[0]:.3f} s, rank 1's {waits[1]:.3f} s): nothing sets rank 1 apart"
        )
    # rank 0 may wait for a core too where another job shares these cores (a run beside a
    # 2-rank training job: rank 0 "host (contention)" in 8 of its steps): the machine's, allowed
    (finding,) = only_findings(findings, [(1, "host")])
    assert finding["cause"] == "contention", finding
    at_least("its slowdown", finding["slowdown"], 1.3, findings)
