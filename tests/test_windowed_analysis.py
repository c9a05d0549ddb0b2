"""A long run's report computed window by window (analysis/window_merge.py) against the same
run's report computed in one piece: benchmarks/store_scale.py's synchronous run (16 ranks, rank
5's work 30% more from its onset), windows of 40 steps (the analysis windows' sizes lowered to
fit the suite; a run of 1,024 ranks is analysed 512 steps at a time)."""

from __future__ import annotations

import sys

import pytest

from ranktrace.analysis import windows
from ranktrace.analysis.ingest import ingest
from ranktrace.analysis.run import report
from ranktrace.analysis.store import open_reader
from tests.compare import assert_same
from tests.conftest import REPO

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
