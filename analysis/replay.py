"""What-if replay: the run's steps re-executed from their recorded order of operations with
chosen durations, to price slowdowns (after the OSDI'25 what-if analysis of stragglers).

Each rank's step is a sequence of collectives (table `collectives`) and the compute gaps between
them (from the step's start to the first collective, between collectives, to the step's end).
A gap is labelled with the phase span holding its midpoint (forward, backward, optimizer, ...;
`host` outside every phase). The replay runs every rank from t = 0:
- a gap takes its duration;
- a send starts its transfer when issued and never waits; the matching recv ends at
  max(recv issued, send issued) + transfer;
- any other collective (and a combined send_recv) starts when its last member arrives and
  ends for all members one transfer later.
Transfer is the instance's transfer time (`collectives.transfer_s`, the time after its last
member arrived). A step's replayed time is its last rank's end. Warm-up steps are left out,
as everywhere.

The ideal step: every gap at the mean over all ranks of its (step, label) compute, spread evenly
over the rank's gaps of that label (so stage imbalance, stragglers and per-micro-batch variation
all go), communication at its transfer time. Slowdown S = Σ replayed actual / Σ replayed ideal
over the traced steps; each finding's share of S is what idealising only its operations removes
(analysis/whatif.py: a rank's gaps at its stage peers' pace), over what idealising everything
removes. A slow link is not in S (communication stays at its transfer time): its `saved_pct` is
what its groups' transfers at their axis's median would save.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import duckdb
import numpy as np
import pandas as pd

from analysis import whatif
from analysis.imbalances import Imbalance
from analysis.peers import WARMUP_STEPS
from analysis.replay_graph import COMPUTE, RECV, SEND, ReplayGraph, compile_graph

MIN_GAP_S = 1e-6
"""Shorter gaps between collectives are clock rounding of back-to-back calls, not compute."""
SPREAD_MIN_SAVED_PCT = 12.0
"""Compute variation no finding explains is a random imbalance when idealising it saves ≥ 12% of
the replayed time (healthy CPU runs here leave 6-7%; ±30% per micro-batch leaves 10%)..."""
SPREAD_MAX_RANK_SHARE = 0.5
"""...and no rank holds more than half of that excess compute."""
MAX_REPLAY_CALLS = 250_000
"""A run with more recorded collectives (after warm-up) is replayed on every k-th step, k the
smallest that fits: 1,024 ranks × 1,000 steps would take minutes to load whole, and S is a
ratio of sums that a regular sample of steps estimates (the research traces keep a sample)."""


@dataclass
class Timeline:
    """A run's replayable steps: entries in order per (step, rank), and instance facts."""

    entries: pd.DataFrame
    """step, rank, pp, kind (COMPUTE/SEND/RECV/GROUP), duration_s (gaps), instance (index into
    the instance arrays, -1 for gaps), label (gaps' phase); ordered by step, rank, then time."""
    transfer_s: np.ndarray
    """Per instance: its transfer time (max over its members)."""
    size: np.ndarray
    """Per instance: its calls in the replayed steps (the members a group waits for)."""
    instance_axis: np.ndarray
    call_instance: np.ndarray
    """Per recorded call: its instance (with call_rank: which ranks each instance holds)."""
    call_rank: np.ndarray
    measured_step_s: pd.Series
    """Per step: the measured job step time (last end - first start over the ranks)."""
    sampled_every: int
    """1: every step with collectives is replayed; k: every k-th (MAX_REPLAY_CALLS)."""
    graph: ReplayGraph = field(init=False)

    def __post_init__(self) -> None:
        self.graph = compile_graph(self.entries)


