"""A report's numbers checked against each other: users act on them, so no two may contradict.

Invariants (each broken one is a line of `report["self_check"]`):
- fixing a slow cause never lengthens the step: every cause's and finding's saving is ≥ 0, so
  "S without it" is never above S;
- a cause acting alone (no S_X of another rank or stage above `ALONE_FACTOR`) saves what its
  own S_X says, within `ALONE_TOLERANCE_PTS` points (the published traces do: one slow worker
  49.4% saved at S_X 1.961, a long last stage 18.5% at 1.232). The two have different
  baselines: S_X divides by the ideal, every operation at its mean over all N ranks, a mean
  that holds 1/N of the cause's own excess; a stage imbalance is priced at that ideal, but a
  slow rank at its peers' pace (what fixing it gives). So where the cause is on the step's
  critical path, 1 − 1/S_X = saving × (1 − 1/N) for a rank (1 − 1/S_X = saving for a stage):
  with 16 workers 3 points apart at a 50% saving, with 2 ranks half (measured: a contended
  rank of 2 saved 50.8% at S_X 1.380, 1 − 1/S_X = 27.5%). Not where ranks share cores: there
  S_X's ideal has no rank waiting for a core nor varying from step to step, and the costs are
  priced with the cores shared (analysis/competition.py; the demo's straggler saved 14.1% at
  S_X 1.652, while its fault-free steps ran 0.59 s against 0.85 s with it: a 20% saving).
  Nor for a stage of one rank: the published traces' stages have peers (4 workers a stage);
  a 2-stage torch.distributed.pipelining job of one rank a stage, split 3,1, saved 10.3% at
  S_X 1.057 (5.4%), which a share of 1 − 1/2 for the ideal would match, while that share
  (1 − 4/16) breaks the published 4-stage trace (18.4% at 17.8%): how much of a stage's
  excess its ideal holds is not established there. What no named cause explains (the
  remainder's S, `slowdown_left`) is slowness beside the cause: fixing the cause leaves it to
  set the pace, so the saving may fall short by up to its 1 − 1/S_left, which widens the
  tolerance (a synthetic 1,024-rank run, one slow rank in half its steps and every rank ±2% of
  noise: the remainder held 37% of S − 1 at S_left 1.056, and the rank saved 8.3-8.7% at 1 −
  1/S_X 11.0-11.7%, depending on the steps the replay sampled). Where a rank's findings do
  not span every step replayed, the saving may only fall short, never exceed: S_X is over all
  the steps, the saving over the findings', so the rank's excess outside them (before an onset
  found a few steps late) is in the one and not in the other (the contended rank of 2 above,
  busy from step 1: found from step 1, it saved 52.9-53.9% at S_X 1.360-1.370, 0.1-0.5 points
  apart; found from step 5, 51.9% at 1.362; a CI run 45.1% at 1.358, 3.9 points short).
  Nor may a rank with a single peer be held to more than its S_X says: fixed, it runs at that
  one peer's measured pace, and where the peer itself ran slow the fix cannot be faster, while
  S_X's ideal smooths the peer into the mean (2 ranks, rank 1 3x slow, 9 steps, 6 runs: half
  the saving within 0.1 points of 1 − 1/S_X in five; 6.8 points short in one whose peer ran
  slower throughout: S 0.722x without the cause against 0.553-0.595x in the others);
- the decomposition of S − 1 over the causes and the remainder sums to 100%.
The test suite runs every report it makes through this (`RANKTRACE_SELF_CHECK=strict` makes a
contradiction an error, analysis/run.py).
"""

from __future__ import annotations

ALONE_FACTOR = 1.05
"""S_X above this is a cause acting (the issue's bar for "another cause")."""
ALONE_TOLERANCE_PTS = 3.0
"""A lone cause's saving (× the part of it the ideal leaves out) and 1 − 1/S_X may differ by
this many points (the issue's bar)."""
EPSILON_PCT = 0.05
"""Savings within this of 0 are 0 (floating point in the replay's sums)."""
SHARE_TOLERANCE_PCT = 0.5


class SelfCheckError(AssertionError):
    """A report whose numbers contradict each other (raised only in strict mode)."""


