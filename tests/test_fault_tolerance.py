"""Fault tolerance end to end, on real multi-process jobs: checkpoints, exact resume, restarts
driven by torch elastic, damaged checkpoints refused, and a hang diagnosed by the timeout."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import duckdb
import pytest
import torch

from ranktrace.analysis.store import store_path
from ranktrace.trainer.checkpoint import COMPLETE_MARKER, complete_checkpoints
from tests.conftest import ranktrace, ranktrace_in_process

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)

TINY = ("--model", "tiny", "--seq-len", "32", "--global-batch", "8", "--data", "synthetic")


def _train(runs_dir: Path, name: str, *args: str):
    result = ranktrace("train", *TINY, "--run-name", name, *args, runs_dir=runs_dir)
    runs = [r for r in result.runs() if r["name"] == name]
    return result, runs[0]


def _weights(runs_dir: Path, record: dict) -> dict:
    return torch.load(runs_dir / record["run_id"] / "weights.pt", weights_only=True)


def _assert_same_weights(a: dict, b: dict) -> None:
    """Parameters and last gradients, bit for bit."""
    assert a.keys() == b.keys()
    for part in a:
        assert a[part].keys() == b[part].keys()
        for name in a[part]:
            assert torch.equal(a[part][name], b[part][name]), (part, name)


def _report(runs_dir: Path, run: str) -> dict:
    result = ranktrace("report", run, "--json", "--runs-dir", str(runs_dir), runs_dir=runs_dir)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _query(runs_dir: Path, sql: str, *params):
    con = duckdb.connect(str(store_path(runs_dir)), read_only=True)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()


def test_restart_rehearsal_resumes_bitwise_on_tp2_dp2_zero2(runs_dir):
    """A rank dies at step 5; torch elastic restarts the job, which resumes from the step-3
    checkpoint without a person: every loss and the final weights equal the uninterrupted run
    (fp32, tp=2 pp=1 dp=2, ZeRO-2)."""
    layout = ("--tp", "2", "--dp", "2", "--zero", "2", "--precision", "fp32", "--steps", "8")
    save = ("--checkpoint-every", "3", "--checkpoint-keep", "1", "--save-weights")
    plain, reference = _train(runs_dir, "straight", *layout, "--save-weights")
    assert plain.returncode == 0, plain.stdout[-2000:]
    crash = ("--inject", "crash:rank=3,step=5", "--max-restarts", "1")
    result, record = _train(runs_dir, "restarted", *layout, *save, *crash)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert record["status"] == "completed"
    assert record["losses"] == reference["losses"]  # bit for bit, all 8 steps
    _assert_same_weights(_weights(runs_dir, record), _weights(runs_dir, reference))
    assert record["restarts"][0]["resumed_from_step"] == 3
    # Keep 1: only the latest complete checkpoint (before step 6) is left.
    kept = complete_checkpoints(runs_dir / record["run_id"])
    assert [p.name for p in kept] == ["step-00000006"]
    # Telemetry of both attempts, each step once; the redone steps are the restart's cost.
    rows = _query(runs_dir, "SELECT count(*), count(DISTINCT (rank, step)), max(attempt) "
                  "FROM steps WHERE run_id = ?", record["run_id"])  # fmt: skip
    assert rows == [(32, 32, 1)]
    report = _report(runs_dir, record["run_id"])
    (restart,) = report["restarts"]
    assert (restart["how"], restart["resumed_from_step"], restart["steps_redone"]) == (
        "restart", 3, 2)  # fmt: skip
    assert restart["cause"] == "rank 3 crashed at step 5"
    assert report["checkpoints"]["complete"] == 2
    assert report["checkpoints"]["expected_lost_work_s"] > 0
    assert report["stragglers"] == []


def test_resume_of_a_3d_zero1_run_continues_bitwise(runs_dir):
    """tp=2 pp=2 dp=2 ZeRO-1: a run that crashed at step 4 (no restarts) is continued by
    `ranktrace train --resume RUN`; losses and final weights equal the uninterrupted run."""
    layout = ("--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1", "--precision", "fp32",
              "--steps", "6", "--save-weights")  # fmt: skip
    plain, reference = _train(runs_dir, "straight", *layout)
    assert plain.returncode == 0, plain.stdout[-2000:]
    crashed, record = _train(runs_dir, "crashed", *layout, "--checkpoint-every", "2",
                             "--inject", "crash:rank=5,step=4")  # fmt: skip
    assert crashed.returncode == 1 and record["status"] == "failed"
    resumed = ranktrace("train", "--resume", record["run_id"], runs_dir=runs_dir)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    record = json.loads((runs_dir / record["run_id"] / "run.json").read_text())
    assert record["status"] == "completed" and record["attempt"] == 1
    assert record["losses"] == reference["losses"]
    _assert_same_weights(_weights(runs_dir, record), _weights(runs_dir, reference))
    events = _query(runs_dir, "SELECT detail FROM events WHERE run_id = ? AND kind = 'restart'",
                    record["run_id"])  # fmt: skip
    (event,) = [json.loads(e[0]) for e in events]
    # The save before step 4 may still be in flight when rank 5 dies at its start: then the
    # latest complete checkpoint is the one before step 2. Either way the losses match.
    assert event["how"] == "resume" and event["resumed_from_step"] in (2, 4)
    assert record["restarts"][-1]["resumed_from_step"] == event["resumed_from_step"]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """dp=2, bf16: rank 1's checkpoint write before step 4 is slowed by 6 s (an `io` fault)
    and rank 0 crashes at step 5, while that save is still in flight. Read-only: tests that
    resume or damage it work on a copy."""
    runs_dir = tmp_path_factory.mktemp("interrupted") / "runs"
    result, record = _train(
        runs_dir, "interrupted", "--dp", "2", "--steps", "7", "--checkpoint-every", "2",
        "--inject", "io:rank=1,delay=6,from=3,to=3", "--inject", "crash:rank=0,step=5",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-2000:]
    return runs_dir, record, result.stdout


@pytest.fixture
def interrupted_save(interrupted) -> tuple[Path, dict]:
    runs_dir, record, _ = interrupted
    return runs_dir, record


def test_injected_crash_kills_the_rank_and_is_recorded(interrupted):
    """The launcher names the crashed rank; the store keeps the failed run and the crash."""
    runs_dir, record, output = interrupted
    assert "ranktrace train: error: run" in output and "rank 0 of 2" in output, output[-2000:]
    report = _report(runs_dir, record["run_id"])
    assert report["status"] == "failed"
    crashes = [e for e in report["events"] if e["kind"] == "crash"]
    assert [(e["rank"], e["step"]) for e in crashes] == [(0, 5)]


def test_crash_during_an_async_save_leaves_the_previous_checkpoint_usable(
    interrupted_save, tmp_path
):
    runs_dir, run_id = _copy_of_run(interrupted_save, tmp_path)  # resumed in a copy
    record = json.loads((runs_dir / run_id / "run.json").read_text())
    run = runs_dir / run_id
    assert [p.name for p in complete_checkpoints(run)] == ["step-00000002"]
    assert not (run / "checkpoints" / "step-00000004" / COMPLETE_MARKER).exists()
    first_losses = record["losses"]  # steps 0-4 of the crashed attempt
    assert len(first_losses) == 5
    resumed = ranktrace("train", "--resume", record["run_id"], runs_dir=runs_dir)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    record = json.loads((run / "run.json").read_text())
    assert record["restarts"][-1]["resumed_from_step"] == 2
    # bf16 compute, fp32 master weights: the redone steps 2-4 repeat the first attempt's
    # losses exactly (the stated tolerance is 0: the state, bf16 copy included, is saved whole).
    assert record["losses"][:5] == first_losses
    assert len(record["losses"]) == 7 and record["status"] == "completed"
    kept = [p.name for p in complete_checkpoints(run)]  # --checkpoint-keep 3 (the default)
    assert kept == ["step-00000002", "step-00000004", "step-00000006"]


def _copy_of_run(interrupted_save, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the interrupted run in a runs dir of its own; (runs dir, run id)."""
    runs_dir, record = interrupted_save
    copy = tmp_path / "runs"
    shutil.copytree(runs_dir / record["run_id"], copy / record["run_id"])
    return copy, record["run_id"]


