"""What-ifs on hosts whose ranks share cores (more ranks than cores: this machine's runs).

There an operation's duration depends on how many ranks compete for the cores at the time, and
a finding changes that in its own steps: a rank that sleeps (a pause, a slow data loader)
hands its core to the others, whose compute and transfers then run faster; a rank computing
longer keeps the others waiting, not competing. Fixing the finding brings the competition
back to what the run's steps without it show. So in a finding's what-if, each crowded rank's
gaps and transfers in the finding's steps are scaled by how that rank's time in gaps and
transfers per step compares with the run's other steps: the median there over the median in
the finding's steps. One factor per rank, not per operation: a factor per operation, from a
few steps each, scattered the operations, and a step pays for its slowest rank at every
collective, so the scatter alone lengthened the what-if (a pause then "saved" -10%).

Measured here (benchmarks/whatif_accuracy.py, 8 ranks on 2 cores, the tiny model, pauses of
two steps every 4 steps at 3 ranks): the recorded durations put the what-if step of a pause
0.62-0.79x the healthy run's, every gap on a core of its own 0.57-0.73x; restored, 0.98-1.06x.
The factors come from a few steps each side and can overshoot (a data-loader sleep of 0.05 s at
one of 4 ranks on 2 cores, 7 steps before it: two of the others scaled 2.6-3x, steps replayed up
to 2.2x the recorded while the measured steps before and after the onset were alike, -14.9%
"saved"). A fix removes a delay and cannot lengthen a step, so the what-ifs priced this way are
capped step by step at the recorded replay (analysis/slowdown.py): there, 0.6% saved, as the
measured steps say, where a core per rank would save 49%.
A finding changes the cores' load by at most its own excess per step, so what the crowded ranks
gain back or lose per step adds to at most that (`within_the_findings_excess`); the rest of a
difference between the finding's steps and the others is the machine's (another job's load
easing from the onset on). The same runs of benchmarks/whatif_accuracy.py scored with and
without that bound (`--rescore`; 8 ranks on 2 cores, compute, data and pause faults at 2
positions): `tiny`, seed 4711, what-if steps within 10% of the healthy runs' 3 of 6 -> 5 of 6,
median |error| 13.9% -> 6.2% (two healthy runs of one job: 5.1%); `small`, seed 4712, 4 of 6
both, 9.4% -> 4.8% (11.3%).
A run with fewer than `MIN_REFERENCE_STEPS` steps without the finding keeps the competition as
recorded (`restored` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pandas as pd

from ranktrace.analysis.contention import host_cores
from ranktrace.analysis.replay_graph import COMPUTE

MIN_REFERENCE_STEPS = 3
"""Steps without the finding needed to tell the competition of a step without it."""


@dataclass
class Restored:
    """Gap durations (aligned with a timeline's entries) and per-instance transfers with the
    competition of the steps without a finding."""

    durations: np.ndarray
    transfer_s: np.ndarray


def crowded_ranks(con: duckdb.DuckDBPyConnection, run_id: str) -> set[int]:
    """CPU ranks of the run on hosts with more ranks than cores."""
    crowded = [h.host for h in host_cores(con, run_id).values() if h.oversubscribed]
    if not crowded:
        return set()
    rows = con.execute(
        "SELECT rank FROM ranks WHERE run_id = ? AND device LIKE 'cpu%' "
        "AND coalesce(host, '') IN (SELECT unnest(?))", [run_id, crowded]).fetchall()  # fmt: skip
    return {int(rank) for (rank,) in rows}


def restored(timeline, crowded: set[int], steps: list[int],
             freed_s: float) -> Restored | None:  # fmt: skip
    """The timeline's gaps and transfers with each operation of `steps` on a `crowded` rank at
    the competition of the other steps (module docstring), within `freed_s` (the finding's
    excess per step, `within_the_findings_excess`); None where there is nothing to restore (no
    crowded rank, too few other steps)."""
    entries = timeline.entries
    if not crowded:
        return None
    step = entries["step"].to_numpy()
    if len(np.setdiff1d(np.unique(step), steps)) < MIN_REFERENCE_STEPS:
        return None
    gap = entries["kind"].to_numpy() == COMPUTE
    instance = entries["instance"].to_numpy()
    rank = entries["rank"].to_numpy()
    value = np.where(gap, entries["duration_s"].to_numpy(),
                     timeline.transfer_s[np.maximum(instance, 0)])  # fmt: skip
    # per rank: its time in gaps and transfers per step, usually over during the finding
    per_step = pd.DataFrame({"rank": rank, "step": step, "value": value}).groupby(
        ["rank", "step"])["value"].sum().reset_index()  # fmt: skip
    during = per_step["step"].isin(steps)
    usual = per_step[~during].groupby("rank")["value"].median()
    then = per_step[during].groupby("rank")["value"].median()
    factor = (usual / then).replace([np.inf, -np.inf], np.nan).dropna()
    factor = factor[factor.index.isin(list(crowded))]
    factor = within_the_findings_excess(factor, then, freed_s)
    scale = np.where(np.isin(step, steps), factor.reindex(rank).fillna(1.0).to_numpy(), 1.0)
    durations = np.where(gap, entries["duration_s"].to_numpy() * scale,
                         entries["duration_s"].to_numpy())  # fmt: skip
    transfer = timeline.transfer_s.copy()
    calls = ~gap & (scale != 1.0)
    per_instance = pd.Series(scale[calls]).groupby(instance[calls]).mean()
    transfer[per_instance.index.to_numpy()] *= per_instance.to_numpy()
    return Restored(durations, transfer)


def within_the_findings_excess(factor: pd.Series, then: pd.Series, freed_s: float) -> pd.Series:
    """`factor` (per rank: usual over then, its time per step in gaps and transfers) with the
    time it adds or takes per step, then × (factor - 1), scaled down to at most `freed_s` (≥ 0)
    in all ranks together: a finding changes the cores' load by at most its own excess per step (a
    rank sleeping 50 ms hands on at most 50 ms of a core; one computing 50 ms longer takes at
    most that). The rest of a difference between the finding's steps and the others is the
    machine's: a data-loader sleep of 50 ms at one of 4 ranks, beside two other workloads
    that eased from its onset on (steps of 0.08-0.77 s before, 0.08-0.22 s after), had the
    other ranks scaled up to 3x, and the what-if saved 0.0% of steps its peers waited for."""
    moved = (then.reindex(factor.index) * (factor - 1.0)).abs().sum()
    if moved <= freed_s:
        return factor
    return 1.0 + (factor - 1.0) * freed_s / moved
