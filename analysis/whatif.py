"""What one finding costs in the replay (analysis/replay.py): the run re-executed with only that
finding's operations idealised, and the stragglers the replay confirms.

- A rank (compute, data, host): its gaps over the finding's steps at its peers' pace, the mean
  over the *other* ranks of its pipeline stage of the same (step, phase) compute (its own time
  left out, as the peers' reference of analysis/peers.py leaves it out: with two peers, a mean
  that kept it would halve every saving).
- A slow link: its groups' transfers at the median of the axis's other groups; a slow node
  (analysis/slow_nodes.py): every transfer between its ranks and others, per axis.
- A stage imbalance: the stage's gaps at the all-rank ideal.

A straggler is reported only when idealising its operations saves what the reporting thresholds
ask (`stragglers.is_material` of the saving): a rank whose excess time its peers never wait for
(hidden behind a slower stage, or noise) costs nothing, however its own time compares. Beside
other candidates, a finding is also priced once they are fixed (`cost_once_others_fixed_pct`:
the replay with every other candidate idealised, less the replay with all of them), and that
saving makes it material too: two faults at once, a data loader 0.078 s slow on one rank and a
compute straggler x4 on another, and the loader's delay fell inside its wait for the compute
straggler: alone it saved ~0 and went unnamed (benchmarks/two_faults.py missed 3 of 8 so).
"""

from __future__ import annotations

import dataclasses
from functools import reduce

import numpy as np
import pandas as pd

from ranktrace.analysis.replay import gap_slots
from ranktrace.analysis.replay_graph import COMPUTE, RECV, SEND
from ranktrace.analysis.stragglers import MIN_EXCESS_S, Straggler, is_material


def peer_durations(entries: pd.DataFrame, rank: int) -> np.ndarray:
    """Per entry: 0 for collectives, and for each gap of `rank` what its peers take: the mean
    over the other ranks of its pipeline stage of their (step, slot) compute (a slot: the same
    work, analysis/replay.py `gap_slots`), spread evenly over the rank's gaps of that slot; NaN
    elsewhere (and where the rank has no peers)."""
    gaps = entries["kind"].to_numpy() == COMPUTE
    stage_step = entries.groupby(["step", "pp"], sort=False).ngroup().to_numpy()
    frame = entries.loc[gaps, ["step", "pp", "rank", "duration_s"]].assign(
        slot=gap_slots(entries, stage_step)[gaps]
    )
    own = frame["rank"].to_numpy() == rank
    totals = frame.groupby(["step", "pp", "slot"])["duration_s"].transform("sum")
    mine = frame.assign(mine=np.where(own, frame["duration_s"], 0.0)).groupby(
        ["step", "pp", "slot"])["mine"].transform("sum")  # fmt: skip
    ranks = frame.groupby(["step", "pp"])["rank"].transform("nunique")
    pieces = frame[own].groupby(["step", "slot"])["duration_s"].transform("size")
    others = (totals - mine)[own] / (ranks[own] - 1).replace(0, np.nan)
    durations = np.full(len(entries), np.nan)
    durations[np.flatnonzero(gaps)[own]] = (others / pieces).to_numpy()
    return durations


def crossing_instances(entries: pd.DataFrame, node_ranks: list[int], cause: str,
                       n: int) -> np.ndarray:  # fmt: skip
    """(n instances,) whether the instance moves data out of the node (`cause` "node sends
    slowly") or into it ("node receives slowly"): a sender (receiver) among `node_ranks` and a
    member outside.
    A point-to-point call recorded as a send is the sender's, its recv the receiver's; a
    batched send+recv (recorded as RECV on both sides) and a collective move data both ways."""
    calls = entries[entries["instance"] >= 0]
    instance, kind = calls["instance"].to_numpy(), calls["kind"].to_numpy()
    inside = np.isin(calls["rank"].to_numpy(), node_ranks)
    has_send = np.bincount(instance[kind == SEND], minlength=n) > 0
    directed = has_send[instance]  # a pure send/recv pair
    wanted = SEND if cause == "node sends slowly" else RECV
    on_side = inside & (~directed | (kind == wanted))
    node_side = np.bincount(instance[on_side], minlength=n) > 0
    outside = np.bincount(instance[~inside], minlength=n) > 0
    return node_side & outside


DATA_LABEL, HOST_LABEL = "data", "host"


def compute_labels(entries: pd.DataFrame) -> np.ndarray:
    """Per entry, whether its label is a compute phase: any phase but data loading and the
    host's time outside every phase."""
    label = entries["label"].to_numpy(dtype=object)
    return (label != DATA_LABEL) & (label != HOST_LABEL)


