"""What-if replay: the run's steps re-executed from their recorded order of operations with
chosen durations, to price slowdowns (after the OSDI'25 what-if analysis of stragglers,
Lin et al.). analysis/replay_timeline.py reads the operations, analysis/replay_graph.py holds the
two dependency models and evaluates them, analysis/slowdown.py turns replays into S and causes.

Host-serial runs (this machine's CPU ranks): each rank's step is its collectives and the compute
gaps between them; a gap takes its duration; a send never waits; the matching recv ends at
max(recv issued, send issued) + transfer; any other collective (and a combined send_recv)
ends one transfer after its last member arrived. Rendezvous runs (GPU traces): point-to-point
calls on their own stream complete with their peer, recvs gate the compute after them, and
every operation may start late by its recorded launch delay (analysis/replay_graph.py).
Transfer is the instance's transfer time (`collectives.transfer_s`, the time after its last
member arrived). A step's replayed time is its last rank's end. Warm-up steps are left out,
as everywhere.

Ideal durations:
- host-serial: every gap at the mean over all ranks of its (step, slot) compute, spread evenly
  over the rank's gaps of that slot (so stage imbalance, stragglers and per-micro-batch
  variation all go); communication at its transfer time. A slot is the gap's position among
  the calls where the ranks made the same calls (`gap_slots`), else its phase label;
- rendezvous, as the published method: every operation at its mean over the ranks and steps of
  the same operation (its label and its place among the rank's operations of that label in the
  step), communication at the mean transfer of the same call, no launch delays.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pandas as pd

from ranktrace.analysis.replay_graph import COMPUTE, HOST_SERIAL, RECV, SEND
from ranktrace.analysis.replay_timeline import Timeline


def ideal_durations(entries: pd.DataFrame, within_stage: bool = False) -> np.ndarray:
    """Per entry: a gap's ideal duration (module docstring); 0 for collectives. With
    `within_stage`, the mean is over the ranks of the gap's pipeline stage only (what is left is
    variation inside a stage, not the stages' different work)."""
    gaps = entries["kind"].to_numpy() == COMPUTE
    step, rank, pp = (pd.factorize(entries[c])[0] for c in ("step", "rank", "pp"))
    scope = pd.factorize(_pairs(step, pp))[0] if within_stage else step
    slot = gap_slots(entries, scope)
    n_ranks = int(rank.max()) + 1
    ranks_per_scope = np.bincount(np.unique(scope * n_ranks + rank) // n_ranks)
    durations = entries["duration_s"].to_numpy()
    totals, total_of = _sums(_pairs(scope, slot)[gaps], durations[gaps])
    pieces, piece_of = _sums(_pairs(_pairs(step, slot), rank)[gaps], None)
    ideal = np.zeros(len(entries))
    ideal[gaps] = totals[total_of] / ranks_per_scope[scope[gaps]] / pieces[piece_of]
    return ideal


def gap_slots(entries: pd.DataFrame, scope: np.ndarray) -> np.ndarray:
    """(entries,) a code per entry naming "the same work" across the ranks of its `scope` (codes
    per entry, e.g. the step, or the step and stage): where every rank of the scope made the
    same calls in the same order (one `signature`), a gap's position among them (the compute
    between the same two calls, whichever phase its middle fell in: a gap spanning data,
    forward and part of the backward reads as any of them, rank by rank); elsewhere its phase
    label (ranks of different pipeline stages, traces without positions)."""
    labels = pd.factorize(entries["label"])[0].astype(np.int64)
    if "signature" not in entries.columns:
        return labels
    by_scope = pd.Series(entries["signature"].to_numpy()).groupby(scope)
    aligned = (by_scope.transform("min") == by_scope.transform("max")).to_numpy()
    return np.where(aligned, labels.max() + 1 + entries["position"].to_numpy(np.int64), labels)


def _pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One int64 code per (a, b) pair of non-negative integer codes."""
    return a.astype(np.int64) * (int(b.max()) + 1) + b


def _sums(keys: np.ndarray, weights: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(per distinct key the sum of `weights`, or the count; each key's index into it)."""
    index = pd.factorize(keys)[0]
    return np.bincount(index, weights=weights), index


def per_op_ideal(timeline: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """(gap durations, per-instance transfers) of the rendezvous ideal (module docstring):
    launch gaps 0; a gap at the mean of its (label, n-th of that label in its block) over all
    blocks; an instance at the mean transfer of its (axis, kind of its first call, n-th such
    call in that call's block) over all instances."""
    entries = timeline.entries
    gaps = timeline.graph.is_gap & ~timeline.launch
    block = entries.groupby(["step", "rank"], sort=False).ngroup().to_numpy()
    label = entries["label"].to_numpy()
    nth = entries.groupby([block, label], sort=False).cumcount().to_numpy()
    durations = entries["duration_s"].to_numpy()
    key = pd.factorize(pd.MultiIndex.from_arrays([label, nth]))[0]
    means = pd.Series(durations[gaps]).groupby(key[gaps]).mean()
    ideal = np.zeros(len(entries))
    ideal[gaps] = means.reindex(key[gaps]).to_numpy()
    calls = np.flatnonzero(~timeline.graph.is_gap)
    call_kind = entries["kind"].to_numpy()[calls]
    call_key = pd.MultiIndex.from_arrays([
        timeline.instance_axis[entries["instance"].to_numpy()[calls]], call_kind,
        pd.Series(call_kind).groupby([block[calls], call_kind]).cumcount().to_numpy(),
    ])  # fmt: skip
    first = ~pd.Series(entries["instance"].to_numpy()[calls]).duplicated().to_numpy()
    instance = entries["instance"].to_numpy()[calls][first]
    codes = pd.factorize(call_key[first])[0]
    means = pd.Series(timeline.transfer_s[instance]).groupby(codes).transform("mean")
    transfer = timeline.transfer_s.copy()
    transfer[instance] = means.to_numpy()
    return ideal, transfer


def replay(
    timeline: Timeline,
    durations: np.ndarray,
    transfer_s: np.ndarray,
    delays: np.ndarray | None = None,
    steps: np.ndarray | None = None,
) -> pd.Series:
    """Per step (of `steps` only, when given): the replayed step time with gap `durations`
    (aligned with timeline.entries), per-instance `transfer_s` and the calls' launch `delays`
    (none: 0). The graph evaluates every step at once (analysis/replay_graph.py); its irregular
    steps take the event replay (host-serial runs) or are left out (rendezvous runs)."""
    graph = timeline.graph
    times = pd.Series(graph.step_times(durations, transfer_s, delays), index=graph.steps,
                      dtype=float)  # fmt: skip
    if steps is not None:
        times = times[times.index.isin(steps)]
    for step in graph.irregular_steps:
        if step not in times.index:
            continue
        if timeline.model == HOST_SERIAL:
            times[step] = event_replay(timeline, step, durations, transfer_s)
        else:
            times = times.drop(step)
    return times


def event_replay(timeline: Timeline, step: int, durations, transfer_s) -> float:
    """One step replayed call by call, a rank at a time until it waits (module docstring):
    slower than the graph, and the only way for a step whose calls wait on each other in a
    cycle."""
    step_of = timeline.entries["step"].to_numpy()
    part = slice(np.searchsorted(step_of, step, "left"), np.searchsorted(step_of, step, "right"))
    entries = timeline.entries.iloc[part]
    return _replay_step(entries["kind"].to_numpy(), entries["instance"].to_numpy(),
                        entries["rank"].to_numpy(), durations[part], transfer_s,
                        timeline.size)  # fmt: skip


def _replay_step(kinds, instances, ranks, durations, transfer_s, size) -> float:
    """One step's replay (module docstring); entries are grouped by rank, in time order."""
    bounds = np.flatnonzero(np.diff(ranks)) + 1
    pointer = np.concatenate([[0], bounds]).tolist()
    lasts = np.concatenate([bounds, [len(ranks)]]).tolist()
    kinds, instances, durations = kinds.tolist(), instances.tolist(), durations.tolist()
    clock = [0.0] * len(pointer)
    sent: dict[int, float] = {}
    waiting_recv: dict[int, int] = {}
    arrived: dict[int, list] = {}
    runnable, blocked = deque(range(len(pointer))), set()
    while True:
        while runnable:
            who = runnable.popleft()
            i, t, waiting = pointer[who], clock[who], False
            while i < lasts[who] and not waiting:
                kind, inst = kinds[i], instances[i]
                if kind == COMPUTE:
                    t += durations[i]
                elif kind == SEND:
                    sent[inst] = t
                    t += transfer_s[inst]
                    receiver = waiting_recv.pop(inst, None)
                    if receiver is not None:
                        blocked.discard(receiver)
                        runnable.append(receiver)
                elif kind == RECV:
                    if inst not in sent:
                        waiting_recv[inst], waiting = who, True
                        continue
                    t = max(t, sent[inst]) + transfer_s[inst]
                else:
                    members = arrived.setdefault(inst, [])
                    members.append((who, t))
                    if len(members) < size[inst]:
                        waiting = True
                        continue
                    t = _finish(arrived.pop(inst), transfer_s[inst], who, clock, pointer,
                                blocked, runnable)  # fmt: skip
                i += 1
            pointer[who], clock[who] = i, t
            if waiting:
                blocked.add(who)
        if not blocked:
            return max(clock)
        # Every rank waits on an instance whose other members never came (a partial trace):
        # the earliest-blocked one's instance finishes with the members it has.
        who = min(blocked, key=lambda r: clock[r])
        inst = instances[pointer[who]]
        waiting_recv.pop(inst, None)
        members = arrived.pop(inst, [(who, clock[who])])
        blocked.discard(who)
        clock[who] = _finish(members, transfer_s[inst], who, clock, pointer, blocked, runnable)
        pointer[who] += 1
        runnable.append(who)


def _finish(members, transfer, who, clock, pointer, blocked, runnable) -> float:
    """End an instance: every member but `who` resumes after it; returns its end."""
    done = max(ready for _, ready in members) + transfer
    for member, _ in members:
        if member != who:
            clock[member] = done
            pointer[member] += 1
            blocked.discard(member)
            runnable.append(member)
    return done
