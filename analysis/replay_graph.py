"""The what-if replay as a dependency graph, evaluated for every step at once, one level of the
graph at a time in numpy (analysis/replay.py says what the replay models; this is its fast path:
a 100k-call trace replays in milliseconds instead of a tenth of a second per pass in Python).

Two dependency models, chosen per run by what its data shows (replay.py):
- HOST_SERIAL (this machine's CPU ranks): a rank is one chain; a call waits for the compute
  before it, a send never waits, a recv waits for its sender's arrival at the send, a group for
  its last member. Nodes: one per group instance and one per send and per recv call.
- RENDEZVOUS (GPU jobs, e.g. Megatron 1F1B as in the OSDI'25 what-if traces): point-to-point
  calls run on their own communication stream, in order; a call (a send, a recv, or a batched
  send and recv, one call) posts after the compute before it and after the previous
  point-to-point call, and completes with its peer: both ends of a transfer leave together, one
  transfer after the later one posted (a send can wait). A recv gates the compute after it: a
  join node takes the later of the recv's end and the compute chain. Groups (data-parallel
  collectives, the gradient-norm all-reduce) sit on the compute stream. Every call may carry a
  launch delay (the host issued it late), added to its arrivals.
A node ends at its latest arrival plus its transfer time. An arrival is the end of a source node
(0 at the step's start) plus the compute gaps in between (plus the call's delay). A node's level
is one more than the highest level among its arrivals' sources, so a whole level is evaluated
in one go.

Steps whose calls wait on each other in a cycle (ranks issued them in conflicting orders) or
that mix group and point-to-point calls in one instance have no such order: `irregular_steps`,
which replay.py hands to its event replay (host-serial) or leaves out (rendezvous).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

COMPUTE, SEND, RECV, GROUP = 0, 1, 2, 3
HOST_SERIAL, RENDEZVOUS = "host-serial", "rendezvous"


@dataclass
class Level:
    """The arrivals into one level's nodes, sorted by node."""

    source: np.ndarray
    """(arrivals,) the node whose end the arrival starts from; n_nodes: the step's start (0)."""
    gaps_to: np.ndarray
    """(arrivals,) the call arrived at (entry index): gaps [gaps_from, gaps_to) come first."""
    gaps_from: np.ndarray
    delay_at: np.ndarray
    """(arrivals,) the call whose launch delay the arrival carries (entry index); -1: none."""
    nodes: np.ndarray
    """(nodes in level,) the level's nodes, in order."""
    first_arrival: np.ndarray
    """(nodes in level,) where each node's arrivals start in the arrays above."""


@dataclass
class ReplayGraph:
    """The compiled dependency graph of a run's replayable steps (module docstring)."""

    is_gap: np.ndarray
    """(entries,) compute gaps (the only entries whose durations count)."""
    node_instance: np.ndarray
    """(nodes,) the instance whose transfer time each node takes."""
    levels: list[Level]
    tail: Level
    """The arrivals at each (step, rank) block's end; its `nodes` are the blocks, in order."""
    steps: np.ndarray
    """(steps,) the steps, ascending..."""
    step_first_block: np.ndarray
    """...and where each one's blocks start."""
    irregular_steps: list[int]

    def step_times(
        self, durations: np.ndarray, transfer_s: np.ndarray, delays: np.ndarray | None = None
    ) -> np.ndarray:
        """(steps,) each step's replayed time with gap `durations` (entries,), per-instance
        `transfer_s` and calls' launch `delays` (entries,; none: 0); the values of
        `irregular_steps` are meaningless."""
        before = np.concatenate([[0.0], np.cumsum(np.where(self.is_gap, durations, 0.0))])
        delay = np.append(np.zeros(len(self.is_gap)) if delays is None else delays, 0.0)
        n_nodes = len(self.node_instance)
        end = np.zeros(n_nodes + 1)  # the last slot is every step's start
        node_transfer = np.append(transfer_s, 0.0)[self.node_instance]  # joins: the last
        for level in [*self.levels, self.tail]:
            arrivals = end[level.source] + before[level.gaps_to] - before[level.gaps_from]
            arrivals += delay[level.delay_at]
            latest = np.maximum.reduceat(arrivals, level.first_arrival)
            if level is self.tail:
                return np.maximum.reduceat(latest, self.step_first_block)
            end[level.nodes] = latest + node_transfer[level.nodes]
        raise AssertionError("unreachable")