def finding_labels(entries: pd.DataFrame, finding) -> np.ndarray:
    """Per entry, whether its label holds the finding's kind of time: data, the data phase;
    host, time outside every phase (a pause); contention, every gap (a rank waiting for a core
    waits in every phase and between them: priced on its compute phases alone, its saving fell
    0.1-4 points short of its own S_X, by as much as its host time was slow); compute, every
    other phase. Only those gaps are the finding's operations: its other gaps at its peers'
    means would add their noise, either way, to its saving."""
    label = entries["label"].to_numpy(dtype=object)
    if finding.kind == "data":
        return label == DATA_LABEL
    if finding.kind == "host":
        if finding.cause == "contention":
            return np.ones(len(entries), dtype=bool)
        return label == HOST_LABEL
    return compute_labels(entries)


def _sole_group_axes(timeline) -> list[str]:
    """Axes whose instances all hold every rank (the world group): no peer group to compare."""
    size = timeline.size
    ranks = len(np.unique(timeline.call_rank))
    return sorted({str(a) for a in np.unique(timeline.instance_axis[size >= ranks])})


def finding_what_if(timeline, finding, actual: np.ndarray, ideal: np.ndarray):
    """(idealised gaps mask, gap durations, per-instance transfers) of the replay without
    `finding`; `actual` and `ideal` are the recorded and the all-rank ideal gap durations."""
    entries = timeline.entries
    gaps = timeline.graph.is_gap
    if finding.kind == "stage":
        mask = gaps & (entries["pp"] == finding.stage).to_numpy()
        return mask, np.where(mask, ideal, actual), timeline.transfer_s
    steps = entries["step"].between(finding.first_step, finding.last_step).to_numpy()
    if finding.kind != "communication":
        peers = peer_durations(entries, finding.rank)
        mask = gaps & steps & ~np.isnan(peers) & finding_labels(entries, finding)
        if finding.steps:  # a transient finding: only its slow steps (in the others its
            mask &= np.isin(entries["step"].to_numpy(), finding.steps)  # peers' noise)
        return mask, np.where(mask, peers, actual), timeline.transfer_s
    # a slow link: its groups' transfers at the median of the axis's other groups; with
    # candidates (no located rank), the groups holding all of them; a slow node: on every
    # axis, the transfers between its ranks and others (where the timing cannot separate
    # nodes, the strongest hypothesis's: pricing every candidate's traffic at once would
    # leave an axis whose every group crosses one of them no reference)
    if finding.node_hypotheses:
        strongest = finding.node_hypotheses[0]
        involved = crossing_instances(entries, strongest["ranks"], strongest["cause"],
                                      len(timeline.transfer_s))  # fmt: skip
        pools = [timeline.instance_axis == axis for axis in np.unique(timeline.instance_axis)]
    else:
        members = [finding.rank] if finding.rank is not None else finding.candidates
        held = [timeline.call_instance[timeline.call_rank == member] for member in members]
        involved = np.zeros(len(timeline.transfer_s), dtype=bool)
        involved[reduce(np.intersect1d, held)] = True
        # a located rank's link slows its transfers on every axis: the axes it was found slow
        # on, and the world group, which has no other group to be compared with
        axes = [finding.axis]
        if finding.rank is not None:
            axes = sorted({*(finding.axes or [finding.axis]), *_sole_group_axes(timeline)})
        pools = [timeline.instance_axis == axis for axis in axes if axis] or [
            np.ones(len(timeline.transfer_s), dtype=bool)]  # fmt: skip
    # only the finding's steps; a pool with no other group (the world) is measured against its
    # own transfers outside those steps
    n = len(timeline.transfer_s)
    calls = entries["instance"].to_numpy() >= 0
    instance_step = np.zeros(n, dtype=np.int64)
    instance_step[entries["instance"].to_numpy()[calls]] = entries["step"].to_numpy()[calls]
    in_steps = (instance_step >= finding.first_step) & (instance_step <= finding.last_step)
    if finding.steps:
        in_steps &= np.isin(instance_step, finding.steps)
    involved &= in_steps
    transfer = timeline.transfer_s.copy()
    for pool in pools:  # the involved transfers of a pool at the median of its others
        others = transfer[pool & ~involved]
        if not (pool & ~involved & in_steps).any():
            others = transfer[pool & ~in_steps]
        if others.size:
            transfer[pool & involved] = np.median(others)
    return np.zeros(len(entries), dtype=bool), actual, transfer