@pytest.mark.parametrize("damage", ["truncated shard", "garbled metadata", "no checkpoint"])
def test_damaged_or_missing_checkpoint_is_a_one_line_error(interrupted_save, tmp_path, damage):
    runs_dir, run_id = _copy_of_run(interrupted_save, tmp_path)
    latest = complete_checkpoints(runs_dir / run_id)[-1]
    if damage == "truncated shard":
        shard = latest / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])
        expected = "is damaged: __0_0.distcp has 100 bytes"
    elif damage == "garbled metadata":
        metadata = latest / ".metadata"
        metadata.write_bytes(b"\0" * metadata.stat().st_size)
        expected = "is damaged: its .metadata does not load"
    else:
        shutil.rmtree(runs_dir / run_id / "checkpoints")
        expected = f"run {run_id} has no complete checkpoint to resume from"
    before = json.loads((runs_dir / run_id / "run.json").read_text())
    result = ranktrace_in_process("train", "--resume", run_id, runs_dir=runs_dir)
    assert result.returncode == 2
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
    # No silent fresh start: nothing trained, nothing rewritten.
    assert json.loads((runs_dir / run_id / "run.json").read_text()) == before


def test_resume_refuses_a_changed_layout_and_unknown_runs(interrupted_save, tmp_path):
    runs_dir, run_id = _copy_of_run(interrupted_save, tmp_path)
    changed = ranktrace_in_process("train", "--resume", run_id, "--tp", "2", runs_dir=runs_dir)
    assert changed.returncode == 2
    assert "--tp cannot change on --resume" in changed.stderr
    unknown = ranktrace_in_process("train", "--resume", "no-such-run", runs_dir=runs_dir)
    assert unknown.returncode == 2 and "no run with id or name no-such-run" in unknown.stderr
    name = json.loads((Path(runs_dir) / run_id / "run.json").read_text())["name"]
    by_name = ranktrace_in_process("train", "--resume", name, "--tp", "2", runs_dir=runs_dir)
    assert by_name.returncode == 2  # the run was found by its name, then its layout checked
    assert "--tp cannot change on --resume" in by_name.stderr


