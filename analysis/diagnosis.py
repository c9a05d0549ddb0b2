"""One run's diagnosis: stragglers (analysis/stragglers.py) and imbalances
(analysis/imbalances.py) over its rank-steps and their peers' references (analysis/peers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb
import pandas as pd

from ranktrace.analysis.contention import host_cores, set_aside_on_oversubscribed
from ranktrace.analysis.imbalances import Imbalance, explained, random_imbalance, stage_imbalances
from ranktrace.analysis.links import link_findings
from ranktrace.analysis.peers import job_step_times, load_breakdown, with_references
from ranktrace.analysis.replay_graph import RENDEZVOUS
from ranktrace.analysis.slow_nodes import slow_node_findings
from ranktrace.analysis.stragglers import (
    CPU_TIME,
    KERNEL_TIME,
    OP_TIME,
    PHASE_TIME,
    Straggler,
    rank_findings,
)


@dataclass
class Diagnosis:
    """Everything this module finds in one run."""

    stragglers: list[Straggler]
    imbalances: list[Imbalance]
    job_step_time_s: pd.Series
    """Per step, the job's step time (the slowest rank's)."""
    breakdown: pd.DataFrame
    """The run's step_breakdown rows with the peers' references (`<column>_ref`)."""
    notes: list[str] = field(default_factory=list)
    """What the method could not look at, e.g. a stage with no peers."""


def compute_measure(con: duckdb.DuckDBPyConnection, run_id: str, imported: dict | None) -> str:
    """What run `run_id`'s compute was measured as (analysis/stragglers.py CPU_TIME...):
    `imported`, its run.json's, says for a trace; a recorded job's ranks' devices otherwise."""
    if imported:
        gpu_profile = (
            imported.get("format") == "torch-profiler"
            and imported.get("replay_model") == RENDEZVOUS
        )  # a GPU timeline
        return KERNEL_TIME if gpu_profile else OP_TIME
    devices = con.execute("SELECT DISTINCT device FROM ranks WHERE run_id = ?",
                          [run_id]).fetchall()  # fmt: skip
    on_gpu = any(str(device).startswith("cuda") for (device,) in devices)
    return PHASE_TIME if on_gpu else CPU_TIME


def diagnose(con: duckdb.DuckDBPyConnection, run_id: str, micro_batches: int,
             measure: str = CPU_TIME) -> Diagnosis:  # fmt: skip
    """Stragglers and imbalances of run `run_id` (see the module docstring for the method);
    `measure`: what its compute was measured as (`compute_measure`)."""
    frame = load_breakdown(con, run_id)
    if frame.empty:
        return Diagnosis([], [], pd.Series(dtype=float), frame)
    frame = with_references(frame)
    job_step = job_step_times(frame)
    notes = [
        f"pipeline stage {stage} has one rank: no peers to compare it with"
        for stage, ranks in frame.groupby("pp")["rank"].nunique().items()
        if ranks == 1
    ]
    hosts = host_cores(con, run_id)
    rank_hosts = frame.groupby("rank")["host"].first().to_dict()
    stragglers, contention_notes = set_aside_on_oversubscribed(
        rank_findings(frame, job_step, measure), hosts, rank_hosts
    )
    notes += contention_notes
    slow_ranks = {finding.rank for finding in stragglers}
    nodes, node_notes = slow_node_findings(con, run_id, frame, job_step, rank_hosts)
    notes += node_notes
    on_nodes = {rank for finding in nodes for rank in finding.candidates}
    links = link_findings(con, run_id, frame, job_step, slow_ranks)
    stragglers += nodes + [f for f in links if not set(f.candidates) & on_nodes]
    stragglers.sort(key=lambda f: -f.cost_pct)
    unexplained = frame[~explained(frame, stragglers)]
    imbalances = stage_imbalances(unexplained, job_step, micro_batches)
    imbalances += random_imbalance(unexplained, job_step)
    return Diagnosis(stragglers, imbalances, job_step, frame, notes)
