"""How dashboard pages reach the data: the runs directory of the running app, a read-only
connection per request (the store for finished runs, the segments for a run still training),
and run reports cached per ingest."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import flask

from analysis.run import cached_report, report
from analysis.store import StoreError, open_live, open_reader, store_path

RUNS_DIR_KEY = "RANKTRACE_RUNS_DIR"
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


def running_run_ids() -> list[str]:
    """Runs whose run.json says they are still training (read live from their segments)."""
    directory = runs_dir()
    if not directory.is_dir():
        return []
    ids = []
    for path in sorted(directory.glob("*/run.json")):
        try:
            if json.loads(path.read_text()).get("status") == "running":
                ids.append(path.parent.name)
        except (OSError, ValueError):
            continue  # being rewritten right now; the next refresh sees it
    return ids


def is_live(run_id: str) -> bool:
    record = run_record(run_id)
    return bool(record) and record.get("status") == "running"


@contextmanager
def store() -> Iterator[duckdb.DuckDBPyConnection]:
    """A sandboxed read-only connection to the store, closed after the block."""
    con = open_reader(runs_dir())
    try:
        yield con
    finally:
        con.close()


@contextmanager
def run_connection(run_id: str) -> Iterator[duckdb.DuckDBPyConnection]:
    """The run's data: its live segments while it trains, else the store."""
    con = open_live(runs_dir(), run_id) if is_live(run_id) else open_reader(runs_dir())
    try:
        yield con
    finally:
        con.close()


def run_report(run_id: str) -> dict:
    """A run's report: computed from its segments while it trains; for a stored run, the one
    ingest stored (or computed once per ingest and kept here)."""
    if is_live(run_id):
        with run_connection(run_id) as con:
            return report(con, run_id)
    with store() as con:
        row = con.execute("SELECT ingested_at FROM runs WHERE run_id = ?", [run_id]).fetchone()
        if row is None:
            raise StoreError(f"no run {run_id} in the store")
        key = (str(runs_dir()), run_id, row[0])
        if key not in _REPORTS:
            _REPORTS[key] = cached_report(con, run_id)
        return _REPORTS[key]
