"""Imbalances: slowness that is no single rank's fault. `stage`: one pipeline stage's compute per
micro-batch is above the median stage's (uneven layers; the LM head and loss on the last stage),
so the others wait in the pipeline; `random`: slowness spread over many ranks, no chronic
culprit. Both exclude the rank-steps a straggler already explains.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from ranktrace.analysis.stragglers import MIN_COST_PCT, MIN_EXCESS_S, Straggler

STAGE_MIN_EXCESS = 0.15
"""A stage imbalance: a stage's compute per micro-batch ≥ 15% above the median stage's."""
RANDOM_MIN_COST_PCT = 20.0
"""A random imbalance is reported only when it costs ≥ 20% of the run's time: on a shared
2-core machine, scheduling noise alone costs 10-13% by this measure (healthy 2×2×2 tiny runs)."""


@dataclass
class Imbalance:
    """Slowness that is not one rank's fault."""

    kind: str
    """`stage` or `random`."""
    stage: int | None
    excess: float
    """stage: compute per micro-batch over the median stage's, minus 1 (0.5 = 50% more);
    random: the median slowest-rank excess over its peers, as a fraction of the step."""
    cost_pct: float
    whatif_step_time_s: float
    """Median step time had the imbalance been removed."""
    ranks: list[int] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    """What shows it, in words (a random imbalance: analysis/spread.py)."""
    remedy: dict | None = None
    """What to change and what it should give (analysis/remedies.py)."""

    def to_dict(self) -> dict:
        return asdict(self)


def stage_imbalances(
    frame: pd.DataFrame, job_step: pd.Series, micro_batches: int
) -> list[Imbalance]:
    """A pipeline stage whose compute per micro-batch exceeds the median stage's."""
    n_stages = frame["pp"].nunique()
    if n_stages < 2:
        return []
    # [steps, stages]: median over the stage's ranks of compute per micro-batch
    per_stage = frame.groupby(["step", "pp"])["cpu_work_s"].median().unstack("pp") / micro_batches
    median_stage = per_stage.median(axis=1)
    # steps whose median stage shows no compute of its own (all of it spent waiting for a core
    # on a crowded host) say nothing of how the stages compare
    measurable = median_stage > 0
    per_stage, median_stage = per_stage[measurable], median_stage[measurable]
    excess = per_stage.sub(median_stage, axis=0).div(median_stage, axis=0)
    typical = excess.median(axis=0).dropna()
    if typical.empty:
        return []
    stage = int(typical.idxmax())
    if typical[stage] < STAGE_MIN_EXCESS:
        return []
    # A pipeline step runs (micro-batches + stages - 1) slots of its slowest stage; balanced,
    # of the mean stage (1F1B and GPipe alike, bubbles included).
    slots = micro_batches + n_stages - 1
    gain = slots * (per_stage.max(axis=1) - per_stage.mean(axis=1))
    actual = job_step.loc[per_stage.index]
    whatif = np.maximum(actual - gain, 0.0)
    cost_pct = 100.0 * float((actual - whatif).sum()) / job_step.sum()
    if cost_pct < MIN_COST_PCT:
        return []
    ranks = sorted(frame.loc[frame["pp"] == stage, "rank"].unique().tolist())
    return [Imbalance(kind="stage", stage=stage, excess=round(float(typical[stage]), 3),
                      cost_pct=round(cost_pct, 2),
                      whatif_step_time_s=float(np.median(whatif)),
                      ranks=[int(r) for r in ranks])]  # fmt: skip


def explained(frame: pd.DataFrame, findings: list[Straggler]) -> pd.Series:
    """Rows a straggler explains: its rank's steps; for a slow link, every rank's steps (the
    link slows all members of its groups)."""
    mask = pd.Series(False, index=frame.index)
    for finding in findings:
        in_steps = frame["step"].between(finding.first_step, finding.last_step)
        if finding.kind == "communication":
            mask |= in_steps
        else:
            mask |= in_steps & frame["rank"].isin(finding.candidates)
    return mask


def random_imbalance(rest: pd.DataFrame, job_step: pd.Series) -> list[Imbalance]:
    """Slowness spread over many ranks: per step, the slowest rank's excess over its peers
    (`rest`: the rank-steps no straggler explains), in own time less the time spent waiting for
    a core (analysis/peers.py `split_compute`): ranks taking turns on shared cores are the
    machine's scheduling, noted where the host is oversubscribed (analysis/contention.py)."""
    own = rest["own_s"] - rest["core_wait_s"]
    reference = rest["own_s_ref"] - rest["core_wait_s_ref"]
    excess = (own - reference).clip(lower=0).fillna(0.0)
    worst = rest.loc[excess.groupby(rest["step"]).idxmax(), ["step", "rank"]]
    worst["excess"] = excess.loc[worst.index]
    worst = worst[worst["excess"] > MIN_EXCESS_S]
    if worst.empty or worst["rank"].nunique() < 3:
        return []
    actual = job_step.loc[worst["step"]].to_numpy()
    cost_pct = 100.0 * float(worst["excess"].sum()) / job_step.sum()
    if cost_pct < RANDOM_MIN_COST_PCT:
        return []
    whatif = actual - worst["excess"].to_numpy()
    return [Imbalance(kind="random", stage=None,
                      excess=round(float(np.median(worst["excess"].to_numpy() / actual)), 3),
                      cost_pct=round(cost_pct, 2), whatif_step_time_s=float(np.median(whatif)),
                      ranks=sorted(int(r) for r in worst["rank"].unique()))]  # fmt: skip
