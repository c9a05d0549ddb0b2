"""The diagnosis of some steps of one run, all of them or one analysis window's (analysis/run.py
assembles the report from it; analysis/window_report.py diagnoses a long run's windows and
analysis/window_merge.py merges them): its findings, per-step series and replay.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import duckdb
import pandas as pd

from ranktrace.analysis import efficiency, slowdown, spread, stragglers
from ranktrace.analysis.contention import host_cores, set_aside_random_on_oversubscribed
from ranktrace.analysis.diagnosis import compute_measure, diagnose
from ranktrace.analysis.imbalances import Imbalance
from ranktrace.analysis.remedies import RunShape
from ranktrace.analysis.replay_graph import HOST_SERIAL
from ranktrace.analysis.stragglers import Straggler


@dataclass
class Part:
    """What the diagnosis of some steps of a run found (all of them, or one window's)."""

    stragglers: list[Straggler]
    imbalances: list[Imbalance]
    notes: list[str]
    job_step: pd.Series
    """Per step, the job's step time (s)."""
    per_step: pd.DataFrame
    """analysis/efficiency.py `per_step_efficiency`."""
    replayed: dict
    """`slowdown`, `slowdown_detail`, `slowdown_by`, `slowdown_by_cause` (and, where S - 1 was
    shared out, `slowdown_remainder`) as analysis/run.py reports them."""


def diagnosed_part(con: duckdb.DuckDBPyConnection, row: dict,
                   max_calls: int | None = None) -> Part:  # fmt: skip
    """The findings, per-step series and replay of the steps `con` shows of one run (the
    replay of at most `max_calls` calls: analysis/replay_timeline.py)."""
    run_id = row["run_id"]
    measure = compute_measure(con, run_id, row["record"].get("imported"))
    diagnosis = diagnose(con, run_id, int(row["micro_batches"] or 1), measure)
    frame, job_step = diagnosis.breakdown, diagnosis.job_step_time_s
    per_step = efficiency.per_step_efficiency(frame, job_step)
    forwards = spread.forward_spans(con, run_id)
    varying, _ = spread.follows_tokens(forwards)  # the spread over ranks is the job's own
    if varying:
        _set_aside_long_sequences(diagnosis, forwards)
    replayed = _slowdown(con, row, diagnosis, varying, forwards, max_calls)  # may add one
    if not frame.empty:
        _judge_spread(con, run_id, diagnosis, replayed["slowdown_by_cause"], forwards, varying)
    return Part(diagnosis.stragglers, diagnosis.imbalances, diagnosis.notes, job_step,
                per_step, replayed)  # fmt: skip


def _set_aside_long_sequences(diagnosis, forwards: pd.DataFrame) -> None:
    """Compute stragglers whose slowness their tokens explain (analysis/spread.py:
    `per_token_slowdown` under MIN_SLOWDOWN): a note each, not a finding; the spread they are
    part of is the random imbalance's."""
    kept = []
    for finding in diagnosis.stragglers:
        compute = finding.kind == "compute"
        adjusted = spread.per_token_slowdown(forwards, finding) if compute else None
        if adjusted is None or adjusted >= stragglers.MIN_SLOWDOWN:
            kept.append(finding)
            continue
        diagnosis.notes.append(
            f"rank {finding.rank}'s compute was {finding.slowdown:.2f}x its peers' over steps "
            f"{finding.first_step}-{finding.last_step}, but {adjusted:.2f}x for its tokens: "
            "its micro-batches were longer (varying sequence lengths), not a slow rank"
        )
    diagnosis.stragglers[:] = kept


def _judge_spread(con: duckdb.DuckDBPyConnection, run_id: str, diagnosis, causes: list[dict],
                  forwards: pd.DataFrame, varying: bool) -> None:  # fmt: skip
    """A random imbalance's evidence and name (analysis/spread.py); on an oversubscribed host
    it is a note, the host's scheduling, unless `varying`: its compute follows its
    micro-batches' tokens (the job's own data)."""
    frame = diagnosis.breakdown
    if any(i.kind == "random" for i in diagnosis.imbalances):
        lines = spread.evidence(frame, forwards)
        diagnosis.imbalances[:] = [
            dataclasses.replace(i, evidence=lines) if i.kind == "random" else i
            for i in diagnosis.imbalances
        ]
    rank_hosts = frame.groupby("rank")["host"].first().to_dict()
    diagnosis.imbalances[:], notes = set_aside_random_on_oversubscribed(
        diagnosis.imbalances, host_cores(con, run_id), rank_hosts, jobs_own=varying
    )
    diagnosis.notes += notes
    if varying:
        name = "varying sequence lengths (random imbalance)"
    elif any(i.kind == "random" for i in diagnosis.imbalances):
        name = "spread: the slowest rank changes from step to step (random imbalance)"
    else:
        name = "spread over ranks (host scheduling)"
    for cause in causes:
        if cause["kind"] == "random":
            cause["cause"] = name


def replay_model(row: dict) -> str:
    """The dependency model a run's data shows (analysis/replay_graph.py): what its importer
    recorded (GPU traces: rendezvous), else host-serial (this trainer's CPU ranks)."""
    imported = row["record"].get("imported") or {}
    return imported.get("replay_model", HOST_SERIAL)


def _slowdown(con: duckdb.DuckDBPyConnection, row: dict, diagnosis, varying: bool,
              forwards: pd.DataFrame, max_calls: int | None) -> dict:  # fmt: skip
    """`slowdown`, `slowdown_detail` and `slowdown_by_cause` (analysis/replay.py); None and
    empty when the run recorded no collectives. `varying`: the micro-batches' compute follows
    their tokens (analysis/spread.py, `forwards`)."""
    result = slowdown.slowdown(con, row["run_id"], diagnosis.stragglers, diagnosis.imbalances,
                               replay_model(row), varying, RunShape.of(row["record"]),
                               forwards, max_calls)  # fmt: skip
    if result is None:
        return {"slowdown": None, "slowdown_detail": None, "slowdown_by": None,
                "slowdown_by_cause": []}  # fmt: skip
    diagnosis.notes += result.pop("notes")
    diagnosis.stragglers[:] = result.pop("stragglers")  # those the replay confirms
    diagnosis.imbalances[:] = result.pop("imbalances")
    spread = result.pop("spread_imbalance")
    if spread is not None:  # found by the replay, where rank-step own times cannot see it
        diagnosis.imbalances.append(spread)
    return result
