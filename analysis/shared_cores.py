"""The replay on hosts whose ranks share cores: every compute gap is work (seconds on a core)
that the ranks of its host run on its cores, shared evenly among the gaps running at the time
(processor sharing: each progresses at min(1, cores / gaps running)); calls keep their
host-serial semantics (analysis/replay.py): a send never waits, a recv ends one transfer after
both ends were issued, a group one transfer after its last member arrived, and transfers take
their recorded time without a core.

What it is for: a change that moves work between ranks (layers between pipeline stages,
sequence lengths between dp ranks) changes how long they compete for the cores, which the
recorded durations hold fixed. Four ranks on 2 cores, one of them with 394 of a step's 962
tokens: run in turn the heaviest rank finishes last at 1.15x the balanced step's time.

Each step is simulated event by event in virtual time (the work done per running gap since the
step began): a gap started at virtual time v with work w ends at v + w, so a heap orders the
ends and only the rate (how many gaps run) changes between events.
"""

from __future__ import annotations

import heapq

import numpy as np
import pandas as pd

from ranktrace.analysis.contention import host_cores
from ranktrace.analysis.replay_graph import COMPUTE, RECV, SEND


def shared_replay(timeline, work: np.ndarray, transfer_s: np.ndarray, host_of: dict[int, str],
                  cores: dict[str, float]) -> pd.Series:  # fmt: skip
    """Per step: the replayed time with gap `work` (seconds on a core, aligned with
    timeline.entries) and transfers `transfer_s` (per instance); `host_of`: each rank's host,
    `cores`: the cores of the hosts whose ranks share them (a rank on another host has a core
    of its own)."""
    entries = timeline.entries
    step_of = entries["step"].to_numpy()
    kinds, instances = entries["kind"].to_numpy(), entries["instance"].to_numpy()
    ranks = entries["rank"].to_numpy()
    steps, starts = np.unique(step_of, return_index=True)  # entries are in step order
    ends = [*starts[1:], len(step_of)]
    times = {}
    for step, start, end in zip(steps, starts, ends, strict=True):
        part = slice(start, end)
        times[int(step)] = _step(kinds[part], instances[part], ranks[part], work[part],
                                 transfer_s, timeline.size, host_of, cores)  # fmt: skip
    return pd.Series(times, dtype=float)


class _Host:
    """One host's cores in virtual time: `virtual` advances by rate × real time."""

    def __init__(self, cores: float) -> None:
        self.cores, self.running, self.virtual = cores, 0, 0.0

    @property
    def rate(self) -> float:
        return min(1.0, self.cores / self.running) if self.running else 1.0


def _step(kinds, instances, ranks, work, transfer_s, size, host_of: dict[int, str],
          cores: dict[str, float]) -> float:  # fmt: skip
    """One step's replay (module docstring); entries grouped by rank, in time order."""
    bounds = np.flatnonzero(np.diff(ranks)) + 1
    first = np.concatenate([[0], bounds]).tolist()
    last = np.concatenate([bounds, [len(ranks)]]).tolist()
    rank_of = [int(ranks[i]) for i in first]
    shared = {host: _Host(n) for host, n in cores.items()}
    hosts = {r: shared[host_of[r]] if host_of.get(r) in shared else _Host(1.0) for r in rank_of}
    kinds, instances, work = kinds.tolist(), instances.tolist(), work.tolist()
    pointer = list(first)
    now = 0.0
    ends: list = []  # (real end, order, rank) of transfers; gaps: per host heaps below
    distinct = list({id(h): h for h in hosts.values()}.values())
    gap_ends: dict[int, list] = {id(h): [] for h in distinct}
    done_at = [None] * len(first)
    sent: dict[int, float] = {}
    waiting_recv: dict[int, int] = {}
    arrived: dict[int, list] = {}
    order = 0

    def host_of(who: int) -> _Host:
        return hosts[rank_of[who]]

    def busy_until(who: int, end: float) -> None:
        nonlocal order
        heapq.heappush(ends, (end, order, who))
        order += 1

    def advance(who: int) -> None:
        """Run `who`'s entries from its pointer until it computes, waits or transfers."""
        nonlocal order
        while pointer[who] < last[who]:
            i = pointer[who]
            kind, inst = kinds[i], instances[i]
            if kind == COMPUTE:
                pointer[who] += 1
                if work[i] > 0:
                    host = host_of(who)
                    heapq.heappush(gap_ends[id(host)], (host.virtual + work[i], order, who))
                    order += 1
                    host.running += 1
                    return
                continue
            if kind == SEND:
                sent[inst] = now
                pointer[who] += 1
                receiver = waiting_recv.pop(inst, None)
                if receiver is not None:
                    pointer[receiver] += 1
                    busy_until(receiver, now + transfer_s[inst])
                busy_until(who, now + transfer_s[inst])
                return
            if kind == RECV:
                if inst not in sent:
                    waiting_recv[inst] = who
                    return
                pointer[who] += 1
                busy_until(who, max(now, sent[inst]) + transfer_s[inst])
                return
            members = arrived.setdefault(inst, [])
            members.append(who)
            if len(members) < size[inst]:
                return
            del arrived[inst]
            for member in members:
                pointer[member] += 1
                busy_until(member, now + transfer_s[inst])
            return
        done_at[who] = now

    for who in range(len(first)):
        advance(who)
    while True:
        # the next event: a transfer's end, or the first gap to finish on any host
        candidates = []
        if ends:
            candidates.append((ends[0][0], "transfer", None))
        for host in distinct:
            heap = gap_ends[id(host)]
            if heap:
                candidates.append((now + (heap[0][0] - host.virtual) / host.rate, "gap", host))
        if not candidates:
            break
        when, what, host = min(candidates, key=lambda c: c[0])
        for other in distinct:  # every host's running gaps progress until then
            other.virtual += (when - now) * other.rate
        now = when
        if what == "transfer":
            _, _, who = heapq.heappop(ends)
        else:
            _, _, who = heapq.heappop(gap_ends[id(host)])
            host.running -= 1
        advance(who)
    stuck = [who for who, at in enumerate(done_at) if at is None]
    return max(now, *(at for at in done_at if at is not None)) if not stuck else now


def sharing_of(con, run_id: str) -> tuple[dict[int, str], dict[str, float]]:
    """(each CPU rank's host, the cores of the hosts with more ranks than cores) of a run, for
    `shared_replay`; ({}, {}) where no host is oversubscribed."""
    hosts = {h.host: float(h.cores) for h in host_cores(con, run_id).values() if h.oversubscribed}
    if not hosts:
        return {}, {}
    rows = con.execute(
        "SELECT rank, coalesce(host, '') FROM ranks WHERE run_id = ? AND device LIKE 'cpu%'",
        [run_id],
    ).fetchall()
    return {int(rank): host for rank, host in rows if host in hosts}, hosts
