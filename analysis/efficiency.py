"""Efficiency drops: change points in a run's MFU (and tokens/s) over steps, each explained by the
finding that starts there (`explained_by`, e.g. a compute straggler whose peers then wait in
communication), and with the part of the step whose share grew the most (`cause`: the symptom,
which a straggler's peers show as waiting).

Method: binary segmentation of the per-step job MFU (median over ranks) for mean shifts. A split
is kept when both sides have at least `MIN_SEGMENT` steps, the mean moves by at least
`MIN_DROP` of the earlier level, and the shift is `MIN_SHIFT_SIGMAS` robust noise deviations
(1.4826 × the MAD of step-to-step differences / √2) large. Only drops are reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

MIN_SEGMENT = 5
MIN_DROP = 0.10
MIN_SHIFT_SIGMAS = 4.0
MAX_CHANGE_POINTS = 3
SHARES = {
    "compute": "work_s",
    "data": "data_s",
    "host": "host_s",
    "tp communication": "tp_comm_s",
    "pp communication": "pp_comm_s",
    "dp communication": "dp_comm_s",
    "world communication": "world_comm_s",
}
"""Parts of a rank's step whose shares are compared before and after a change point. The
communication parts hold transfer and waiting (pipeline wait is pp communication)."""


@dataclass
class EfficiencyDrop:
    """One downward change point of MFU."""

    step: int
    """First step at the lower level."""
    mfu_before: float
    mfu_after: float
    drop_pct: float
    tokens_per_s_before: float
    tokens_per_s_after: float
    cause: str
    """The part of the step whose share grew the most (see SHARES): the symptom."""
    share_before: float
    share_after: float
    explained_by: str | None = None
    """The reported finding that starts at the drop (see `explain`), named; None: none does."""

    def to_dict(self) -> dict:
        return asdict(self)


def step_noise(values: np.ndarray) -> float:
    """Robust standard deviation of one step's value, from step-to-step differences (1.4826 ×
    their MAD / √2); 0 with fewer than 3 values."""
    if len(values) < 3:
        return 0.0
    return float(1.4826 * np.median(np.abs(np.diff(values))) / np.sqrt(2))


def _best_split(values: np.ndarray) -> tuple[int, float] | None:
    """(index, shift in noise deviations) of the strongest mean shift, or None."""
    n = len(values)
    if n < 2 * MIN_SEGMENT:
        return None
    cumulative = np.cumsum(values)
    best, best_stat = None, 0.0
    for i in range(MIN_SEGMENT, n - MIN_SEGMENT + 1):
        left, right = cumulative[i - 1] / i, (cumulative[-1] - cumulative[i - 1]) / (n - i)
        stat = abs(left - right) * np.sqrt(i * (n - i) / n)
        if stat > best_stat:
            best, best_stat = i, stat
    noise = step_noise(values)
    if best is None or noise == 0.0:
        return None
    return best, best_stat / noise


def change_points(values: np.ndarray) -> list[int]:
    """Indices where the mean of `values` shifts (binary segmentation, see module docstring)."""
    found: list[int] = []
    segments = [(0, len(values))]
    while segments and len(found) < MAX_CHANGE_POINTS:
        start, end = segments.pop(0)
        split = _best_split(values[start:end])
        if split is None or split[1] < MIN_SHIFT_SIGMAS:
            continue
        index = start + split[0]
        before, after = values[start:index].mean(), values[index:end].mean()
        if before > 0 and abs(after - before) / before >= MIN_DROP:
            found.append(index)
            segments += [(start, index), (index, end)]
    return sorted(found)


def per_step_efficiency(frame: pd.DataFrame, job_step: pd.Series) -> pd.DataFrame:
    """Per step (the index): the job's MFU (median over ranks), tokens/s and each part's share
    of the step (SHARES, mean over ranks): what `efficiency_drops` segments, and what windows
    of one run concatenate (analysis/window_merge.py). `frame` is the run's step_breakdown
    (analysis/peers.py); empty where no rank recorded its MFU."""
    if frame.empty or frame["mfu"].isna().all():
        return pd.DataFrame(columns=["mfu", "tokens_per_s", *SHARES], dtype=float)
    parts = {
        "work_s": frame["work_s"], "data_s": frame["data_s"], "host_s": frame["host_s"],
        "tp_comm_s": frame["tp_transfer_s"].fillna(0) + frame["tp_blocking_s"].fillna(0),
        "pp_comm_s": frame["pipeline_wait_s"],
        "dp_comm_s": frame["dp_transfer_s"].fillna(0) + frame["dp_blocking_s"].fillna(0),
        "world_comm_s": frame["world_transfer_s"].fillna(0) + frame["world_blocking_s"].fillna(0),
    }  # fmt: skip
    per_step = frame.groupby("step")
    mfu = per_step["mfu"].median()
    shares = pd.DataFrame(
        {part: (parts[column] / frame["step_time_s"]).groupby(frame["step"]).mean()
         for part, column in SHARES.items()}
    )  # fmt: skip
    table = shares.loc[mfu.index]
    table.insert(0, "tokens_per_s", per_step["tokens"].median() / job_step.loc[mfu.index])
    table.insert(0, "mfu", mfu)
    return table


def efficiency_drops(per_step: pd.DataFrame) -> list[EfficiencyDrop]:
    """MFU drops of one run, from its `per_step_efficiency` table."""
    if per_step.empty:
        return []
    shares = per_step[list(SHARES)]
    steps = per_step.index.to_numpy()
    values = per_step["mfu"].to_numpy(dtype=float)
    tokens_per_s = per_step["tokens_per_s"]
    drops = []
    bounds = [0, *change_points(values), len(values)]
    for before, index, after in zip(bounds, bounds[1:], bounds[2:], strict=False):
        level_before, level_after = values[before:index].mean(), values[index:after].mean()
        if level_after >= level_before:
            continue
        share_before = shares.iloc[before:index].mean()
        share_after = shares.iloc[index:after].mean()
        cause = str((share_after - share_before).idxmax())
        drops.append(EfficiencyDrop(
            step=int(steps[index]), mfu_before=float(level_before), mfu_after=float(level_after),
            drop_pct=round(100 * (1 - level_after / level_before), 1),
            tokens_per_s_before=float(tokens_per_s.iloc[before:index].mean()),
            tokens_per_s_after=float(tokens_per_s.iloc[index:after].mean()),
            cause=cause, share_before=round(float(share_before[cause]), 3),
            share_after=round(float(share_after[cause]), 3),
        ))  # fmt: skip
    return drops


EXPLAIN_WITHIN_STEPS = 5
"""A chronic finding explains a drop when it starts within 5 steps of it (the onsets' own
tolerance)."""


def explain(drops: list[EfficiencyDrop], stragglers: list) -> None:
    """Name, on each drop, the reported chronic straggler starting nearest to it, e.g.
    `rank 5 compute straggler from step 10` (imbalances hold from the first step: they explain
    no drop)."""
    for drop in drops:
        near = [s for s in stragglers
                if s.pattern == "chronic" and s.first_step is not None
                and abs(s.first_step - drop.step) <= EXPLAIN_WITHIN_STEPS]  # fmt: skip
        if near:
            best = min(near, key=lambda s: (abs(s.first_step - drop.step), -s.cost_pct))
            drop.explained_by = finding_name(best)


def finding_name(finding) -> str:
    """How a straggler is named where it explains something else."""
    axis = f" ({finding.axis})" if finding.axis else ""
    return f"{finding.who} {finding.kind}{axis} straggler from step {finding.first_step}"
