"""How dashboard pages reach the data: the runs directory of the running app, a read-only
connection per request (the store for the runs it holds, a training run's completed windows
included; the segments of a run it does not hold yet), and run reports cached per ingest."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import flask

from ranktrace.analysis.run import cached_report, report
from ranktrace.analysis.store import open_live, open_reader, store_path
from ranktrace.app import dash_ingest
from ranktrace.telemetry.run_record import run_records as run_records_in

RUNS_DIR_KEY = "RANKTRACE_RUNS_DIR"
REFRESH_S_KEY = "RANKTRACE_REFRESH_S"
INGEST_GRACE_S = 60.0
"""A finished run's pages keep refreshing this long, until the store holds it."""
_REPORTS: dict[tuple[str, str, float], dict] = {}
"""(runs dir, run id, ingested_at) -> report: a stored run's report changes only on ingest."""
_REPORTS_LOCK = threading.Lock()  # the server answers requests on threads


def runs_dir() -> Path:
    """The runs directory of the app serving this request."""
    return Path(flask.current_app.config[RUNS_DIR_KEY])


def refresh_s() -> float:
    """Seconds from one re-read of a page whose run may still change to the next."""
    return float(flask.current_app.config[REFRESH_S_KEY])


def has_store() -> bool:
    return store_path(runs_dir()).exists()


def run_record(run_id: str) -> dict | None:
    """A run's run.json, or None when there is no such run directory."""
    path = runs_dir() / run_id / "run.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_records() -> dict[str, dict]:
    """Run id -> run.json of every run under the runs directory (telemetry/run_record.py)."""
    return {run_id: record for run_id, (_, record) in run_records_in(runs_dir()).items()}


def unstored_runs() -> dict[str, dict]:
    """Run id -> run.json of the runs the store does not hold: those training with no window
    completed yet, and those finished but not (yet) ingested; their pages read their
    segments."""
    stored = stored_run_ids()
    return {run_id: record for run_id, record in run_records().items() if run_id not in stored}


def any_changing() -> bool:
    """Whether some run may still change (a runs list then refreshes)."""
    return any(is_changing(record) for record in run_records().values())


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
    """Whether the run's data comes from its segments: until the store holds some of it (a
    training run's first completed window; a finished run's ingest), so that a page never goes
    blank between the two."""
    return run_record(run_id) is not None and run_id not in stored_run_ids()


def refreshes(run_id: str) -> bool:
    """Whether a run's pages re-read it on an interval: while it trains (its segments or its
    windows grow), then until the store holds it as it ended."""
    record = run_record(run_id)
    if not is_changing(record):
        return False
    status = record.get("status")
    return status == "running" or dash_ingest.stored_runs(runs_dir()).get(run_id) != status


def live_windows(run_id: str) -> tuple[int, int] | None:
    """(windows, steps they cover) of a run the store holds as it stood while training (its
    completed windows so far), else None."""
    if not has_store():
        return None
    with store() as con:
        row = con.execute(
            "SELECT count(*), max(w.end_step) FROM runs r JOIN windows w USING (run_id) "
            "WHERE r.run_id = ? AND r.status = 'running'", [run_id],
        ).fetchone()  # fmt: skip
    return (int(row[0]), int(row[1])) if row and row[0] else None


@contextmanager
def run_connection(run_id: str) -> Iterator[duckdb.DuckDBPyConnection]:
    """The run's data: the store once it holds some of it, else its segments."""
    con = open_live(runs_dir(), run_id) if reads_segments(run_id) else open_reader(runs_dir())
    try:
        yield con
    finally:
        con.close()


def run_report(run_id: str) -> dict:
    """A run's report: for a run the store holds (a training run's completed windows included),
    the one its latest ingest stored (or computed once per ingest and kept here); else computed
    from its segments."""
    if has_store():
        with store() as con:
            row = con.execute("SELECT ingested_at FROM runs WHERE run_id = ?", [run_id]).fetchone()
            if row is not None:
                key = (str(runs_dir()), run_id, row[0])
                with _REPORTS_LOCK:
                    found = _REPORTS.get(key)
                if found is None:
                    found = cached_report(con, run_id)
                    with _REPORTS_LOCK:
                        for older in [k for k in _REPORTS if k[:2] == key[:2]]:
                            del _REPORTS[older]  # a training run is ingested every window
                        _REPORTS[key] = found
                return found
    con = open_live(runs_dir(), run_id)  # StoreError when there is no such run at all
    try:
        return report(con, run_id)
    finally:
        con.close()
