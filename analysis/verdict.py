"""Enough evidence or no verdict. A report says one of:

- `findings`: stragglers or imbalances were found;
- `healthy`: enough steps were analysed and nothing was found;
- `too_few_steps`: fewer than `MIN_VERDICT_STEPS` steps after the warm-up step. A straggler
  needs steps to stand out from its peers' noise (a chronic one 8, `stragglers.
  CHRONIC_MIN_STEPS`), so no straggler or imbalance is named or priced, and the report shows
  only what is measurable (step times, S and its factors, an imported trace's GPU time split);
- `no_data`: no training step was recorded at all: never read as healthy.

Costs come from the replay: where it reproduces the measured steps worse than
`REPLAY_ERROR_BAND_PCT`, the causes' savings are withheld and `verdict_detail` says so; the
findings, from the peers' comparison, stand.
"""

from __future__ import annotations

import duckdb

from ranktrace.telemetry.names import INCOMPLETE_STEP_SEEN as SEEN_MARK

FINDINGS, HEALTHY, TOO_FEW_STEPS, NO_DATA = "findings", "healthy", "too_few_steps", "no_data"
MIN_VERDICT_STEPS = 8
"""Steps after the warm-up step a verdict needs: a chronic straggler's stretch (8 steps), and
at most 10 so that one window of a live run holds it."""
REPLAY_ERROR_BAND_PCT = 15.0
"""|replayed - measured| over the analysed steps, % of measured, within which costs are given.
Measured on this machine's real runs of 8+ steps (trainer runs with faults and healthy, the
demo, DDP/FSDP2/pipelining jobs under `ranktrace run`, 36 runs): 0.0 to 7.9%; the real ST
trace 0.0%. Twice the worst seen."""
WITHHELD = ("stragglers", "imbalances", "slowdown_by_cause", "efficiency_drops")
"""What a report without a verdict leaves empty: each needs enough steps to mean anything."""


def recorded_steps(con: duckdb.DuckDBPyConnection, run_id: str) -> int:
    """Steps any rank of the run recorded, the warm-up step included."""
    (count,) = con.execute("SELECT count(DISTINCT step) FROM steps WHERE run_id = ?",
                           [run_id]).fetchone()  # fmt: skip
    return int(count)


def apply_verdict(report: dict, recorded: int) -> None:
    """Set `verdict` and `verdict_detail` of `report` (of a run that recorded `recorded` steps);
    without a verdict, empty what WITHHELD names."""
    analysed = report["steps"]
    if recorded == 0:
        verdict, detail = NO_DATA, no_step_detail(report)
    elif analysed < MIN_VERDICT_STEPS:
        verdict = TOO_FEW_STEPS
        detail = (f"{analysed} steps: too few for a verdict (stragglers and imbalances need "
                  f"{MIN_VERDICT_STEPS} steps after the warm-up step; {recorded} recorded) — "
                  "record a longer run")  # fmt: skip
    elif report["stragglers"] or report["imbalances"]:
        verdict, detail = FINDINGS, None
    else:
        verdict, detail = HEALTHY, None
    if verdict in (NO_DATA, TOO_FEW_STEPS):
        for key in WITHHELD:
            report[key] = []
        report["slowdown_remainder"] = None  # the decomposition's rest, withheld with it
    error = (report.get("slowdown_detail") or {}).get("replay_error_pct")
    if verdict == FINDINGS and error is not None and abs(error) > REPLAY_ERROR_BAND_PCT:
        report["slowdown_by_cause"], report["slowdown_remainder"] = [], None
        detail = (f"the replay is {error:+.1f}% off the measured steps (costs are given within "
                  f"±{REPLAY_ERROR_BAND_PCT:.0f}%): the findings stand, their costs are "
                  "withheld")  # fmt: skip
    report["verdict"], report["verdict_detail"] = verdict, detail


def no_step_detail(report: dict) -> str:
    """`no training step was recorded: <why> — <what to do>`, from what the run says of itself."""
    if report.get("imported"):
        why, todo = "the trace holds no step", "import a trace of at least one training step"
    elif report.get("command") or report.get("launcher"):
        why = "no optimizer step was seen" + _seen(report.get("events") or [])
        todo = "mark steps with `ranktrace.step()` (docs/instrumenting.md)"
    else:
        why, todo = "the run ended before its first step", "see the run's events and exit code"
    return f"no training step was recorded: {why} — {todo}"


def _seen(events: list[dict]) -> str:
    """What the ranks did instead, from their `incomplete_step` events (telemetry/job.py: "...;
    seen: 12 forward passes, 12 all_reduce calls"): ", though rank 0 saw 12 forward passes, ..."
    (the lowest rank's; "ranks 0-1" where all of them saw the same)."""
    seen = {
        e["rank"]: e["detail"].split(SEEN_MARK, 1)[1]
        for e in events
        if e["kind"] == "incomplete_step" and SEEN_MARK in (e.get("detail") or "")
    }
    if not seen:
        return ""
    first = min(seen)
    same = [rank for rank, what in seen.items() if what == seen[first]]
    who = f"rank {first}" if len(same) == 1 else f"ranks {', '.join(map(str, sorted(same)))}"
    return f", though {who} saw {seen[first]}" + (" each" if len(same) > 1 else "")
