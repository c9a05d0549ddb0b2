"""A run's replayable steps, read from the store for the what-if replay (analysis/replay.py):
per (step, rank), the operations in recorded order, the instances their calls belong to, and the
dependency model the run's data shows (analysis/replay_graph.py).

- Host-serial runs (this machine's CPU ranks): entries are the collectives and the compute gaps
  between them, a gap labelled with the phase span holding its midpoint (`host` outside every
  phase); there are no launch delays: the host's own time is the rank's work.
- Rendezvous runs (GPU traces, e.g. imported per-op traces): entries are the compute operations
  (phase spans) and the calls. Point-to-point calls of one rank with the same start and end are
  one batched call (a send and a recv posted together, as Megatron's 1F1B does), whose
  transfers make one instance with their peers'. Each operation carries its launch delay: how
  much later it started than its dependencies allowed in the recording (a compute operation's
  as a `launch` gap before it, a call's in `call_delay`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb
import numpy as np
import pandas as pd

from ranktrace.analysis.peers import WARMUP_STEPS
from ranktrace.analysis.replay_graph import (
    COMPUTE,
    GROUP,
    HOST_SERIAL,
    RECV,
    RENDEZVOUS,
    SEND,
    ReplayGraph,
    compile_graph,
)

MIN_GAP_S = 1e-6
"""Shorter gaps between collectives are clock rounding of back-to-back calls, not compute."""
LAUNCH = "launch"
"""The label of a launch-delay gap (rendezvous runs)."""

MAX_REPLAY_CALLS = 250_000
"""A run with more recorded collectives (after warm-up) is replayed on every k-th step, k the
smallest that fits: 1,024 ranks × 1,000 steps would take minutes to load whole, and S is a
ratio of sums that a regular sample of steps estimates (the research traces keep a sample)."""


@dataclass
class Timeline:
    """A run's replayable steps: entries in order per (step, rank), and instance facts."""

    entries: pd.DataFrame
    """step, rank, pp, kind (COMPUTE/SEND/RECV/GROUP), duration_s (gaps), instance (index into
    the instance arrays, -1 for gaps), label (gaps' phase; `launch` for launch delays); ordered
    by step, rank, then time. Host-serial runs add position (an entry's place in its block: a
    gap before the n-th call at 2n - 2, the call at 2n - 1), signature (`_call_signatures`) and
    core_wait_s (a gap's wait for a core, where the rank recorded it; NaN elsewhere)."""
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
    model: str = HOST_SERIAL
    """The dependency model (analysis/replay_graph.py)."""
    call_delay: np.ndarray | None = None
    """(entries,) each call's launch delay (rendezvous runs; None: none)."""
    graph: ReplayGraph = field(init=False)

    def __post_init__(self) -> None:
        self.graph = compile_graph(self.entries, self.model)

    @property
    def launch(self) -> np.ndarray:
        """(entries,) the launch-delay gaps."""
        return (self.entries["label"] == LAUNCH).to_numpy()

    def delays(self) -> np.ndarray:
        """(entries,) the calls' launch delays, 0 elsewhere."""
        return np.zeros(len(self.entries)) if self.call_delay is None else self.call_delay