def compile_graph(entries: pd.DataFrame, model: str = HOST_SERIAL) -> ReplayGraph:
    """The graph of `entries` (replay.Timeline.entries: step, rank, kind, instance, in order per
    (step, rank) block) under dependency `model` (module docstring)."""
    step = entries["step"].to_numpy()
    rank = entries["rank"].to_numpy()
    kind = entries["kind"].to_numpy()
    instance = entries["instance"].to_numpy()
    n = len(entries)
    new_block = np.ones(n, dtype=bool)
    new_block[1:] = (step[1:] != step[:-1]) | (rank[1:] != rank[:-1])
    block_start = np.flatnonzero(new_block)  # (blocks,)
    block_stop = np.append(block_start[1:], n)
    block_of = np.cumsum(new_block) - 1  # (entries,)
    calls = _Calls(np.flatnonzero(kind != COMPUTE), kind, instance, block_of, block_start)
    build = _rendezvous_arrivals if model == RENDEZVOUS else _host_serial_arrivals
    node_of_call, node_instance, arrivals, tail = build(calls, block_stop)
    n_nodes = len(node_instance)
    source, gaps_from, gaps_to, delay_at, node = arrivals
    level = _levels(source, node, n_nodes)
    broken = level[node_of_call] < 0
    if model == HOST_SERIAL:  # an instance of group and point-to-point calls has no order
        grouped = calls.kind == GROUP
        mixed = np.intersect1d(calls.instance[grouped], calls.instance[~grouped])
        broken |= np.isin(calls.instance, mixed)
    irregular = sorted({int(s) for s in step[calls.entry[broken]]})

    arrival_level = level[node]
    order = np.lexsort((node, arrival_level))
    order = order[arrival_level[order] >= 0]
    bounds = np.flatnonzero(np.diff(arrival_level[order])) + 1
    levels = [_level(source[part], gaps_from[part], gaps_to[part], delay_at[part], node[part])
              for part in np.split(order, bounds) if part.size]  # fmt: skip
    tail_source, tail_from, tail_to, tail_block = tail
    order = np.argsort(tail_block, kind="stable")
    tail_level = _level(tail_source[order], tail_from[order], tail_to[order],
                        np.full(len(order), -1), tail_block[order])  # fmt: skip
    step_of_block = step[block_start]
    step_first_block = np.flatnonzero(np.r_[True, step_of_block[1:] != step_of_block[:-1]])
    return ReplayGraph(
        is_gap=kind == COMPUTE,
        node_instance=node_instance,
        levels=levels,
        tail=tail_level,
        steps=step_of_block[step_first_block],
        step_first_block=step_first_block,
        irregular_steps=irregular,
    )


class _Calls:
    """The calls (non-gap entries) of a timeline, in order, with the blocks they sit in."""

    def __init__(self, entry, kind, instance, block_of, block_start) -> None:
        self.entry = entry  # (calls,) entry index of each call
        self.kind, self.instance = kind[entry], instance[entry]
        self.block, self.block_start = block_of[entry], block_start

    def previous_where(self, mask: np.ndarray) -> np.ndarray:
        """(calls,) the index of the last call before each one in its block with `mask`; -1."""
        marked = np.where(mask, np.arange(len(mask)), -1)
        last = np.maximum.accumulate(np.r_[-1, marked[:-1]])[: len(mask)]
        ok = (last >= 0) & (self.block[np.maximum(last, 0)] == self.block)
        return np.where(ok, last, -1)

    def last_where(self, mask: np.ndarray) -> np.ndarray:
        """(blocks,) the index of each block's last call with `mask`; -1 where none."""
        last = np.full(len(self.block_start), -1, dtype=np.int64)
        picked = np.flatnonzero(mask)
        last[self.block[picked]] = picked  # later calls overwrite earlier ones
        return last

    def gaps_start(self, previous: np.ndarray) -> np.ndarray:
        """(calls,) where the gaps after call `previous` (or the block's start, -1) begin."""
        after = self.entry[np.maximum(previous, 0)] + 1
        return np.where(previous >= 0, after, self.block_start[self.block])


def _host_serial_arrivals(calls: _Calls, block_stop: np.ndarray):
    """Nodes and arrivals of the host-serial model: every call after the previous one of its
    rank; a recv also after its senders' arrival at the send."""
    grouped = calls.kind == GROUP
    group_instances, group_node = np.unique(calls.instance[grouped], return_inverse=True)
    node_of_call = np.empty(len(calls.entry), dtype=np.int64)
    node_of_call[grouped] = group_node
    node_of_call[~grouped] = len(group_instances) + np.arange(int((~grouped).sum()))
    n_nodes = len(group_instances) + int((~grouped).sum())
    node_instance = np.empty(n_nodes, dtype=np.int64)
    node_instance[node_of_call] = calls.instance
    every = np.ones(len(calls.entry), dtype=bool)
    previous = calls.previous_where(every)
    source = np.where(previous >= 0, node_of_call[np.maximum(previous, 0)], n_nodes)
    gaps_from = calls.gaps_start(previous)
    send, recv = np.flatnonzero(calls.kind == SEND), np.flatnonzero(calls.kind == RECV)
    send = send[np.argsort(calls.instance[send], kind="stable")]
    lo = np.searchsorted(calls.instance[send], calls.instance[recv], "left")
    hi = np.searchsorted(calls.instance[send], calls.instance[recv], "right")
    matched, sender = np.repeat(recv, hi - lo), send[_ranges(lo, hi)]  # (matches,) each
    arrivals = (
        np.concatenate([source, source[sender]]),
        np.concatenate([gaps_from, gaps_from[sender]]),
        np.concatenate([calls.entry, calls.entry[sender]]),
        np.full(len(calls.entry) + len(sender), -1),
        np.concatenate([node_of_call, node_of_call[matched]]),
    )
    last = calls.last_where(every)
    tail = (
        np.where(last >= 0, node_of_call[np.maximum(last, 0)], n_nodes),
        np.where(last >= 0, calls.entry[np.maximum(last, 0)] + 1, calls.block_start),
        block_stop,
        np.arange(len(calls.block_start)),
    )
    return node_of_call, node_instance, arrivals, tail


