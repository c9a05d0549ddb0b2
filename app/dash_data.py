"""How dashboard pages reach the data: the runs directory of the running app, a read-only
connection per request (the store for finished runs, the segments for a run still training),
and run reports cached per ingest."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import flask

from ranktrace.analysis.run import cached_report, report
from ranktrace.analysis.store import open_live, open_reader, store_path
from ranktrace.app import dash_ingest

RUNS_DIR_KEY = "RANKTRACE_RUNS_DIR"
INGEST_GRACE_S = 60.0
"""A finished run's pages keep refreshing this long, until the store holds it."""
_REPORTS: dict[tuple[str, str, float], dict] = {}
"""(runs dir, run id, ingested_at) -> report: a stored run's report changes only on ingest."""


def runs_dir() -> Path:
    """The runs directory of the app serving this request."""
    return Path(flask.current_app.config[RUNS_DIR_KEY])


def has_store() -> bool:
    return store_path(runs_dir()).exists()


def run_record(run_id: str) -> dict | None:
    """A run's run.json, or None when there is no such run directory."""
    path = runs_dir() / run_id / "run.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def unstored_runs() -> dict[str, dict]:
    """Run id -> run.json of the runs the store does not hold: those still training, and those
    finished but not (yet) ingested; their pages read their segments."""
    directory = runs_dir()
    if not directory.is_dir():
        return {}
    stored = stored_run_ids()
    runs = {}
    for path in sorted(directory.glob("*/run.json")):
        if path.parent.name in stored:
            continue
        try:
            runs[path.parent.name] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being rewritten right now; the next refresh sees it
    return runs


def is_changing(record: dict | None) -> bool:
    """Whether a run's data may still change: it trains, or it finished less than
    INGEST_GRACE_S ago (the store is about to hold it). Pages refresh while it is."""
    if not record:
        return False
    if record.get("status") == "running":
        return True
    return time.time() - float(record.get("finished_at") or 0.0) < INGEST_GRACE_S


@contextmanager
def store() -> Iterator[duckdb.DuckDBPyConnection]:
    """A sandboxed read-only connection to the store, closed after the block."""
    con = open_reader(runs_dir())
    try:
        yield con
    finally:
        con.close()


def stored_run_ids() -> set[str]:
    """The ids of the runs the store holds."""
    return dash_ingest.stored_run_ids(runs_dir())


def reads_segments(run_id: str) -> bool:
    """Whether the run's data comes from its segments: while it trains, and after it finished
    until it is ingested (so a page never goes blank between the two)."""
    record = run_record(run_id)
    if record is None:
        return False
    return record.get("status") == "running" or run_id not in stored_run_ids()


def refreshes(run_id: str) -> bool:
    """Whether a run's pages re-read it on an interval: while it may still change and its data
    comes from its segments."""
    return is_changing(run_record(run_id)) and reads_segments(run_id)


@contextmanager
def run_connection(run_id: str) -> Iterator[duckdb.DuckDBPyConnection]:
    """The run's data: its segments while it trains or awaits ingest, else the store."""
    con = open_live(runs_dir(), run_id) if reads_segments(run_id) else open_reader(runs_dir())
    try:
        yield con
    finally:
        con.close()


def run_report(run_id: str) -> dict:
    """A run's report: computed from its segments while it trains (or awaits ingest); for a
    stored run, the one ingest stored (or computed once per ingest and kept here)."""
    record = run_record(run_id)
    if has_store() and not (record and record.get("status") == "running"):
        with store() as con:
            row = con.execute("SELECT ingested_at FROM runs WHERE run_id = ?", [run_id]).fetchone()
            if row is not None:
                key = (str(runs_dir()), run_id, row[0])
                if key not in _REPORTS:
                    _REPORTS[key] = cached_report(con, run_id)
                return _REPORTS[key]
    con = open_live(runs_dir(), run_id)  # StoreError when there is no such run at all
    try:
        return report(con, run_id)
    finally:
        con.close()