def contradictions(report: dict) -> list[str]:
    """Every invariant of the module docstring that `report` breaks, in words."""
    found = []
    slowdown = report.get("slowdown")
    for cause in report.get("slowdown_by_cause") or []:
        if cause["saved_pct"] < -EPSILON_PCT:
            found.append(f"fixing {cause['cause']} lengthens the step: saves "
                         f"{cause['saved_pct']:.2f}% (S {cause['slowdown_without']:.3f}x without "
                         f"it, {slowdown:.3f}x with it)")  # fmt: skip
    for finding in [*report.get("stragglers", []), *report.get("imbalances", [])]:
        if finding.get("cost_pct") is not None and finding["cost_pct"] < -EPSILON_PCT:
            found.append(f"a {finding['kind']} finding costs {finding['cost_pct']:.2f}% (< 0)")
    found += _lone_cause_contradictions(report)
    shares = [c["share_pct"] for c in report.get("slowdown_by_cause") or []
              if c.get("share_pct") is not None]  # fmt: skip
    remainder = (report.get("slowdown_remainder") or {}).get("share_pct")
    if remainder is not None:
        total = sum(shares) + remainder
        if abs(total - 100.0) > SHARE_TOLERANCE_PCT:
            found.append(f"the shares of S - 1 sum to {total:.1f}%, not 100%")
    return found


def _lone_cause_contradictions(report: dict) -> list[str]:
    """The lone-cause invariant, for a rank's compute, data or host cause (its S_X: the rank's)
    and a stage imbalance (the stage's). Another cause acts when another rank's S_X (for a stage
    imbalance: another stage's) or a stage other than the cause's own is above ALONE_FACTOR."""
    by = report.get("slowdown_by") or {}
    ranks_by, stages = by.get("rank") or {}, by.get("stage") or {}
    ranks = (report.get("slowdown_detail") or {}).get("ranks")
    stage_of = {str(f["rank"]): str(f["pp"]) for f in report.get("stragglers", [])
                if f.get("rank") is not None and f.get("pp") is not None}  # fmt: skip
    replayed = _replayed_steps(report)
    causes = [c for c in report.get("slowdown_by_cause") or [] if c["kind"] != "random"]
    if len(causes) != 1 or (report.get("slowdown_detail") or {}).get("ranks_sharing_cores"):
        return []  # several causes; or S_X's ideal without competition for cores (module doc)
    left = (report.get("slowdown_remainder") or {}).get("slowdown_left") or 1.0
    unexplained = 100.0 * max(0.0, 1.0 - 1.0 / left)  # what no named cause explains, % (doc)
    found = []
    for cause in causes:
        partial = False  # may only save less (module doc): some replayed steps left out by
        # the rank's findings, or a single peer whose own pace the fix cannot beat
        if cause.get("rank") is not None and cause["kind"] in ("compute", "data", "host"):
            partial = _ranks_per_stage(report) == 2 or (
                bool(replayed) and not replayed <= _found_steps(report, cause["rank"],
                                                                cause["kind"]))  # fmt: skip
            rank = str(cause["rank"])
            own, stage = ranks_by.get(rank), stage_of.get(rank)
            others = [v for k, v in ranks_by.items() if k != rank]
            others += [v for k, v in stages.items() if k != stage]
        elif cause["kind"] == "stage" and cause.get("stage") is not None:
            if _ranks_per_stage(report) < 2:
                continue  # the ideal's share of a one-rank stage's excess: not established
            own = stages.get(str(cause["stage"]))
            others = [v for k, v in stages.items() if k != str(cause["stage"])]
        else:
            continue
        if own is None or own <= ALONE_FACTOR or any(v > ALONE_FACTOR for v in others):
            continue
        expected = 100.0 * (1.0 - 1.0 / own)
        kept = 1.0 if cause["kind"] == "stage" or not ranks else 1.0 - 1.0 / ranks
        gap = cause["saved_pct"] * kept - expected
        if (gap if partial else abs(gap)) > ALONE_TOLERANCE_PTS + unexplained:
            found.append(f"{cause['cause']} acts alone (S_X {own:.3f}x, 1 - 1/S_X "
                         f"{expected:.1f}%) but saves {cause['saved_pct']:.1f}% "
                         f"(x {kept:.3f} for the ideal's share of it)")  # fmt: skip
    return found


def _replayed_steps(report: dict) -> set[int]:
    """Every step number from the replay's first to its last (empty where not reported)."""
    detail = report.get("slowdown_detail") or {}
    first, last = detail.get("first_step"), detail.get("last_step")
    return set() if first is None or last is None else set(range(first, last + 1))


def _found_steps(report: dict, rank: int, kind: str) -> set[int]:
    """The steps the findings of `rank` and `kind` span (a transient one: its slow steps)."""
    found: set[int] = set()
    for finding in report.get("stragglers", []):
        if finding.get("rank") != rank or finding.get("kind") != kind:
            continue
        if finding.get("steps"):
            found.update(finding["steps"])
        elif finding.get("first_step") is not None and finding.get("last_step") is not None:
            found.update(range(finding["first_step"], finding["last_step"] + 1))
    return found


def _ranks_per_stage(report: dict) -> int:
    """dp × tp of the report's layout (1 where unknown)."""
    layout = report.get("layout") or {}
    return int(layout.get("dp") or 1) * int(layout.get("tp") or 1)
