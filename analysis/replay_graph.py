"""The what-if replay as a dependency graph, evaluated for every step at once, one level of the
graph at a time in numpy (analysis/replay.py says what the replay models; this is its fast path:
a 100k-call trace replays in milliseconds instead of a tenth of a second per pass in Python).

Nodes: one per group instance (its members leave together) and one per send and per recv call.
A node ends at its latest arrival plus its transfer time. An arrival is the end of the previous
node on the same rank in the step (0 at the step's start) plus the compute gaps in between: the
rank's own arrival at its call and, for a recv, also the sender's arrival at the matching send
(a send itself never waits). A node's level is one more than the highest level among its
arrivals' sources, so a whole level is evaluated in one go.

Steps whose calls wait on each other in a cycle (ranks issued them in conflicting orders) or
that mix group and point-to-point calls in one instance have no such order: `irregular_steps`,
which replay.py hands to its event replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

COMPUTE, SEND, RECV, GROUP = 0, 1, 2, 3


@dataclass
class Level:
    """The arrivals into one level's nodes, sorted by node."""

    source: np.ndarray
    """(arrivals,) the node whose end the arrival starts from; n_nodes: the step's start (0)."""
    gaps_to: np.ndarray
    """(arrivals,) the call arrived at (entry index): gaps [gaps_from, gaps_to) come first."""
    gaps_from: np.ndarray
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
    tail_node: np.ndarray
    """(step-rank blocks,) each block's last node (n_nodes if it has none)..."""
    tail_from: np.ndarray
    """...and the gaps after it, [tail_from, tail_to) in entry indices."""
    tail_to: np.ndarray
    steps: np.ndarray
    """(steps,) the steps, ascending..."""
    step_first_block: np.ndarray
    """...and where each one's blocks start."""
    irregular_steps: list[int]

    def step_times(self, durations: np.ndarray, transfer_s: np.ndarray) -> np.ndarray:
        """(steps,) each step's replayed time with gap `durations` (entries,) and per-instance
        `transfer_s`; the values of `irregular_steps` are meaningless."""
        before = np.concatenate([[0.0], np.cumsum(np.where(self.is_gap, durations, 0.0))])
        n_nodes = len(self.node_instance)
        end = np.zeros(n_nodes + 1)  # the last slot is every step's start
        node_transfer = transfer_s[self.node_instance]
        for level in self.levels:
            arrivals = end[level.source] + before[level.gaps_to] - before[level.gaps_from]
            latest = np.maximum.reduceat(arrivals, level.first_arrival)
            end[level.nodes] = latest + node_transfer[level.nodes]
        rank_end = end[self.tail_node] + before[self.tail_to] - before[self.tail_from]
        return np.maximum.reduceat(rank_end, self.step_first_block)