_ENTRIES_SQL = """
WITH keyed AS (  -- an instance: one (axis, group, pair of a point-to-point, seq, step)
    SELECT c.*, coalesce(c.axis, '') AS k_axis, coalesce(c.group_id, -1) AS k_group,
           CASE WHEN c.peer >= 0 THEN greatest(c.rank, c.peer) ELSE -1 END AS k_pair
    FROM collectives c WHERE c.run_id = $run AND c.step IN (SELECT unnest($steps))
), instances AS (
    SELECT *, row_number() OVER () - 1 AS instance
    FROM (SELECT DISTINCT k_axis, k_group, k_pair, seq, step FROM keyed)
), calls AS (
    SELECT c.rank, c.step, s.pp, c.op, c.axis, c.transfer_s, c.start_ns, c.end_ns,
           s.end_ns AS step_end_ns, i.instance,
           row_number() OVER per_block AS nth,
           lead(c.start_ns) OVER per_block IS NULL AS last_in_block,
           coalesce(lag(c.end_ns) OVER per_block, s.start_ns) AS gap_start_ns
    FROM keyed c JOIN steps s USING (run_id, rank, step)
    JOIN instances i USING (k_axis, k_group, k_pair, seq, step)
    WINDOW per_block AS (PARTITION BY c.rank, c.step ORDER BY c.start_ns, c.end_ns, c.seq)
), gaps AS (
    SELECT rank, step, pp, 2 * nth - 2 AS position, gap_start_ns AS start_ns,
           start_ns AS end_ns
    FROM calls
    UNION ALL
    SELECT rank, step, pp, 2 * nth, end_ns, step_end_ns FROM calls WHERE last_in_block
), kept AS (
    SELECT *, (start_ns + end_ns) // 2 AS mid_ns FROM gaps
    WHERE (end_ns - start_ns) / 1e9 >= $min_gap
), phases AS (
    SELECT rank, step, start_ns, end_ns, phase FROM spans
    WHERE run_id = $run AND name = 'ranktrace.phase'
)
SELECT g.step, g.rank, g.pp, 0 AS kind, (g.end_ns - g.start_ns) / 1e9 AS duration_s,
       -1 AS instance, CASE WHEN g.mid_ns < p.end_ns THEN p.phase ELSE 'host' END AS label,
       NULL AS axis, NULL AS transfer_s, g.position
FROM kept g ASOF LEFT JOIN phases p
    ON g.rank = p.rank AND g.step = p.step AND g.mid_ns >= p.start_ns
UNION ALL
SELECT step, rank, pp, CASE op WHEN 'send' THEN 1 WHEN 'recv' THEN 2 ELSE 3 END, 0.0, instance,
       '', axis, transfer_s, 2 * nth - 1
FROM calls
ORDER BY step, rank, position
"""
_CALLS_PER_STEP_SQL = """
SELECT step, count(*) AS calls FROM collectives WHERE run_id = $run AND step >= $warmup
GROUP BY step ORDER BY step
"""
_MEASURED_SQL = """
SELECT step, (max(end_ns) - min(start_ns)) / 1e9 AS seconds FROM steps
WHERE run_id = $run AND step IN (SELECT unnest($steps)) GROUP BY step ORDER BY step
"""


