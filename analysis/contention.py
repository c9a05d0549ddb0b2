"""Oversubscribed hosts: more ranks than cores. Their ranks take turns on the cores, and which
rank waits when is the scheduler's choice: waiting for a core there (a `host` finding caused by
`contention`) is the machine's, noted rather than reported as one rank's straggling. On a host
with a core per rank, contention that singles out one rank (another process busy on its core)
stays a `host` straggler.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb


@dataclass(frozen=True)
class HostCores:
    """One host of a run: its ranks and the cores they may run on (the union of their
    affinities)."""

    host: str
    ranks: int
    cores: int

    @property
    def oversubscribed(self) -> bool:
        return self.ranks > self.cores


def host_cores(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, HostCores]:
    """Per host of the run, where its ranks recorded their CPU affinity."""
    rows = con.execute(
        "SELECT host, rank, cpu_affinity FROM ranks WHERE run_id = ? AND cpu_affinity IS NOT NULL",
        [run_id],
    ).fetchall()
    by_host: dict[str, tuple[set[int], set[int]]] = {}
    for host, rank, affinity in rows:
        ranks, cores = by_host.setdefault(host or "", (set(), set()))
        ranks.add(rank)
        cores.update(int(core) for core in affinity.split(",") if core)
    return {
        host: HostCores(host, len(ranks), len(cores)) for host, (ranks, cores) in by_host.items()
    }


def set_aside_on_oversubscribed(
    stragglers: list, hosts: dict[str, HostCores], rank_hosts: dict[int, str]
) -> tuple[list, list[str]]:
    """(the findings kept, notes): contention findings of ranks on an oversubscribed host become
    notes, and each oversubscribed host is named."""
    notes = [
        f"host {h.host or '(unnamed)'} runs {h.ranks} ranks on {h.cores} cores (oversubscribed): "
        "ranks take turns on the cores, and waiting for a core there is noted, not reported as "
        "a straggler"
        for h in hosts.values()
        if h.oversubscribed
    ]
    kept = []
    for finding in stragglers:
        host = hosts.get(rank_hosts.get(finding.rank, ""))
        if finding.cause == "contention" and host is not None and host.oversubscribed:
            notes.append(
                f"rank {finding.rank} waited for a core {finding.slowdown:.2f}x its peers' from "
                f"step {finding.first_step} ({finding.cost_pct:.1f}% of the run): scheduling on "
                f"oversubscribed host {host.host or '(unnamed)'}"
            )
        else:
            kept.append(finding)
    return kept, notes
