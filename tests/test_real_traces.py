"""Real traces nobody here shaped: `ranktrace import per-op` of the published ST trace
(tests/data/perop-ST: 8 GPUs, pp=4 dp=2, Megatron 1F1B, a long last stage) must reproduce its
recorded step times and the published what-if figures (tests/data/perop-ST/README.md)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, ranktrace

ST = REPO / "tests/data/perop-ST/trace.parquet"
PUBLISHED = {"launch_slowdown": 1.019, "slowdown": 1.179, "stage 3": 1.232}
FIGURE_RTOL = 0.05  # the bound; measured: within 1.3%


@pytest.fixture(scope="module")
def st_report(tmp_path_factory) -> dict:
    runs_dir = tmp_path_factory.mktemp("st") / "runs"
    imported = ranktrace("import", "per-op", str(ST), "--pp", "4", "--dp", "2", "--name", "st",
                         "--runs-dir", str(runs_dir), runs_dir=runs_dir)  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    result = ranktrace("report", "st", "--json", "--runs-dir", str(runs_dir), runs_dir=runs_dir)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_replay_reproduces_every_recorded_step(st_report):
    detail = st_report["slowdown_detail"]
    assert detail["replay_model"] == "rendezvous" and detail["steps"] == 32
    assert detail["replay_error_abs_pct_median"] <= 2.0  # measured: 0.02%
    assert detail["replay_error_abs_pct_max"] <= 5.0  # measured: 0.07%


def test_launch_slowdown_s_and_the_long_stage_match_the_published_figures(st_report):
    detail, by = st_report["slowdown_detail"], st_report["slowdown_by"]
    assert detail["launch_slowdown"] == pytest.approx(PUBLISHED["launch_slowdown"],
                                                      rel=FIGURE_RTOL)  # fmt: skip
    assert st_report["slowdown"] == pytest.approx(PUBLISHED["slowdown"], rel=FIGURE_RTOL)
    assert by["stage"]["3"] == pytest.approx(PUBLISHED["stage 3"], rel=FIGURE_RTOL)
    assert all(0.95 <= by["stage"][s] <= 1.02 for s in ("0", "1", "2"))  # published 0.98-1.00


def test_stage_3_is_named_and_no_worker_is_blamed(st_report):
    assert st_report["stragglers"] == []
    (imbalance,) = st_report["imbalances"]
    assert (imbalance["kind"], imbalance["stage"]) == ("stage", 3)
    worst = max(st_report["slowdown_by"]["stage"].items(), key=lambda item: item[1])
    assert worst[0] == "3"