_ENTRIES_SQL = """
WITH keyed AS (  -- an instance: one (axis, group, pair of a point-to-point, seq, step); async
    -- work occupies the rank only while it waited for it, at its end
    SELECT c.* REPLACE (c.end_ns - coalesce(c.wait_ns, c.end_ns - c.start_ns) AS start_ns),
           coalesce(c.axis, '') AS k_axis, coalesce(c.group_id, -1) AS k_group,
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
           coalesce(lag(c.end_ns) OVER per_block, s.start_ns) AS gap_start_ns,
           -- the step thread's wait for a core since the step began (NULL: not recorded)
           c.core_wait_start_ns, c.core_wait_end_ns,
           s.core_wait_s * 1e9 AS step_core_wait_ns,
           lag(c.core_wait_end_ns, 1, 0) OVER per_block AS gap_core_wait_from_ns
    FROM keyed c JOIN steps s USING (run_id, rank, step)
    JOIN instances i USING (k_axis, k_group, k_pair, seq, step)
    WINDOW per_block AS (PARTITION BY c.rank, c.step ORDER BY c.start_ns, c.end_ns, c.seq)
), gaps AS (
    SELECT rank, step, pp, 2 * nth - 2 AS position, gap_start_ns AS start_ns,
           start_ns AS end_ns, core_wait_start_ns - gap_core_wait_from_ns AS core_wait_ns
    FROM calls
    UNION ALL
    SELECT rank, step, pp, 2 * nth, end_ns, step_end_ns, step_core_wait_ns - core_wait_end_ns
    FROM calls WHERE last_in_block
), kept AS (
    SELECT *, (start_ns + end_ns) // 2 AS mid_ns FROM gaps
    WHERE (end_ns - start_ns) / 1e9 >= $min_gap
), phases AS (
    SELECT rank, step, start_ns, end_ns, phase FROM spans
    WHERE run_id = $run AND name = 'ranktrace.phase' AND step IN (SELECT unnest($steps))
)
SELECT g.step, g.rank, g.pp, 0 AS kind, (g.end_ns - g.start_ns) / 1e9 AS duration_s,
       -1 AS instance, CASE WHEN g.mid_ns < p.end_ns THEN p.phase ELSE 'host' END AS label,
       NULL AS axis, NULL AS transfer_s, g.position, g.core_wait_ns / 1e9 AS core_wait_s
FROM kept g ASOF LEFT JOIN phases p
    ON g.rank = p.rank AND g.step = p.step AND g.mid_ns >= p.start_ns
UNION ALL
SELECT step, rank, pp, CASE op WHEN 'send' THEN 1 WHEN 'recv' THEN 2 ELSE 3 END, 0.0, instance,
       '', axis, transfer_s, 2 * nth - 1, NULL
FROM calls
ORDER BY step, rank, position
"""
_CALLS_PER_STEP_SQL = """
WITH world AS (SELECT attempt, max(world_size) AS ranks FROM ranks WHERE run_id = $run
               GROUP BY attempt),
complete AS (  -- steps every rank of its attempt's world recorded (see load_timeline)
    SELECT s.step FROM steps s LEFT JOIN world w USING (attempt) WHERE s.run_id = $run
    GROUP BY s.step HAVING count(DISTINCT s.rank) >= coalesce(max(w.ranks), 0)
)
SELECT step, count(*) AS calls FROM collectives WHERE run_id = $run AND step >= $warmup
AND step IN (SELECT step FROM complete) GROUP BY step ORDER BY step
"""
_MEASURED_SQL = """
SELECT step, (max(end_ns) - min(start_ns)) / 1e9 AS seconds FROM steps
WHERE run_id = $run AND step IN (SELECT unnest($steps)) GROUP BY step ORDER BY step
"""


_OPS_SQL = """
WITH keyed AS (  -- an instance: one (axis, group, pair of a point-to-point, seq, step); async
    -- work occupies the rank only while it waited for it, at its end
    SELECT c.* REPLACE (c.end_ns - coalesce(c.wait_ns, c.end_ns - c.start_ns) AS start_ns),
           coalesce(c.axis, '') AS k_axis, coalesce(c.group_id, -1) AS k_group,
           CASE WHEN c.peer >= 0 THEN greatest(c.rank, c.peer) ELSE -1 END AS k_pair
    FROM collectives c WHERE c.run_id = $run AND c.step IN (SELECT unnest($steps))
), instances AS (
    SELECT *, row_number() OVER () - 1 AS instance
    FROM (SELECT DISTINCT k_axis, k_group, k_pair, seq, step FROM keyed)
)
SELECT c.step, c.rank, s.pp, CASE c.op WHEN 'send' THEN 1 WHEN 'recv' THEN 2
       WHEN 'send_recv' THEN 2 ELSE 3 END AS kind, c.start_ns, c.end_ns, i.instance,
       c.axis, coalesce(c.transfer_s, 0.0) AS transfer_s, '' AS label
FROM keyed c JOIN steps s USING (run_id, rank, step)
JOIN instances i USING (k_axis, k_group, k_pair, seq, step)
UNION ALL
SELECT p.step, p.rank, s.pp, 0, p.start_ns, p.end_ns, -1, NULL, NULL, p.phase
FROM spans p JOIN steps s USING (run_id, rank, step)
WHERE p.run_id = $run AND p.name = 'ranktrace.phase' AND p.step IN (SELECT unnest($steps))
ORDER BY step, rank, start_ns, end_ns
"""