def load_timeline(con: duckdb.DuckDBPyConnection, run_id: str) -> Timeline | None:
    """The replayable steps of `run_id` (those with recorded collectives), or None.

    Entries are each (rank, step)'s collectives in time order with the compute gaps before
    each and after the last; a gap is labelled with the phase span holding its midpoint."""
    per_step = con.execute(_CALLS_PER_STEP_SQL, {"run": run_id, "warmup": WARMUP_STEPS}).df()
    every = max(1, -(-int(per_step["calls"].sum()) // MAX_REPLAY_CALLS))
    known = {"run": run_id, "steps": per_step["step"].to_numpy()[::every].tolist()}
    rows = con.execute(_ENTRIES_SQL, {**known, "min_gap": MIN_GAP_S}).fetchnumpy()
    call = rows["kind"] != COMPUTE
    if not call.any():
        return None
    call_instance = rows["instance"][call]
    n_instances = int(call_instance.max()) + 1  # numbered 0.. in SQL
    transfer_s = np.zeros(n_instances)
    np.maximum.at(transfer_s, call_instance, np.ma.filled(rows["transfer_s"][call], 0.0))
    instance_axis = np.empty(n_instances, dtype=object)
    instance_axis[call_instance] = np.ma.filled(rows["axis"][call], "")  # one axis per instance
    measured = con.execute(_MEASURED_SQL, known).df().set_index("step")["seconds"]
    columns = ("step", "rank", "pp", "kind", "duration_s", "instance", "label")
    return Timeline(
        entries=pd.DataFrame({name: np.ma.getdata(rows[name]) for name in columns}),
        transfer_s=transfer_s,
        size=np.bincount(call_instance, minlength=n_instances),
        instance_axis=instance_axis,
        call_instance=call_instance,
        call_rank=rows["rank"][call],
        measured_step_s=measured,
        sampled_every=every,
    )


def ideal_durations(entries: pd.DataFrame, within_stage: bool = False) -> np.ndarray:
    """Per entry: a gap's ideal duration (module docstring); 0 for collectives. With
    `within_stage`, the mean is over the ranks of the gap's pipeline stage only (what is left is
    variation inside a stage, not the stages' different work)."""
    gaps = entries["kind"].to_numpy() == COMPUTE
    step, rank, label, pp = (pd.factorize(entries[c])[0] for c in ("step", "rank", "label", "pp"))
    scope = pd.factorize(_pairs(step, pp))[0] if within_stage else step
    n_ranks = int(rank.max()) + 1
    ranks_per_scope = np.bincount(np.unique(scope * n_ranks + rank) // n_ranks)
    durations = entries["duration_s"].to_numpy()
    totals, total_of = _sums(_pairs(scope, label)[gaps], durations[gaps])
    pieces, piece_of = _sums(_pairs(_pairs(step, label), rank)[gaps], None)
    ideal = np.zeros(len(entries))
    ideal[gaps] = totals[total_of] / ranks_per_scope[scope[gaps]] / pieces[piece_of]
    return ideal


def _pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One int64 code per (a, b) pair of non-negative integer codes."""
    return a.astype(np.int64) * (int(b.max()) + 1) + b


def _sums(keys: np.ndarray, weights: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(per distinct key the sum of `weights`, or the count; each key's index into it)."""
    index = pd.factorize(keys)[0]
    return np.bincount(index, weights=weights), index


def replay(timeline: Timeline, durations: np.ndarray, transfer_s: np.ndarray) -> pd.Series:
    """Per step: the replayed step time with gap `durations` (aligned with timeline.entries)
    and per-instance `transfer_s`. The graph evaluates every step at once
    (analysis/replay_graph.py); its irregular steps take the event replay."""
    graph = timeline.graph
    times = pd.Series(graph.step_times(durations, transfer_s), index=graph.steps, dtype=float)
    for step in graph.irregular_steps:
        times[step] = event_replay(timeline, step, durations, transfer_s)
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


@dataclass
class Slowdown:
    """S and what the replay saw (see the module docstring)."""

    slowdown: float
    replayed_s: float
    """Σ over the replayed steps of the replayed actual step time."""
    ideal_s: float
    measured_s: float
    """Σ of the measured job step times of the same steps."""
    steps: int
    sampled_every: int
    """1, or k when only every k-th step was replayed (MAX_REPLAY_CALLS)."""

    def to_dict(self) -> dict:
        return {
            "slowdown": self.slowdown, "replayed_s": self.replayed_s, "ideal_s": self.ideal_s,
            "measured_s": self.measured_s, "steps": self.steps,
            "sampled_every": self.sampled_every,
            "replay_error_pct": 100 * (self.replayed_s - self.measured_s) / self.measured_s
            if self.measured_s else None,
        }  # fmt: skip


def slowdown(con: duckdb.DuckDBPyConnection, run_id: str, stragglers, imbalances) -> dict | None:
    """`slowdown` (S), `slowdown_detail` and `slowdown_by_cause` (each finding's share of S, %)
    of a run, plus `spread_imbalance`: a random imbalance the replay finds where the findings
    leave ≥ SPREAD_MIN_SAVED_PCT of the time and no rank holds most of it (None otherwise), and
    `stragglers`: those the replay confirms (analysis/whatif.py), priced by it.
    None when no step has recorded collectives to replay."""
    timeline = load_timeline(con, run_id)
    if timeline is None:
        return None
    entries = timeline.entries
    actual_gaps = entries["duration_s"].to_numpy()
    ideal_gaps = ideal_durations(entries)
    actual = replay(timeline, actual_gaps, timeline.transfer_s)
    ideal = replay(timeline, ideal_gaps, timeline.transfer_s)
    summary = Slowdown(
        slowdown=float(actual.sum() / ideal.sum()) if ideal.sum() > 0 else 1.0,
        replayed_s=float(actual.sum()), ideal_s=float(ideal.sum()),
        measured_s=float(timeline.measured_step_s.reindex(actual.index).sum()),
        steps=len(actual), sampled_every=timeline.sampled_every,
    )  # fmt: skip
    gaps = timeline.graph.is_gap

    def rerun(durations, transfer) -> pd.Series:
        return replay(timeline, durations, transfer)

    stragglers = whatif.confirmed(timeline, stragglers, rerun, actual, actual_gaps, ideal_gaps)

    def what_if(mask, transfer, ideal=ideal_gaps) -> tuple[float, pd.Series]:
        """Seconds saved (and the replayed steps) with the `mask` gaps at `ideal`."""
        fixed = rerun(np.where(mask, ideal, actual_gaps), transfer)
        return float((actual - fixed).sum()), fixed

    priced, covered = [], np.zeros(len(entries), dtype=bool)
    for finding in [*stragglers, *imbalances]:
        if finding.kind != "random":
            mask, durations, transfer = whatif.finding_what_if(
                timeline, finding, actual_gaps, ideal_gaps
            )
            covered |= mask
            priced.append((finding, float((actual - rerun(durations, transfer)).sum())))
    removable = summary.replayed_s - summary.ideal_s
    random_found = any(f.kind == "random" for f in imbalances)
    spread = None
    # What the findings leave, inside each stage (the stages' different work is not random): a
    # random imbalance, or noise. Not replayed when even idealising everything saves too little.
    if random_found or 100 * removable >= SPREAD_MIN_SAVED_PCT * summary.replayed_s:
        rest = gaps & ~covered
        stage_ideal = ideal_durations(entries, within_stage=True)
        saved_rest, fixed_rest = what_if(rest, timeline.transfer_s, stage_ideal)
        if not random_found:
            spread = _spread_imbalance(entries, rest, actual_gaps - stage_ideal, saved_rest,
                                       summary.replayed_s, fixed_rest)  # fmt: skip
        priced += [(f, saved_rest) for f in [*imbalances, *([spread] if spread else [])]
                   if f.kind == "random"]  # fmt: skip
    by_cause = []
    for finding, saved in priced:
        link = finding.kind == "communication"  # the ideal keeps every transfer: no share
        by_cause.append({
            **_cause_of(finding),
            "share_pct": None if link else 100 * saved / removable if removable > 1e-9 else 0.0,
            "saved_pct": 100 * saved / summary.replayed_s if summary.replayed_s else 0.0,
            "slowdown_without": (summary.replayed_s - saved) / summary.ideal_s
            if summary.ideal_s > 0 else 1.0,
        })  # fmt: skip
    return {"slowdown": summary.slowdown, "slowdown_detail": summary.to_dict(),
            "slowdown_by_cause": by_cause, "spread_imbalance": spread,
            "stragglers": stragglers}  # fmt: skip


def _spread_imbalance(entries, rest, excess, saved, replayed_s, fixed):
    """A random Imbalance when idealising what the findings leave saves ≥ SPREAD_MIN_SAVED_PCT
    of the replayed time and no rank holds more than SPREAD_MAX_RANK_SHARE of the excess
    compute there (else that rank, not the spread, is the cause); None otherwise."""
    if replayed_s <= 0 or 100 * saved / replayed_s < SPREAD_MIN_SAVED_PCT:
        return None
    ranks = entries["rank"].to_numpy()[rest]
    per_rank = pd.Series(np.clip(excess, 0, None)[rest]).groupby(ranks).sum()
    if per_rank.sum() <= 0 or per_rank.max() / per_rank.sum() > SPREAD_MAX_RANK_SHARE:
        return None
    return Imbalance(
        kind="random", stage=None, excess=round(saved / replayed_s, 3),
        cost_pct=round(100 * saved / replayed_s, 2),
        whatif_step_time_s=float(fixed.median()),
        ranks=sorted(int(r) for r in per_rank[per_rank > 0].index),
    )  # fmt: skip


def _cause_of(finding) -> dict:
    """How a finding is named in `slowdown_by_cause`."""
    if finding.kind in ("stage", "random"):
        return {"cause": f"{finding.kind} imbalance", "kind": finding.kind,
                "stage": getattr(finding, "stage", None), "rank": None}  # fmt: skip
    return {"cause": f"rank {finding.rank} {finding.kind}", "kind": finding.kind,
            "stage": None, "rank": finding.rank}  # fmt: skip
