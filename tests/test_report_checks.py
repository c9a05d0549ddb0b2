"""A report's own checks: the self-check catches numbers that contradict each other (each
invariant broken on purpose here), and a report says plainly when it has no verdict."""

from __future__ import annotations

import copy

import pytest

from ranktrace.analysis.self_check import contradictions
from ranktrace.analysis.verdict import MIN_VERDICT_STEPS, apply_verdict
from ranktrace.app.report_text import finding_lines

CONSISTENT = {
    # one slow worker of 16 acting alone: at its peers' pace it saves 52.3%, and 15/16 of that
    # is 1 - 1/S_X (49.0% at 1.961): the ideal S_X divides by holds 1/16 of its excess
    "slowdown": 1.961,
    "slowdown_detail": {"ranks": 16},
    "slowdown_by": {"rank": {"0": 1.961, "1": 1.01, "2": 1.0}, "stage": {"0": 1.95, "1": 1.0}},
    "slowdown_by_cause": [{"cause": "rank 0 compute", "kind": "compute", "rank": 0, "stage": None,
                           "saved_pct": 52.3, "share_pct": 101.0, "slowdown_without": 0.99}],
    "slowdown_remainder": {"share_pct": -1.0},
    "stragglers": [{"rank": 0, "pp": 0, "kind": "compute", "cost_pct": 52.3}],
    "imbalances": [],
}  # fmt: skip


def broken(**changes) -> dict:
    report = copy.deepcopy(CONSISTENT)
    cause = report["slowdown_by_cause"][0]
    for key, value in changes.items():
        if key in cause:
            cause[key] = value
        else:
            report[key] = value
    return report


def test_a_consistent_report_passes():
    assert contradictions(CONSISTENT) == []


def test_fixing_a_cause_that_lengthens_the_step_is_caught():
    lines = contradictions(broken(saved_pct=-4.0, slowdown_without=2.04))
    assert lines[0].startswith("fixing rank 0 compute lengthens the step")


def test_a_lone_cause_saving_other_than_its_own_slowdown_says_is_caught():
    """The issue's trace: S by rank 0 1.961x beside "rank 0 compute costs 5.1%"."""
    (line,) = contradictions(broken(saved_pct=5.1, share_pct=100.0,
                                    slowdown_remainder={"share_pct": 0.0}))  # fmt: skip
    assert "acts alone" in line and "49.0%" in line


def test_a_cause_beside_another_is_not_held_to_its_own_slowdown():
    report = broken(saved_pct=5.1, share_pct=100.0, slowdown_remainder={"share_pct": 0.0})
    report["slowdown_by"]["rank"]["2"] = 1.3  # another rank slows the job too
    assert contradictions(report) == []


def test_shares_that_do_not_sum_to_a_hundred_are_caught():
    (line,) = contradictions(broken(share_pct=110.0))
    assert "sum to 109.0%" in line


def report_of(steps: int, recorded: int) -> dict:
    report = copy.deepcopy(CONSISTENT)
    report["steps"], report["efficiency_drops"] = steps, [{"step": 3}]
    apply_verdict(report, recorded)
    return report


def test_too_few_steps_give_no_verdict_and_say_why():
    """A one-step profiler trace named a random imbalance costing 17.9% beside S = 1.022x."""
    report = report_of(steps=1, recorded=2)
    assert report["verdict"] == "too_few_steps"
    assert report["stragglers"] == report["imbalances"] == report["slowdown_by_cause"] == []
    assert report["efficiency_drops"] == [] and report["slowdown_remainder"] is None
    assert finding_lines(report)[0].startswith("1 steps: too few for a verdict")
    assert report["slowdown"] == 1.961  # what is measurable stays


def test_a_run_without_a_step_is_no_data_never_healthy():
    report = report_of(steps=0, recorded=0) | {"launcher": "ranktrace run"}
    apply_verdict(report, 0)
    assert report["verdict"] == "no_data"
    assert finding_lines(report) == [
        "no training step was recorded: no optimizer step was seen "
        "— mark steps with `ranktrace.step()` (docs/instrumenting.md)"
    ]


@pytest.mark.parametrize("found, verdict", [(True, "findings"), (False, "healthy")])
def test_enough_steps_give_a_verdict(found, verdict):
    report = copy.deepcopy(CONSISTENT) | {"steps": MIN_VERDICT_STEPS, "efficiency_drops": []}
    if not found:
        report["stragglers"] = []
    apply_verdict(report, MIN_VERDICT_STEPS + 1)
    assert report["verdict"] == verdict and report["verdict_detail"] is None