def load_timeline(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    model: str = HOST_SERIAL,
    max_calls: int | None = None,
) -> Timeline | None:
    """The replayable steps of `run_id` (those with recorded collectives that every rank of
    the world recorded: a group waits for its members, and one that recorded nothing, or had
    stopped, leaves its peers' waits unexplained) under dependency `model`, every k-th of them
    where they hold more than `max_calls` calls (MAX_REPLAY_CALLS unless given), or None
    (module docstring)."""
    per_step = con.execute(_CALLS_PER_STEP_SQL, {"run": run_id, "warmup": WARMUP_STEPS}).df()
    budget = max(1, MAX_REPLAY_CALLS if max_calls is None else max_calls)
    every = max(1, -(-int(per_step["calls"].sum()) // budget))
    known = {"run": run_id, "steps": per_step["step"].to_numpy()[::every].tolist()}
    if model == RENDEZVOUS:
        ops = con.execute(_OPS_SQL, known).df()
        if not (ops["kind"] != COMPUTE).any():
            return None
        entries, call_delay, instances = _rendezvous_entries(ops)
    else:
        rows = con.execute(_ENTRIES_SQL, {**known, "min_gap": MIN_GAP_S}).fetchnumpy()
        if not (rows["kind"] != COMPUTE).any():
            return None
        columns = ("step", "rank", "pp", "kind", "duration_s", "instance", "label", "position")
        entries = pd.DataFrame({name: np.ma.getdata(rows[name]) for name in columns})
        entries["signature"] = _call_signatures(entries, np.ma.filled(rows["axis"], ""))
        entries["core_wait_s"] = np.ma.filled(rows["core_wait_s"].astype(np.float64), np.nan)
        call_delay = None
        call = rows["kind"] != COMPUTE
        instances = pd.DataFrame({
            "instance": rows["instance"][call], "rank": rows["rank"][call],
            "transfer_s": np.ma.filled(rows["transfer_s"][call], 0.0),
            "axis": np.ma.filled(rows["axis"][call], ""),
        })  # fmt: skip
    n_instances = int(instances["instance"].max()) + 1  # numbered 0..
    call_instance = instances["instance"].to_numpy()
    transfer_s = np.zeros(n_instances)
    np.maximum.at(transfer_s, call_instance, instances["transfer_s"].to_numpy(dtype=float))
    instance_axis = np.empty(n_instances, dtype=object)
    instance_axis[call_instance] = instances["axis"].to_numpy()  # one axis per instance
    measured = con.execute(_MEASURED_SQL, known).df().set_index("step")["seconds"]
    return Timeline(
        entries=entries,
        transfer_s=transfer_s,
        size=np.bincount(call_instance, minlength=n_instances),
        instance_axis=instance_axis,
        call_instance=call_instance,
        call_rank=instances["rank"].to_numpy(),
        measured_step_s=measured,
        sampled_every=every,
        model=model,
        call_delay=call_delay,
    )


def _call_signatures(entries: pd.DataFrame, axis: np.ndarray) -> np.ndarray:
    """(entries,) a code per (step, rank) of the block's sequence of calls (kind and axis, in
    order): ranks whose blocks share it ran the same program between the same calls, so their
    gaps at one position are the same work (analysis/replay.py `gap_slots`)."""
    call = (entries["kind"] != COMPUTE).to_numpy()
    block = entries.groupby(["step", "rank"], sort=False).ngroup().to_numpy()
    # a polynomial hash of each block's (kind, axis) codes, wrapping in uint64 (entries are in
    # block order, so a block's calls are contiguous)
    kinds = pd.MultiIndex.from_arrays([entries["kind"].to_numpy()[call], axis[call]])
    token = pd.factorize(kinds)[0].astype(np.uint64) + np.uint64(1)
    call_block = block[call]
    nth = pd.Series(call_block).groupby(call_block).cumcount().to_numpy().astype(np.uint64)
    terms = token * np.power(np.uint64(1_000_003), nth)
    starts = np.flatnonzero(np.r_[True, call_block[1:] != call_block[:-1]])
    hashes = np.add.reduceat(terms, starts)
    counts = np.diff(np.r_[starts, len(call_block)])
    codes = np.full(int(block.max()) + 1, -1, dtype=np.int64)
    codes[call_block[starts]] = pd.factorize(pd.MultiIndex.from_arrays([hashes, counts]))[0]
    return codes[block]


def _rendezvous_entries(ops: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray, pd.DataFrame]:
    """(entries, call_delay, one row per recorded call: instance, rank, transfer_s, axis) of a
    rendezvous run from its operations (`_OPS_SQL`, in order per (step, rank))."""
    calls = ops[ops["kind"] != COMPUTE]
    p2p = calls[calls["kind"] != GROUP]
    key = p2p[["step", "rank", "start_ns", "end_ns"]].to_numpy()
    batched = (key[1:] == key[:-1]).all(axis=1)  # a row and the next: one batched call
    instance = p2p["instance"].to_numpy()
    component = _components(int(ops["instance"].max()) + 1,
                            instance[:-1][batched], instance[1:][batched])  # fmt: skip
    recorded = pd.DataFrame({
        "instance": component[calls["instance"].to_numpy()], "rank": calls["rank"].to_numpy(),
        "transfer_s": calls["transfer_s"].to_numpy(dtype=float),
        "axis": calls["axis"].fillna("").to_numpy(),
    })  # fmt: skip
    # a batched call: one entry, a recv if any of its parts is one
    first = ~calls.duplicated(["step", "rank", "start_ns", "end_ns"]) | (calls["kind"] == GROUP)
    kept = ops[(ops["kind"] == COMPUTE) | ops.index.isin(calls.index[first.to_numpy()])].copy()
    has_recv = p2p[p2p["kind"] == RECV].groupby(["step", "rank", "start_ns"]).size()
    key = pd.MultiIndex.from_frame(kept[["step", "rank", "start_ns"]])
    is_p2p = kept["kind"].isin((SEND, RECV)).to_numpy()
    kept.loc[is_p2p & has_recv.reindex(key, fill_value=0).to_numpy().astype(bool), "kind"] = RECV
    kept["instance"] = np.where(kept["kind"] == COMPUTE, -1,
                                component[np.maximum(kept["instance"].to_numpy(), 0)])  # fmt: skip
    delay = _launch_delays(kept)
    compute = (kept["kind"] == COMPUTE).to_numpy()
    durations = (kept["end_ns"] - kept["start_ns"]).to_numpy() / 1e9
    launch = kept[compute].assign(label=LAUNCH, kind=COMPUTE, instance=-1)
    rows = pd.concat([
        launch.assign(duration_s=delay[compute], order=2 * np.flatnonzero(compute)),
        kept.assign(duration_s=np.where(compute, durations, 0.0),
                    order=2 * np.arange(len(kept)) + 1),
    ]).sort_values("order", kind="stable")  # fmt: skip
    rows = rows[(rows["label"] != LAUNCH) | (rows["duration_s"] > 0)].reset_index(drop=True)
    call_delay = np.zeros(len(rows))
    is_call = (rows["kind"] != COMPUTE).to_numpy()
    call_delay[is_call] = delay[~compute]
    columns = ["step", "rank", "pp", "kind", "duration_s", "instance", "label"]
    entries = rows[columns].astype({"kind": np.int64, "instance": np.int64})
    entries["label"] = entries["label"].fillna("")
    return entries.reset_index(drop=True), call_delay, recorded


def _components(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(n,) the connected component of each of n instances when instances a[i] and b[i] are
    joined (the parts of one batched call), numbered 0.. in order of first appearance."""
    label = np.arange(n)
    while True:
        low = np.minimum(label[a], label[b])
        np.minimum.at(label, a, low)
        np.minimum.at(label, b, low)
        label = label[label]  # follow each label to its own label
        if (label[a] == label[b]).all():
            return pd.factorize(label)[0]


def _launch_delays(ops: pd.DataFrame) -> np.ndarray:
    """(ops,) how much later than its dependencies allowed each operation started (ns → s):
    compute and groups after the previous compute-stream operation and after the recvs before
    them; point-to-point calls after the previous such call and the compute before them; the
    step's first operations after the step's earliest start."""
    start = ops["start_ns"].to_numpy(dtype=np.float64)
    end = ops["end_ns"].to_numpy(dtype=np.float64)
    kind = ops["kind"].to_numpy()
    block = ops.groupby(["step", "rank"], sort=False).ngroup().to_numpy()
    origin = ops.groupby("step")["start_ns"].transform("min").to_numpy(dtype=np.float64)
    on_compute = (kind == COMPUTE) | (kind == GROUP)

    def previous_end(mask: np.ndarray) -> np.ndarray:
        """Per op: the end of the last op before it in its block with `mask`; its origin."""
        marked = pd.Series(np.where(mask, end, np.nan)).groupby(block).shift(1)
        return marked.groupby(block).ffill().fillna(pd.Series(origin)).to_numpy()

    prev_compute, prev_p2p = previous_end(on_compute), previous_end(~on_compute)
    last_recv = previous_end(kind == RECV)
    ready = np.where(on_compute, np.maximum(prev_compute, last_recv),
                     np.maximum(prev_compute, prev_p2p))  # fmt: skip
    return np.clip(start - ready, 0.0, None) / 1e9
