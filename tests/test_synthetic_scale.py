"""benchmarks/store_scale.py's synthetic run, at a size the suite can afford: a synchronous
job (its peers wait for the slow rank inside their collectives), so the replay reproduces its
recorded steps and the straggler is named on its rank, from its onset."""

from __future__ import annotations

import sys

from ranktrace.analysis.ingest import ingest
from ranktrace.analysis.run import report
from ranktrace.analysis.store import open_reader
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import store_scale


def test_the_synthetic_run_replays_its_own_steps_and_names_rank_5(tmp_path):
    runs_dir = tmp_path / "runs"
    store_scale.write_run(runs_dir / store_scale.RUN_ID, 64, 40)  # tp 8 x pp 8, slow from 20
    ingest(runs_dir)
    con = open_reader(runs_dir)
    try:
        result = report(con, store_scale.RUN_ID)
    finally:
        con.close()
    detail = result["slowdown_detail"]
    assert abs(detail["replay_error_pct"]) < 2 and detail["replay_error_abs_pct_max"] < 5, detail
    (finding,) = result["stragglers"]
    assert (finding["rank"], finding["kind"], finding["pattern"]) == (5, "compute", "chronic")
    assert abs(finding["first_step"] - 20) <= 2, finding
    # rank 5's work 30% more in the last 20 of 39 steps, the job's step set by its slowest
    # rank (the healthy max over 64 ranks' ±2% noise is ~5% above the mean): ~24% longer
    # steps in half the run, 20 x 0.24 / (19 x 1.05 + 20 x 1.3) = 10% of the run's time
    assert 7 < finding["cost_pct"] < 13, finding
