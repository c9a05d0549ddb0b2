"""`ranktrace import`: a trace read by an importer becomes a run in the store, reported like a
trained one, or nothing at all (every failure removes what was written)."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ranktrace.analysis.ingest import ingest, remove_run
from ranktrace.analysis.run import cached_report
from ranktrace.analysis.store import open_reader
from ranktrace.importers.writer import run_record, write_run
from ranktrace.telemetry.run_record import new_run_id


@dataclass
class Imported:
    """What one import did."""

    run_id: str
    report: dict
    ops: int
    workers: int
    seconds: float
    """Wall time from the parsed trace to the finished report (writing, ingest, analysis)."""


def import_ops(
    runs_dir: Path, ops: pd.DataFrame, workers: pd.DataFrame, name: str, layout: dict,
    source: dict, extra: dict | None = None,
) -> Imported:  # fmt: skip
    """Write, ingest and report one imported run; on any failure remove it and raise.
    `extra`: more keys of its run.json (what the trace tells beyond the ops, e.g. `gpu_time`)."""
    started = time.perf_counter()
    runs_dir = Path(runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    run_id = new_run_id()
    record = {**run_record(run_id, name or run_id, ops, workers, layout, source), **(extra or {})}
    run_dir = None
    try:
        run_dir = write_run(runs_dir, run_id, record, ops, workers)
        ingest(runs_dir, [run_id])
        con = open_reader(runs_dir)
        try:
            result = cached_report(con, run_id)  # the one ingest computed and stored
        finally:
            con.close()
    except BaseException:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
            remove_run(runs_dir, run_id)
        raise
    return Imported(run_id, result, len(ops), len(workers), time.perf_counter() - started)
