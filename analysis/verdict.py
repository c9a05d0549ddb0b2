"""Enough evidence or no verdict. A report says one of:

- `findings`: stragglers or imbalances were found;
- `healthy`: enough steps were analysed and nothing was found;
- `too_few_steps`: fewer than `MIN_VERDICT_STEPS` steps after the warm-up step. A straggler
  needs steps to stand out from its peers' noise (a chronic one 8, `stragglers.
  CHRONIC_MIN_STEPS`), so no straggler or imbalance is named or priced, and the report shows
  only what is measurable (step times, S and its factors, an imported trace's GPU time split);
- `no_data`: no training step was recorded at all: never read as healthy.
"""

from __future__ import annotations

import duckdb

FINDINGS, HEALTHY, TOO_FEW_STEPS, NO_DATA = "findings", "healthy", "too_few_steps", "no_data"
MIN_VERDICT_STEPS = 8
"""Steps after the warm-up step a verdict needs: a chronic straggler's stretch (8 steps), and
at most 10 so that one window of a live run holds it."""
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
    report["verdict"], report["verdict_detail"] = verdict, detail


def no_step_detail(report: dict) -> str:
    """`no training step was recorded: <why> — <what to do>`, from what the run says of itself."""
    if report.get("imported"):
        why, todo = "the trace holds no step", "import a trace of at least one training step"
    elif report.get("command") or report.get("launcher"):
        why = "no optimizer step was seen"
        todo = "mark steps with `ranktrace.step()` (docs/instrumenting.md)"
    else:
        why, todo = "the run ended before its first step", "see the run's events and exit code"
    return f"no training step was recorded: {why} — {todo}"
