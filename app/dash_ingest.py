"""The dashboard's ingester: a finished run that the store does not hold yet (a torchrun job,
a job recorded with `ranktrace.init()` and no `ranktrace run`, a job that died before its own
ingest) is put in the store while the dashboard serves, so its pages show the stored run.

The ingest runs in a child process (`ranktrace ingest RUN...`): DuckDB refuses a read-write
handle on a file that this process holds attached read-only for the pages' requests, while
another process simply waits for the readers' attachments (as `ranktrace train` does).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

from ranktrace.analysis.store import StoreError, open_reader, store_path
from ranktrace.telemetry.run_record import FINISHED_STATUSES, RUN_JSON

SCAN_EVERY_S = 5.0
"""How often the runs directory is scanned for finished runs missing from the store."""
OWN_INGEST_GRACE_S = 10.0
"""A run that finished less than this ago is left to its own job's ingest (trainer, `ranktrace
run`), which would otherwise wait on the dashboard's for the store's lock."""
_LOG = logging.getLogger(__name__)


def stored_run_ids(runs_dir: Path) -> set[str]:
    """The ids of the runs the store under `runs_dir` holds (none when there is no store)."""
    if not store_path(runs_dir).exists():
        return set()
    con = open_reader(runs_dir)
    try:
        return {row[0] for row in con.execute("SELECT run_id FROM runs").fetchall()}
    finally:
        con.close()


def finished_unstored(runs_dir: Path) -> dict[str, float]:
    """Run id -> run.json mtime of the runs under `runs_dir` that finished at least
    OWN_INGEST_GRACE_S ago and that the store lacks."""
    stored = stored_run_ids(runs_dir)
    finished_before = time.time() - OWN_INGEST_GRACE_S
    runs = {}
    for path in sorted(Path(runs_dir).glob(f"*/{RUN_JSON}")):
        try:
            mtime = path.stat().st_mtime
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being rewritten right now; the next scan sees it
        if (record.get("status") in FINISHED_STATUSES and path.parent.name not in stored
                and float(record.get("finished_at") or 0.0) <= finished_before):  # fmt: skip
            runs[path.parent.name] = mtime
    return runs


def ingest_in_child(runs_dir: Path, run_ids: list[str]) -> str | None:
    """`ranktrace ingest RUN...` in a child process; None when it succeeded, else its last
    line of error output."""
    argv = [sys.executable, "-m", "ranktrace.app.cli", "ingest", "--runs-dir", str(runs_dir),
            *run_ids]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


class Ingester(threading.Thread):
    """A daemon thread that ingests finished, unstored runs: all of them at once when the
    dashboard starts, then each one within SCAN_EVERY_S of its finishing. A run whose ingest
    failed is tried again only once its run.json changes."""

    def __init__(self, runs_dir: Path, every_s: float = SCAN_EVERY_S):
        super().__init__(name="ranktrace-dash-ingest", daemon=True)
        self.runs_dir = Path(runs_dir)
        self.every_s = every_s
        self._tried: dict[str, float] = {}  # run id -> run.json mtime at the last try
        self._stop = threading.Event()

    def scan_once(self) -> list[str]:
        """Ingest what is finished and unstored now; returns the run ids tried."""
        try:
            pending = finished_unstored(self.runs_dir)
        except StoreError as error:  # a store of another ranktrace, or being replaced
            _LOG.warning("dashboard ingest: %s", error)
            return []
        due = sorted(r for r, mtime in pending.items() if self._tried.get(r) != mtime)
        if due:
            problem = ingest_in_child(self.runs_dir, due)
            if problem:
                _LOG.warning("dashboard ingest of %s failed: %s", ", ".join(due), problem)
            self._tried.update({r: pending[r] for r in due})
        return due

    def run(self) -> None:
        while not self._stop.is_set():
            if self.runs_dir.is_dir():
                self.scan_once()
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