def compile_graph(entries: pd.DataFrame) -> ReplayGraph:
    """The graph of `entries` (replay.Timeline.entries: step, rank, kind, instance, in order per
    (step, rank) block)."""
    step = entries["step"].to_numpy()
    rank = entries["rank"].to_numpy()
    kind = entries["kind"].to_numpy()
    instance = entries["instance"].to_numpy()
    n = len(entries)
    new_block = np.ones(n, dtype=bool)
    new_block[1:] = (step[1:] != step[:-1]) | (rank[1:] != rank[:-1])
    block_start = np.flatnonzero(new_block)  # (blocks,)
    block_of = np.cumsum(new_block) - 1  # (entries,)

    calls = np.flatnonzero(kind != COMPUTE)  # (calls,) entry indices
    call_kind, call_instance = kind[calls], instance[calls]
    grouped = call_kind == GROUP
    group_instances, group_node = np.unique(call_instance[grouped], return_inverse=True)
    node_of_call = np.empty(len(calls), dtype=np.int64)
    node_of_call[grouped] = group_node
    node_of_call[~grouped] = len(group_instances) + np.arange(int((~grouped).sum()))
    n_nodes = len(group_instances) + int((~grouped).sum())
    node_instance = np.empty(n_nodes, dtype=np.int64)
    node_instance[node_of_call] = call_instance

    source, gaps_to, gaps_from, node = _arrivals(
        calls, call_kind, call_instance, node_of_call, n_nodes, block_of, block_start
    )
    level = _levels(source, node, n_nodes)
    mixed = np.intersect1d(group_instances, call_instance[~grouped])
    broken = (level[node_of_call] < 0) | np.isin(call_instance, mixed)
    irregular = sorted({int(s) for s in step[calls[broken]]})

    arrival_level = level[node]
    order = np.lexsort((node, arrival_level))
    order = order[arrival_level[order] >= 0]
    bounds = np.flatnonzero(np.diff(arrival_level[order])) + 1
    levels = [_level(source[part], gaps_to[part], gaps_from[part], node[part])
              for part in np.split(order, bounds) if part.size]  # fmt: skip

    last_call = _last_call_per_block(block_of, calls, len(block_start))
    has_call = last_call >= 0
    block_stop = np.append(block_start[1:], n)
    step_of_block = step[block_start]
    step_first_block = np.flatnonzero(np.r_[True, step_of_block[1:] != step_of_block[:-1]])
    return ReplayGraph(
        is_gap=kind == COMPUTE,
        node_instance=node_instance,
        levels=levels,
        tail_node=np.where(has_call, node_of_call[np.maximum(last_call, 0)], n_nodes),
        tail_from=np.where(has_call, calls[np.maximum(last_call, 0)] + 1, block_start),
        tail_to=block_stop,
        steps=step_of_block[step_first_block],
        step_first_block=step_first_block,
        irregular_steps=irregular,
    )


def _arrivals(calls, call_kind, call_instance, node_of_call, n_nodes, block_of, block_start):
    """(source, gaps_to, gaps_from, node), (arrivals,) each: every call's arrival from the
    previous call of its (step, rank) block, or from the block's start (source n_nodes), and
    each recv's arrival of its sender at the matching send (of every send of its instance)."""
    first_in_block = np.ones(len(calls), dtype=bool)
    first_in_block[1:] = block_of[calls[1:]] != block_of[calls[:-1]]
    previous_node = np.where(first_in_block, n_nodes, np.roll(node_of_call, 1))
    gaps_from = np.where(first_in_block, block_start[block_of[calls]], np.roll(calls, 1) + 1)
    send, recv = np.flatnonzero(call_kind == SEND), np.flatnonzero(call_kind == RECV)
    send = send[np.argsort(call_instance[send], kind="stable")]
    lo = np.searchsorted(call_instance[send], call_instance[recv], "left")
    hi = np.searchsorted(call_instance[send], call_instance[recv], "right")
    matched, sender = np.repeat(recv, hi - lo), send[_ranges(lo, hi)]  # (matches,) each
    return (
        np.concatenate([previous_node, previous_node[sender]]),
        np.concatenate([calls, calls[sender]]),
        np.concatenate([gaps_from, gaps_from[sender]]),
        np.concatenate([node_of_call, node_of_call[matched]]),
    )


def _level(source, gaps_to, gaps_from, node) -> Level:
    """One level from its arrivals (sorted by node)."""
    first = np.flatnonzero(np.r_[True, node[1:] != node[:-1]])
    return Level(source=source, gaps_to=gaps_to, gaps_from=gaps_from, nodes=node[first],
                 first_arrival=first)  # fmt: skip


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


def _last_call_per_block(block_of: np.ndarray, calls: np.ndarray, n_blocks: int) -> np.ndarray:
    """(blocks,) the index into `calls` of each block's last call; -1 where it has none."""
    call_block = block_of[calls]
    is_last = np.r_[call_block[1:] != call_block[:-1], True][: len(calls)]
    last = np.full(n_blocks, -1, dtype=np.int64)
    last[call_block[is_last]] = np.flatnonzero(is_last)
    return last


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The concatenation of arange(lo[i], hi[i]) over i."""
    counts = hi - lo
    return np.arange(int(counts.sum())) + np.repeat(lo - (np.cumsum(counts) - counts), counts)
