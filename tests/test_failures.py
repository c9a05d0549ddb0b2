"""A rank that dies takes the whole job down promptly, names itself, and marks the run failed."""

from __future__ import annotations

import json
import os
import signal
import time

from tests.conftest import start_training, wait_for
from trainer.run_record import read_rank_info

FAIL_WITHIN_S = 30  # from the kill to the launcher's exit; seen: about 1 s


def _steps_done(runs_dir):
    for path in runs_dir.glob("*/run.json"):
        record = json.loads(path.read_text())
        if len(record["losses"]) >= 2:
            return path.parent
    return None


def test_killed_rank_fails_the_job_within_seconds_and_is_named(runs_dir):
    proc = start_training(
        "--tp",
        "2",
        "--dp",
        "2",
        "--steps",
        "100000",
        "--log-every",
        "1",
        "--seq-len",
        "32",
        runs_dir=runs_dir,
    )
    try:
        run = wait_for(lambda: _steps_done(runs_dir), 120, "two training steps")
        victim = read_rank_info(run)[2]
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        output, _ = proc.communicate(timeout=FAIL_WITHIN_S + 30)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < FAIL_WITHIN_S, f"job took {elapsed:.1f} s to fail"
    assert "rank 2 of 4 killed by SIGKILL" in output, output[-2000:]
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "failed"
    assert "rank 2" in record["error"]
    assert len(record["losses"]) >= 2  # what was recorded before the failure is kept