def test_collective_timeout_names_the_hung_rank_and_exits(runs_dir):
    """pp=2 dp=2: rank 1 stops at step 3. Rank 0 waits for it in a dp all-reduce, rank 3 in a
    pp receive; rank 2 waits for rank 3. The diagnosis names rank 1 only, the job exits
    non-zero within timeout + a few seconds, and the steps before the hang are kept."""
    timeout_s = 3.0
    started = time.time()
    result, record = _train(
        runs_dir, "hung", "--pp", "2", "--dp", "2", "--steps", "20",
        "--inject", "hang:rank=1,step=3", "--collective-timeout", str(timeout_s),
    )  # fmt: skip
    ended = time.time()
    assert result.returncode == 1 and record["status"] == "failed"
    assert "stopped by the collective timeout" in record["error"]
    assert "HUNG: rank 1 at step 3, in no collective" in result.stdout, result.stdout[-2000:]
    (hang_ns,) = _query(runs_dir, "SELECT time_ns FROM events WHERE kind = 'hang'")[0]
    assert hang_ns / 1e9 > started
    assert ended - hang_ns / 1e9 < timeout_s + 10, "the job took too long to exit"
    report = _report(runs_dir, "hung")
    (hang,) = report["hangs"]
    assert hang["rank"] == 1 and hang["step"] == 3
    assert {b["rank"] for b in hang["blocked"]} == {0, 3}
    steps = _query(runs_dir, "SELECT count(*), max(step) FROM steps")
    assert steps == [(12, 2)]  # steps 0-2 on all 4 ranks survived
    alerts = _query(runs_dir, "SELECT count(*) FROM events WHERE kind = 'collective_timeout'")
    assert alerts == [(3,)]  # ranks 0, 2, 3 were waiting in a collective
    watched = ranktrace_in_process("watch", "hung", "--runs-dir", str(runs_dir), runs_dir=runs_dir)
    lines = watched.stdout.splitlines()  # a watch of the run says who hung, and no all-clear
    assert watched.returncode == 0 and lines[0].startswith("HUNG: rank 1 at step 3"), lines
    assert lines[-1].startswith("run ") and " failed: " in lines[-1], lines
    assert "too few for a verdict" in lines[-1], lines


def test_minute_cadence_saves_on_every_rank_at_the_same_steps(runs_dir):
    """--checkpoint-minutes: rank 0's clock decides, the loss all-reduce carries its vote, so
    every rank saves at the same steps; each save ends complete."""
    result, _ = _train(runs_dir, "timed", "--dp", "2", "--steps", "6",
                       "--checkpoint-minutes", "0.001")  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:]
    saves_by_step = (
        "SELECT detail::JSON ->> 'next_step' AS step, list(rank ORDER BY rank) FROM events "
        "WHERE kind = 'checkpoint_saved' GROUP BY ALL ORDER BY 1"
    )
    rows = _query(runs_dir, saves_by_step)
    assert len(rows) >= 2
    assert all(ranks == [0, 1] for _, ranks in rows)
    complete = _query(runs_dir, "SELECT count(*) FROM events WHERE kind = 'checkpoint_complete'")
    assert complete == [(len(rows),)]
    report = _report(runs_dir, "timed")
    assert report["checkpoints"]["every_minutes"] == 0.001
    assert report["checkpoints"]["saves"] == len(rows)
