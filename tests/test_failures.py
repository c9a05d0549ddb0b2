"""A rank that dies takes the whole job down promptly, names itself, and marks the run failed;
what it wrote before it died stays readable, live readers never error, and the partial run is
ingested. One run, SIGKILLed from outside: no clean-up, no flush."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from ranktrace.analysis.store import open_live, open_reader, query, segment_files
from ranktrace.telemetry.run_record import read_rank_info
from ranktrace.trainer.termination import STUCK_GRACE_S
from tests.conftest import REPO, cli_env, start_training, wait_for

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)

FAIL_WITHIN_S = 30  # from the kill to the launcher's exit; seen: about 1 s
VICTIM = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_with_segments(runs_dir, rank: int, count: int):
    """The run directory once `rank` wrote `count` step segments and rank 0 logged 2 losses."""
    for run_json in runs_dir.glob("*/run.json"):
        record = json.loads(run_json.read_text() or "{}")
        files = list((run_json.parent / "telemetry" / f"rank={rank:05d}").glob("steps-*.parquet"))
        if len(files) >= count and len(record.get("losses", [])) >= 2:
            return run_json.parent
    return None


def test_sigkilled_rank_fails_the_job_promptly_keeps_its_segments_and_readers_never_error(
    runs_dir,
):
    proc = start_training("--tp", "2", "--dp", "2", "--steps", "100000", "--seq-len", "32",
                          "--flush-every", "1", "--log-every", "1", runs_dir=runs_dir)  # fmt: skip
    try:
        run_dir = wait_for(lambda: _run_with_segments(runs_dir, VICTIM, 3), 120, "3 segments")
        seen = 0
        for _ in range(6):  # readers while segments keep appearing (~1 s each)
            con = open_live(runs_dir, run_dir.name)
            (count,) = query(con, "SELECT count(*) FROM steps")[1][0]
            query(con, "SELECT axis, sum(blocking_s) FROM collectives GROUP BY axis")
            con.close()
            assert count >= seen
            seen = count
        assert seen >= 4 * 3
        os.kill(read_rank_info(run_dir)[VICTIM]["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        output, _ = proc.communicate(timeout=FAIL_WITHIN_S + 60)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < FAIL_WITHIN_S, f"job took {elapsed:.1f} s to fail"
    assert f"rank {VICTIM} of 4 killed by SIGKILL" in output, output[-2000:]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "failed" and f"rank {VICTIM}" in record["error"]
    assert len(record["losses"]) >= 2  # what was recorded before the failure is kept
    written = segment_files(run_dir, "steps") + segment_files(run_dir, "spans")
    for path in written:
        pq.read_table(path)  # complete files only: temporary names were never renamed
    victim_steps = sum(
        pq.read_metadata(p).num_rows
        for p in segment_files(run_dir, "steps")
        if f"rank={VICTIM:05d}" in str(p)
    )
    assert victim_steps >= 3
    assert "ingested run" in output  # the partial run was ingested after the failure
    con = open_reader(runs_dir)
    try:
        ((status, error),) = query(con, "SELECT status, error FROM runs")[1]
        ((stored,),) = query(con, f"SELECT count(*) FROM steps WHERE rank = {VICTIM}")[1]
    finally:
        con.close()
    assert status == "failed" and f"rank {VICTIM}" in error
    assert stored == victim_steps


BLOCKED_RANK = """
import sys, torch, torch.distributed as dist
from pathlib import Path
from ranktrace.trainer.termination import TERMINATION
rank, port, ready = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
TERMINATION.install()
ready.with_suffix(f".{rank}").touch()
if rank == 1:
    dist.recv(torch.zeros(1), src=0)  # rank 0 never sends: blocked in gloo, in C++
else:
    import time; time.sleep(120)
"""


def test_a_rank_blocked_in_a_collective_ends_soon_after_sigterm(tmp_path):
    """The launcher SIGTERMs survivors; one blocked in a collective whose peer waits elsewhere
    cannot run a Python handler, so trainer/termination.py ends it STUCK_GRACE_S later (the
    launcher's own grace is 30 s)."""
    port, ready = str(_free_port()), tmp_path / "ready"
    ranks = [subprocess.Popen([sys.executable, "-c", BLOCKED_RANK, str(rank), port, str(ready)],
                              env=cli_env(), cwd=REPO) for rank in (0, 1)]  # fmt: skip
    try:

        def started() -> bool:
            assert all(proc.poll() is None for proc in ranks), "a rank process ended early"
            return all(ready.with_suffix(f".{r}").exists() for r in (0, 1))

        wait_for(started, 60, "both ranks to start")
        time.sleep(0.5)  # rank 1 is inside recv now
        ranks[1].send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = ranks[1].wait(timeout=STUCK_GRACE_S + 20)
        elapsed = time.monotonic() - sent
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    assert code == 128 + signal.SIGTERM
    assert STUCK_GRACE_S - 0.5 <= elapsed < STUCK_GRACE_S + 10, elapsed