def finding_steps(finding: Straggler) -> list[int]:
    """The steps a straggler's operations are idealised in: a transient one's slow steps, a
    chronic one's from its first to its last step."""
    return finding.steps or list(range(finding.first_step, finding.last_step + 1))


def confirmed(stragglers: list[Straggler], what_if, replay, actual_steps: pd.Series,
              dedicated=None) -> list[Straggler]:  # fmt: skip
    """The stragglers whose replayed saving is material, each with `saved_pct` (its saving, %
    of the replayed time), `cost_pct` = that saving and `whatif_step_time_s` from the replay.
    A finding none of whose steps is replayed (collectives traced every N steps) is kept as the
    peers priced it. `what_if(finding)` gives its (mask, gap durations, transfers), `replay(
    durations, transfers)` replayed step times, `actual_steps` the recorded ones. `dedicated`
    (analysis/slowdown.py DedicatedCores), where given (ranks sharing cores): the run priced as
    if every rank had a core of its own, where the finding's saving, alone and once the others
    are fixed, is kept as `dedicated_core_cost_pct` and makes it material (what it costs the
    job on hardware with a core per rank; sharing cores, the others take back part of what it
    frees: a slow link beside a x3.8 compute straggler on 8 ranks sharing 2 cores saved 4.3%
    once that was fixed, its waits handing its core to the others, and went unnamed)."""
    total = float(actual_steps.sum())
    fixes = [what_if(finding) for finding in stragglers]
    once_others_fixed = _once_others_fixed(fixes, replay, total)
    alone_judged, hidden_judged = [None] * len(stragglers), once_others_fixed
    if dedicated is not None:
        own = [dedicated.what_if(finding) for finding in stragglers]
        base = float(dedicated.actual.sum())
        alone_judged = [_saved_pct(dedicated.actual, dedicated.rerun(gaps, transfer), base)
                        for _, gaps, transfer in own]  # fmt: skip
        hidden_judged = _once_others_fixed(own, dedicated.rerun, base)
    kept = []
    for index, finding in enumerate(stragglers):
        _, durations, transfer = fixes[index]
        fixed = replay(durations, transfer)
        steps = actual_steps.index[
            (actual_steps.index >= finding.first_step) & (actual_steps.index <= finding.last_step)
        ]
        if total <= 0 or steps.empty:
            kept.append(finding)
            continue
        saved_pct = _saved_pct(actual_steps, fixed, total)
        dedicated_pct = alone_judged[index]
        judged = saved_pct if dedicated_pct is None else dedicated_pct
        hidden = once_others_fixed[index]
        if not is_material(finding.pattern, max(judged, hidden_judged[index] or 0.0),
                           finding.slowdown):  # fmt: skip
            continue
        saving = actual_steps[steps] - fixed[steps]
        slow = steps[saving.to_numpy() >= MIN_EXCESS_S]  # a transient finding: its slow steps
        scale = (fixed[slow] / actual_steps[slow]).median() if len(slow) else 1.0
        kept.append(dataclasses.replace(
            finding, saved_pct=round(saved_pct, 2), cost_pct=round(saved_pct, 2),
            whatif_step_time_s=float(finding.step_time_s * scale),
            dedicated_core_cost_pct=None if dedicated_pct is None else round(dedicated_pct, 2),
            cost_once_others_fixed_pct=None if hidden is None else round(hidden, 2),
        ))  # fmt: skip
    return sorted(kept, key=lambda f: -f.cost_pct)


MAX_JOINT_CANDIDATES = 6
"""Candidates priced jointly (two replays each); past this, each alone."""


def _once_others_fixed(fixes: list, replay, total: float) -> list[float | None]:
    """Per candidate (mask, gap durations, transfers): its saving with every other candidate
    already idealised, % of `total`; None where it is alone (or past MAX_JOINT_CANDIDATES).
    Candidates are joined operation by operation at the lesser duration (a fix only shortens)."""
    if not 2 <= len(fixes) <= MAX_JOINT_CANDIDATES or total <= 0:
        return [None] * len(fixes)

    def joined(chosen) -> pd.Series:
        durations = reduce(np.minimum, [fix[1] for fix in chosen])
        transfer = reduce(np.minimum, [fix[2] for fix in chosen])
        return replay(durations, transfer)

    everything = joined(fixes)
    return [_saved_pct(joined([f for j, f in enumerate(fixes) if j != i]), everything, total)
            for i in range(len(fixes))]  # fmt: skip


def _saved_pct(before: pd.Series, after: pd.Series, total: float) -> float:
    """What replaying `after` instead of `before` saves, % of `total` (0 where it is 0)."""
    return 100.0 * float((before - after).sum()) / total if total > 0 else 0.0
