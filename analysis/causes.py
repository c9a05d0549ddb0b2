"""The causes of a run's slowdown, each priced by the replay, and the whole of S − 1 shared out.

- Each cause (a straggler the replay confirmed, a stage or random imbalance) has its own
  single-cause saving: the replay with exactly its operations at their reference
  (analysis/whatif.py), against the replay of the recorded steps (`saved_pct`).
- Causes overlap (a slow rank inside a slow stage) and interact (two slow ranks on one path:
  fixing either alone saves little), so single savings do not add up. The decomposition gives
  each cause its Shapley share of the time all of them together remove, from the replays of
  every subset of the causes (with more than `MAX_EXACT_CAUSES`, each cause's marginal saving
  in order of its own saving), as a share of what the ideal removes (S − 1: the recorded
  replay less the ideal one). What no named cause explains is the `remainder`; the shares and
  the remainder sum to 100%. A slow link's cause has no share: the ideal keeps every transfer.
- A remainder that passes the random-imbalance test is named: spread slowness, a random
  imbalance (`SPREAD_MIN_SAVED_PCT`, `SPREAD_MAX_RANK_SHARE`); on a healthy run it stays a
  residual (`slowdown_remainder`), not a finding.
"""

from __future__ import annotations

import dataclasses
import itertools
from math import factorial

import numpy as np
import pandas as pd

from ranktrace.analysis.imbalances import Imbalance
from ranktrace.analysis.replay import ideal_durations
from ranktrace.analysis.stragglers import MIN_COST_PCT, MIN_EXCESS_S, STEPPED_UP

SPREAD_MIN_SAVED_PCT = 12.0
"""Compute variation no finding explains is a random imbalance when idealising it saves ≥ 12% of
the replayed time (healthy CPU runs here leave 6-7%; ±30% per micro-batch leaves 10%); where
the compute follows the micro-batches' tokens (varying sequence lengths, analysis/spread.py),
the spread is the job's own and needs only what any cause needs, MIN_COST_PCT..."""
SPREAD_MAX_RANK_SHARE = 0.5
"""...and no rank holds more than half of that excess compute beyond an even split (N ranks:
a share above 1/N + 0.5 × (1 − 1/N); with 2 ranks one of them always holds at least half of
the excess, so a plain half would rule the spread out on every dp 2 run)."""
MAX_EXACT_CAUSES = 4
"""Up to this many causes, the exact Shapley shares (2^n replays, 16 at most); beyond, each
cause's marginal saving in order of its own."""


def price_causes(
    timeline,
    stragglers,
    imbalances,
    what_if,
    rerun,
    actual: pd.Series,
    ideal_s: float,
    varying_lengths: bool = False,
    explained_by_tokens: frozenset[int] = frozenset(),
) -> tuple[list[dict], list, Imbalance | None, dict | None]:
    """(`slowdown_by_cause`, the imbalances the replay confirms, a random imbalance only the
    replay sees or None, `slowdown_remainder` or None). An imbalance is confirmed when
    idealising its operations saves what its kind asks (a stage: MIN_COST_PCT of the replayed
    time; spread slowness: SPREAD_MIN_SAVED_PCT), and then costs what the replay saves.
    `what_if(finding)` gives its (mask, gap durations, transfers), `rerun(durations,
    transfers)` replayed step times, `actual` the replayed recorded steps; `varying_lengths`:
    the compute follows the micro-batches' tokens (SPREAD_MIN_SAVED_PCT); `explained_by_tokens`:
    the ranks whose share of the spread their tokens explain (SPREAD_MAX_RANK_SHARE)."""
    entries = timeline.entries
    recorded = entries["duration_s"].to_numpy()
    gaps = timeline.graph.is_gap
    total = float(actual.sum())
    fixes, covered = [], np.zeros(len(entries), dtype=bool)
    for finding in [*stragglers, *imbalances]:
        if finding.kind != "random":
            mask, durations, transfer = what_if(finding)
            covered |= mask
            fixes.append((finding, durations, transfer, float(rerun(durations, transfer).sum())))
    random_found = any(f.kind == "random" for f in imbalances)
    spread_floor = MIN_COST_PCT if varying_lengths else SPREAD_MIN_SAVED_PCT
    spread = None
    # What the findings leave, inside each stage (the stages' different work is not random): a
    # random imbalance, or noise. Not replayed when even idealising everything saves too little.
    if random_found or 100 * (total - ideal_s) >= spread_floor * total:
        rest = gaps & ~covered
        stage_ideal = ideal_durations(entries, within_stage=True)
        rest_durations = np.where(rest, stage_ideal, recorded)
        fixed_rest = rerun(rest_durations, timeline.transfer_s)
        rest_s = float(fixed_rest.sum())
        if not random_found:
            spread = _spread_imbalance(entries, rest, recorded - stage_ideal, total - rest_s,
                                       total, fixed_rest, spread_floor,
                                       explained_by_tokens)  # fmt: skip
        randoms = [f for f in [*imbalances, spread] if f is not None and f.kind == "random"]
        fixes += [(f, rest_durations, timeline.transfer_s, rest_s) for f in randoms]
    confirmed, kept = [], []
    for fix in fixes:
        finding, saved_pct = fix[0], 100 * (total - fix[3]) / total if total else 0.0
        if any(finding is i for i in imbalances):
            floor = spread_floor if finding.kind == "random" else MIN_COST_PCT
            if saved_pct < floor:
                continue
            confirmed.append(dataclasses.replace(finding, cost_pct=round(saved_pct, 2)))
        kept.append(fix)
    shared = [fix for fix in kept if fix[0].kind != "communication"]
    shares, remainder = _decomposition(shared, recorded, timeline.transfer_s, rerun, total,
                                       ideal_s)  # fmt: skip
    by_cause = []
    for finding, _, _, fixed_s in kept:
        by_cause.append({
            **cause_of(finding),
            "share_pct": shares.get(id(finding)),
            "saved_pct": 100 * (total - fixed_s) / total if total else 0.0,
            "slowdown_without": fixed_s / ideal_s if ideal_s > 0 else 1.0,
        })  # fmt: skip
    return by_cause, confirmed, spread, remainder


