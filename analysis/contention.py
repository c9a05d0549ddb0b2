"""Oversubscribed hosts: more ranks than cores. Their ranks take turns on the cores, and which
rank waits when is the scheduler's choice: waiting for a core there (a `host` finding caused by
`contention`) is the machine's, noted rather than reported as one rank's straggling. On a host
with a core per rank, contention that singles out one rank (another process busy on its core)
stays a `host` straggler.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pandas as pd

from ranktrace.analysis.whatif import compute_labels


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


def set_aside_random_on_oversubscribed(
    imbalances: list, hosts: dict[str, HostCores], rank_hosts: dict[int, str],
    jobs_own: bool = False,
) -> tuple[list, list[str]]:  # fmt: skip
    """(the imbalances kept, notes): a random imbalance whose ranks all run on oversubscribed
    hosts becomes a note, unless `jobs_own`: its compute follows the job's own data (varying
    sequence lengths, analysis/spread.py). There the ranks take turns on the cores (and so do
    their communication threads, which a rank then waits for), so the same work takes a
    different time rank by rank and step by step: spread that is the host's scheduling, which
    the step times alone cannot tell apart from the job's."""
    kept, notes = [], []
    for imbalance in imbalances:
        crowded = [hosts.get(rank_hosts.get(rank, "")) for rank in imbalance.ranks]
        if imbalance.kind == "random" and not jobs_own and crowded and all(
                h and h.oversubscribed for h in crowded):  # fmt: skip
            names = sorted({h.host or "(unnamed)" for h in crowded})
            notes.append(
                f"spread over ranks {', '.join(map(str, imbalance.ranks))} costs "
                f"{imbalance.cost_pct:.1f}% of the run: scheduling on oversubscribed host "
                f"{', '.join(names)}, not reported as a random imbalance of the job"
            )
        else:
            kept.append(imbalance)
    return kept, notes


def dedicated_core_durations(con: duckdb.DuckDBPyConnection, run_id: str, entries: pd.DataFrame,
                             durations: np.ndarray) -> np.ndarray:  # fmt: skip
    """The replay's gap `durations` had every rank of an oversubscribed host a core of its own:
    each gap of a CPU rank there less the time its thread waited for a core in it, where the
    rank recorded that gap by gap (`collectives.core_wait_start_ns` / `core_wait_end_ns`);
    elsewhere each compute gap scaled by its rank-step's share of compute time not spent
    waiting for a core (`1 - work_core_wait_s / work_s`; where the wait was not counted, the
    main thread's CPU time over wall time), data and host gaps (loading, pauses) kept.

    On such a host a rank that sleeps (a pause, a slow device simulated by sleeping) hands its
    core to the others, whose recorded compute then runs faster: the recorded durations hide
    what the sleep would cost on dedicated hardware, where nobody gains from it; and ranks
    taking turns on the cores make the same compute take a different time rank by rank, step
    by step, which is the host's scheduling, not the job's imbalance. Findings are priced on
    these durations (analysis/slowdown.py); `durations` is returned unchanged on hosts with a
    core per rank, on GPU ranks and where CPU times were not recorded."""
    hosts = host_cores(con, run_id)
    crowded = [h.host for h in hosts.values() if h.oversubscribed]
    if not crowded:
        return durations
    share = con.execute(
        "SELECT b.rank, b.step, greatest(0.0, least(1.0, coalesce(1 - b.work_core_wait_s / "
        "b.work_s, b.work_cpu_s / b.work_s))) AS on_core "
        "FROM step_breakdown b JOIN ranks r USING (run_id, rank) "
        "WHERE b.run_id = ? AND r.device LIKE 'cpu%' AND coalesce(b.host, '') IN "
        "(SELECT unnest(?)) AND b.work_s > 0",
        [run_id, crowded],
    ).df()
    if share.empty:
        return durations
    keys = pd.MultiIndex.from_frame(entries[["rank", "step"]])
    on_core = share.set_index(["rank", "step"])["on_core"].reindex(keys).to_numpy()
    crowded_gap = (entries["instance"].to_numpy() < 0) & ~np.isnan(on_core)
    gap_wait = entries.get("core_wait_s", pd.Series(np.nan, index=entries.index)).to_numpy()
    measured = crowded_gap & ~np.isnan(gap_wait)
    scaled = crowded_gap & ~measured & compute_labels(entries)
    dedicated = np.where(measured, durations - np.clip(np.nan_to_num(gap_wait), 0.0, durations),
                         durations)  # fmt: skip
    return np.where(scaled, durations * np.nan_to_num(on_core), dedicated)