def test_a_lone_rank_of_two_is_held_to_the_half_of_its_saving_the_ideal_leaves_out():
    """Measured (tests/test_contention.py): rank 1 of 2 saved 50.8% at its peer's pace, S_X
    1.380 (1 - 1/S_X = 27.5%): the ideal, the mean of the two ranks, holds half its excess.
    Its single peer sets the pace it is fixed at: where the peer ran slow (a run here saved
    51.3% at S_X 1.479: half of it 6.8 points short) the saving falls short, never beyond."""
    report = broken(saved_pct=50.8, share_pct=100.0, slowdown_remainder={"share_pct": 0.0})
    report["slowdown_detail"]["ranks"] = 2
    report["layout"] = {"tp": 1, "pp": 1, "dp": 2}
    report["slowdown_by"] = {"rank": {"0": 1.0, "1": 1.380}, "stage": {"0": 1.380}}
    report["slowdown_by_cause"][0]["rank"] = 1
    report["stragglers"][0]["rank"] = 1
    assert contradictions(report) == []
    report["slowdown_by"]["rank"]["1"] = report["slowdown_by"]["stage"]["0"] = 1.479
    report["slowdown_by_cause"][0]["saved_pct"] = 51.3
    assert contradictions(report) == []
    report["slowdown_by_cause"][0]["saved_pct"] = 72.0  # 36.0% against 32.4%
    assert "acts alone" in contradictions(report)[0]


def test_a_lone_rank_found_after_the_replays_first_step_may_only_save_less():
    """Rank 1 of 4 (dp 4: 3 peers, whose median pace is smooth) at S_X 1.358 (1 - 1/S_X
    26.4%), three quarters of its 30.1% saving 3.8 points short (as a CI run of a rank busy from
    step 1, found from step 5, was): its excess of steps 1-4 is in S_X, not in its saving. Found
    from step 1, that is a contradiction; nor may a finding of some steps save more than its
    rank's S_X says."""
    report = broken(saved_pct=30.1, share_pct=100.0, slowdown_remainder={"share_pct": 0.0})
    report["slowdown_detail"].update(ranks=4, first_step=1, last_step=39)
    report["layout"] = {"tp": 1, "pp": 1, "dp": 4}
    report["slowdown_by"] = {"rank": {"0": 1.0, "1": 1.358}, "stage": {"0": 1.358}}
    report["slowdown_by_cause"][0]["rank"] = 1
    report["stragglers"][0].update(rank=1, first_step=5, last_step=39, steps=[])
    assert contradictions(report) == []
    report["slowdown_by_cause"][0]["saved_pct"] = 40.0  # 30.0% against 26.4%
    assert "acts alone" in contradictions(report)[0]
    report["slowdown_by_cause"][0]["saved_pct"] = 30.1
    report["stragglers"][0]["first_step"] = 1
    assert "acts alone" in contradictions(report)[0]


def test_a_replay_off_the_measured_steps_withholds_the_costs_not_the_findings():
    report = copy.deepcopy(CONSISTENT) | {"steps": MIN_VERDICT_STEPS, "efficiency_drops": []}
    report["slowdown_detail"]["replay_error_pct"] = -21.0
    apply_verdict(report, MIN_VERDICT_STEPS + 1)
    assert report["verdict"] == "findings" and report["stragglers"]
    assert report["slowdown_by_cause"] == []
    assert report["verdict_detail"].startswith("the replay is -21.0% off the measured steps")


@pytest.mark.parametrize(("dp", "checked"), [(4, True), (1, False)])
def test_a_lone_stage_imbalance_is_held_to_its_slowdown_where_its_stage_has_peers(dp, checked):
    """A stage cause acting alone: with 4 ranks a stage (as the published traces), a saving of
    10.3% at S_X 1.057 (5.4%) contradicts it; on one rank a stage (a 2-stage pipelining job
    split 3,1 measured exactly this) the ideal's share of the stage's excess is not
    established, and nothing is claimed."""
    report = broken(saved_pct=10.3, share_pct=100.0, slowdown_remainder={"share_pct": 0.0})
    report["layout"] = {"tp": 1, "pp": 2, "dp": dp}
    report["slowdown_by"] = {"rank": {"0": 1.057, "1": 1.011}, "stage": {"0": 1.057, "1": 1.011}}
    report["slowdown_by_cause"] = [{"cause": "stage 0 stage imbalance", "kind": "stage",
                                    "stage": 0, "rank": None, "saved_pct": 10.3,
                                    "share_pct": 100.0, "slowdown_without": 1.01}]  # fmt: skip
    report["stragglers"] = []
    assert bool(contradictions(report)) == checked, contradictions(report)