def _decomposition(fixes, recorded, transfer, rerun, total, ideal_s) -> tuple[dict, dict | None]:
    """({id(finding): its share of S − 1, %}, `slowdown_remainder`) (module docstring); no
    shares where the ideal removes nothing."""
    removable = total - ideal_s
    if removable <= 1e-9 * max(total, 1e-12):
        return {}, None
    changes = [(durations != recorded, durations, fixed_transfer != transfer, fixed_transfer)
               for _, durations, fixed_transfer, _ in fixes]  # fmt: skip
    known = {(): total, **{(i,): fix[3] for i, fix in enumerate(fixes)}}

    def replayed(subset: tuple[int, ...]) -> float:
        if subset not in known:
            gaps, transfers = recorded.copy(), transfer.copy()
            for i in subset:
                gap_mask, gap_values, transfer_mask, transfer_values = changes[i]
                gaps[gap_mask] = gap_values[gap_mask]
                transfers[transfer_mask] = transfer_values[transfer_mask]
            known[subset] = float(rerun(gaps, transfers).sum())
        return known[subset]

    n = len(fixes)
    contribution = np.zeros(n)
    if n <= MAX_EXACT_CAUSES:
        for i in range(n):
            others = [j for j in range(n) if j != i]
            for size in range(n):
                weight = factorial(size) * factorial(n - size - 1) / factorial(n)
                for subset in itertools.combinations(others, size):
                    with_i = tuple(sorted((*subset, i)))
                    contribution[i] += weight * (replayed(subset) - replayed(with_i))
    else:
        order = sorted(range(n), key=lambda i: fixes[i][3])  # the biggest saving first
        done: tuple[int, ...] = ()
        for i in order:
            step = tuple(sorted((*done, i)))
            contribution[i] = replayed(done) - replayed(step)
            done = step
    everything = replayed(tuple(range(n)))
    shares = {id(fix[0]): 100 * float(c) / removable for fix, c in zip(fixes, contribution,
                                                                        strict=True)}  # fmt: skip
    remainder = {"share_pct": 100 * (everything - ideal_s) / removable,
                 "slowdown_left": everything / ideal_s if ideal_s > 0 else 1.0}  # fmt: skip
    return shares, remainder


def _spread_imbalance(entries, rest, excess, saved, replayed_s, fixed, floor, explained):
    """A random Imbalance when idealising what the findings leave saves ≥ `floor` % of the
    replayed time and ≥ MIN_EXCESS_S a step (less is the scheduler's noise: a healthy 2-rank
    Lightning job of 5 ms steps once saved 15% by it, 1 ms a step), and no rank holds more than
    SPREAD_MAX_RANK_SHARE of the excess compute there beyond an even split (else that rank, not
    the spread, is the cause), but for the ranks `explained`, whose share their micro-batches'
    tokens explain; None otherwise."""
    if replayed_s <= 0 or 100 * saved / replayed_s < floor or saved / len(fixed) < MIN_EXCESS_S:
        return None
    ranks = entries["rank"].to_numpy()[rest]
    per_rank = pd.Series(np.clip(excess, 0, None)[rest]).groupby(ranks).sum()
    even = 1.0 / entries["rank"].nunique()
    judged = per_rank.drop(index=list(explained), errors="ignore")
    most = judged.max() if not judged.empty else 0.0
    if per_rank.sum() <= 0 or most / per_rank.sum() > even + SPREAD_MAX_RANK_SHARE * (1 - even):
        return None
    return Imbalance(
        kind="random", stage=None, excess=round(saved / replayed_s, 3),
        cost_pct=round(100 * saved / replayed_s, 2),
        whatif_step_time_s=float(fixed.median()),
        ranks=sorted(int(r) for r in per_rank[per_rank > 0].index),
    )  # fmt: skip


def cause_of(finding) -> dict:
    """How a finding is named in `slowdown_by_cause`."""
    if finding.kind in ("stage", "random"):
        where = f"stage {finding.stage} " if getattr(finding, "stage", None) is not None else ""
        return {"cause": f"{where}{finding.kind} imbalance", "kind": finding.kind,
                "stage": getattr(finding, "stage", None), "rank": None}  # fmt: skip
    name = f"rank {finding.rank} {finding.kind}"
    if finding.cause == STEPPED_UP:  # the rank's second finding of the kind (its first: name)
        name += f" from step {finding.first_step}"
    return {"cause": name, "kind": finding.kind, "stage": None, "rank": finding.rank}
