"""A long run's report computed window by window (analysis/window_merge.py) against the same
run's report computed in one piece: benchmarks/store_scale.py's synchronous run (16 ranks, rank
5's work 30% more from its onset), windows of 40 steps (the analysis windows' sizes lowered to
fit the suite; a run of 1,024 ranks is analysed 512 steps at a time)."""

from __future__ import annotations

import sys

import pytest

from ranktrace.analysis import part_cache, windows
from ranktrace.analysis.ingest import ingest
from ranktrace.analysis.run import cached_report, report
from ranktrace.analysis.store import open_reader
from ranktrace.telemetry.run_record import read_run_json, write_run_json
from tests.compare import assert_same
from tests.conftest import REPO, ranktrace_in_process

sys.path.insert(0, str(REPO / "benchmarks"))

import store_scale

RANKS, STEPS, WINDOW = 16, 120, 40


def _reports(runs_dir, monkeypatch) -> tuple[dict, dict]:
    """(in one piece, window by window) reports of the synthetic run in `runs_dir`."""
    ingest(runs_dir, window_steps=WINDOW // 2)
    results = []
    for analysis_steps in (STEPS, WINDOW):
        monkeypatch.setattr(windows, "MIN_ANALYSIS_STEPS", analysis_steps)
        monkeypatch.setattr(windows, "ANALYSIS_RANK_STEPS", 0)
        con = open_reader(runs_dir)
        try:
            spans = windows.analysis_spans(con, store_scale.RUN_ID, RANKS)
            assert len(spans) == (STEPS // analysis_steps if analysis_steps < STEPS else 0)
            results.append(report(con, store_scale.RUN_ID))  # strict self-check (conftest)
        finally:
            con.close()
    return results[0], results[1]


@pytest.fixture(scope="module")
def onset_in_a_window(tmp_path_factory) -> tuple[dict, dict]:
    """Rank 5 slow from step 50: inside the second window, to the run's end."""
    runs_dir = tmp_path_factory.mktemp("windowed") / "runs"
    store_scale.write_run(runs_dir / store_scale.RUN_ID, RANKS, STEPS, segment_steps=20,
                          slow_from=50)  # fmt: skip
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _reports(runs_dir, monkeypatch)


def test_a_finding_across_windows_is_joined_from_its_onset(onset_in_a_window):
    whole, windowed = onset_in_a_window
    (one,) = whole["stragglers"]
    (joined,) = windowed["stragglers"]
    assert (joined["rank"], joined["kind"], joined["pattern"]) == (5, "compute", "chronic")
    assert abs(joined["first_step"] - 50) <= 2 and joined["last_step"] == STEPS - 1, joined
    assert abs(joined["cost_pct"] - one["cost_pct"]) <= 2.0, (joined, one)
    assert joined["slow_steps"] == one["slow_steps"]
    assert abs(windowed["slowdown"] / whole["slowdown"] - 1) < 0.03
    assert windowed["slowdown_detail"]["windows"] == STEPS // WINDOW
    (cause,) = windowed["slowdown_by_cause"]
    assert cause["rank"] == 5 and abs(cause["saved_pct"] - joined["cost_pct"]) < 0.01
    shares = cause["share_pct"] + windowed["slowdown_remainder"]["share_pct"]
    assert abs(shares - 100) < 1e-6
    assert windowed["self_check"] == []


def test_per_step_figures_are_the_whole_runs(onset_in_a_window):
    """The step time, MFU and efficiency drops come from every step, whatever the windows."""
    whole, windowed = onset_in_a_window
    for key in ("steps", "step_time_s", "mfu", "efficiency_drops", "memory"):
        assert windowed[key] == whole[key], key
    # read over the whole run both times (DuckDB's parallel sums vary in their last digits)
    assert_same(windowed["topology"], whole["topology"])


def test_a_finding_of_one_window_too_small_for_the_run_is_a_note(tmp_path, monkeypatch):
    """Rank 5 slow over the last 10 steps only: about 5% of its window but under 2% of the
    run, too little to report in one piece or in windows; the windows say so in a note."""
    runs_dir = tmp_path / "runs"
    store_scale.write_run(runs_dir / store_scale.RUN_ID, RANKS, STEPS, segment_steps=20,
                          slow_from=STEPS - 10)  # fmt: skip
    whole, windowed = _reports(runs_dir, monkeypatch)
    assert whole["stragglers"] == windowed["stragglers"] == []
    assert windowed["slowdown_by_cause"] == []
    (note,) = [n for n in windowed["notes"] if "too little to report" in n]
    assert note.startswith("rank 5 was a compute straggler") and "110-119" in note


def _land(staging, runs_dir, last_step: int) -> None:
    """Copy the staging run's segments holding steps up to `last_step` (those not yet there)
    into the run under `runs_dir`, which is still training."""
    import shutil

    import pyarrow.parquet as pq

    from ranktrace.analysis.store import segment_files

    live = runs_dir / staging.name
    for kind in ("rank", "steps", "spans"):
        for path in segment_files(staging, kind):
            target = live / path.relative_to(staging)
            first = pq.read_table(path).column("step")[0].as_py() if kind != "rank" else -1
            if first <= last_step and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
    write_run_json(live, {**read_run_json(staging), "status": "running"})


def _parts_folder(runs_dir):
    root = windows.windows_root(runs_dir)
    return part_cache.parts_dir(windows.run_windows_dir(root, store_scale.RUN_ID))


def _kept(runs_dir) -> dict[str, int]:
    """{file: modification time} of the live run's kept analysis windows (part_cache)."""
    return {
        p.name: p.stat().st_mtime_ns for p in _parts_folder(runs_dir).glob(f"*{part_cache.SUFFIX}")
    }


def _stored_report(runs_dir) -> dict:
    con = open_reader(runs_dir)
    try:
        return cached_report(con, store_scale.RUN_ID)
    finally:
        con.close()


def test_a_live_run_is_diagnosed_once_per_closed_analysis_window(
    onset_in_a_window, tmp_path, monkeypatch
):
    """The same run ingested window by window while it trains (`watch`): an analysis window
    closes once it holds 40 steps and is diagnosed once, not again as the run grows (its kept
    part is reused); the report with kept parts is the one computed afresh; once the run ends
    its report is the whole run's, as if ingested after it, and the kept parts are gone; a
    `watch` begun while it trains says what was found so far, then that the run looks stalled
    when no window comes; one begun after keeps the stored windows (its size is for runs not
    stored)."""
    monkeypatch.setattr(windows, "MIN_ANALYSIS_STEPS", WINDOW)
    monkeypatch.setattr(windows, "ANALYSIS_RANK_STEPS", 0)
    staging = tmp_path / "staging" / store_scale.RUN_ID
    store_scale.write_run(staging, RANKS, STEPS, segment_steps=20, slow_from=50)
    runs_dir = tmp_path / "runs"
    _land(staging, runs_dir, 99)  # steps 0-99: analysis windows 0-39, 40-79 closed, 80-99 open
    ingest(runs_dir, window_steps=WINDOW // 2, complete_only=True)
    early = _kept(runs_dir)
    assert len(early) == 2
    (found,) = _stored_report(runs_dir)["stragglers"]
    assert (found["rank"], found["kind"]) == (5, "compute") and abs(found["first_step"] - 50) <= 2

    _land(staging, runs_dir, STEPS - 1)  # 80-119 closes: diagnosed; the first two are kept
    ingest(runs_dir, window_steps=WINDOW // 2, complete_only=True)
    later = _kept(runs_dir)
    assert len(later) == 3 and all(later[name] == early[name] for name in early), (early, later)
    live = _stored_report(runs_dir)
    watched = ranktrace_in_process(
        "watch", store_scale.RUN_ID, "--runs-dir", str(runs_dir), "--interval", "0.1",
        "--stall", "0.3", "--timeout", "1", runs_dir=runs_dir,
    )  # fmt: skip
    lines = watched.stdout.splitlines()  # begun now: what it found so far, then no new window
    assert watched.returncode == 1 and "rank 5 " in lines[0] and " compute, " in lines[0], lines
    assert "after step 119" in lines[1] and "the job looks stalled" in lines[1], lines
    part_cache.forget(_parts_folder(runs_dir))
    con = open_reader(runs_dir)
    try:
        assert_same(live, report(con, store_scale.RUN_ID))  # diagnosed afresh, every window
    finally:
        con.close()

    write_run_json(runs_dir / store_scale.RUN_ID, read_run_json(staging))  # the run ended
    ingest(runs_dir, window_steps=WINDOW // 2, complete_only=True)
    _, after_the_run = onset_in_a_window
    assert_same(_stored_report(runs_dir), after_the_run)
    assert not _parts_folder(runs_dir).exists()
    # a watch now (no --window): the stored run keeps its windows of 20 steps, none rewritten
    listed = "SELECT window_index, generation, end_step FROM windows ORDER BY 1"
    before = _rows(runs_dir, listed)
    watched = ranktrace_in_process("watch", store_scale.RUN_ID, "--runs-dir", str(runs_dir),
                                   runs_dir=runs_dir)  # fmt: skip
    assert watched.returncode == 0, watched.stderr
    assert "completed: 6 window(s) of 20 steps" in watched.stdout.splitlines()[-1], watched.stdout
    assert _rows(runs_dir, listed) == before and len(before) == 6


def _rows(runs_dir, sql: str) -> list[tuple]:
    con = open_reader(runs_dir)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()