def _rendezvous_arrivals(calls: _Calls, block_stop: np.ndarray):
    """Nodes and arrivals of the rendezvous model: every call is a member of its instance's
    node; each recv adds a join node on the compute stream (module docstring)."""
    instances, node_of_call = np.unique(calls.instance, return_inverse=True)
    recv = np.flatnonzero(calls.kind == RECV)
    n_inst = len(instances)
    n_nodes = n_inst + len(recv)  # n_nodes itself: the step's start
    node_instance = np.concatenate([instances, np.full(len(recv), -1)])  # joins: no transfer
    join_of_call = np.full(len(calls.entry), -1, dtype=np.int64)
    join_of_call[recv] = n_inst + np.arange(len(recv))
    p2p = (calls.kind == SEND) | (calls.kind == RECV)
    on_compute = (calls.kind == GROUP) | (calls.kind == RECV)  # a recv by its join
    compute_node = np.where(calls.kind == RECV, join_of_call, node_of_call)
    prev_cs = calls.previous_where(on_compute)
    cs_source = np.where(prev_cs >= 0, compute_node[np.maximum(prev_cs, 0)], n_nodes)
    cs_from = calls.gaps_start(prev_cs)
    prev_p2p = calls.previous_where(p2p)
    chained = np.flatnonzero(p2p & (prev_p2p >= 0))
    none = np.full(len(recv), -1)
    parts = [  # (source, gaps_from, gaps_to, delay_at, node)
        (cs_source, cs_from, calls.entry, calls.entry, node_of_call),  # after the compute
        (node_of_call[prev_p2p[chained]], calls.entry[chained], calls.entry[chained],
         calls.entry[chained], node_of_call[chained]),  # after the stream's previous call
        (cs_source[recv], cs_from[recv], calls.entry[recv], none, join_of_call[recv]),
        (node_of_call[recv], calls.entry[recv], calls.entry[recv], none, join_of_call[recv]),
    ]  # fmt: skip
    arrivals = tuple(np.concatenate(column) for column in zip(*parts, strict=True))
    last_cs, last_p2p = calls.last_where(on_compute), calls.last_where(p2p)
    with_p2p = np.flatnonzero(last_p2p >= 0)
    tail = (  # the compute chain's end, and the stream's last call
        np.concatenate([np.where(last_cs >= 0, compute_node[np.maximum(last_cs, 0)], n_nodes),
                        node_of_call[last_p2p[with_p2p]]]),
        np.concatenate([np.where(last_cs >= 0, calls.entry[np.maximum(last_cs, 0)] + 1,
                                 calls.block_start), block_stop[with_p2p]]),
        np.concatenate([block_stop, block_stop[with_p2p]]),
        np.concatenate([np.arange(len(calls.block_start)), with_p2p]),
    )  # fmt: skip
    return node_of_call, node_instance, arrivals, tail


def _level(source, gaps_from, gaps_to, delay_at, node) -> Level:
    """One level from its arrivals (sorted by node)."""
    first = np.flatnonzero(np.r_[True, node[1:] != node[:-1]])
    return Level(source=source, gaps_to=gaps_to, gaps_from=gaps_from, delay_at=delay_at,
                 nodes=node[first], first_arrival=first)  # fmt: skip


def _levels(source: np.ndarray, node: np.ndarray, n_nodes: int) -> np.ndarray:
    """(nodes,) each node's level (Kahn's order, a frontier at a time); -1 for nodes in a cycle
    or behind one. `source` == n_nodes: an arrival from the step's start."""
    real = source < n_nodes
    source, node = source[real], node[real]
    waiting_on = np.bincount(node, minlength=n_nodes)
    successors = node[np.argsort(source, kind="stable")]
    out_start = np.concatenate([[0], np.cumsum(np.bincount(source, minlength=n_nodes))])
    level = np.full(n_nodes, -1, dtype=np.int64)
    frontier, depth = np.flatnonzero(waiting_on == 0), 0
    while frontier.size:
        level[frontier] = depth
        reached = successors[_ranges(out_start[frontier], out_start[frontier + 1])]
        waiting_on -= np.bincount(reached, minlength=n_nodes)
        ready = np.sort(reached[waiting_on[reached] == 0])  # a node once per arrival
        frontier = ready[np.r_[True, ready[1:] != ready[:-1]]] if ready.size else ready
        depth += 1
    return level


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The concatenation of arange(lo[i], hi[i]) over i."""
    counts = hi - lo
    return np.arange(int(counts.sum())) + np.repeat(lo - (np.cumsum(counts) - counts), counts)
