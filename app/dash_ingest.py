"""The dashboard's ingester. A run still training has the windows every rank has finished put
in the store as they complete (`ranktrace ingest --complete-windows`, as `ranktrace watch`
does), so its pages read those windows and the report ingest computed over them, not every
segment of the run at each refresh. A finished run the store lacks, or holds only as it stood
while training (a torchrun job, a job recorded with `ranktrace.init()` and no `ranktrace run`,
a job that died before its own ingest), is put in the store whole.

The ingest runs in a child process (`ranktrace ingest RUN...`): DuckDB refuses a read-write
handle on a file that this process holds attached read-only for the pages' requests, while
another process simply waits for the readers' attachments (as `ranktrace train` does).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from ranktrace.analysis.store import open_reader, store_path
from ranktrace.app.watch_cmd import WATCH_WINDOW_STEPS
from ranktrace.telemetry import names
from ranktrace.telemetry.run_record import FINISHED_STATUSES, run_records

SCAN_EVERY_S = 5.0
"""How often the runs directory is scanned for runs to ingest."""
OWN_INGEST_GRACE_S = 10.0
"""A run that finished less than this ago is left to its own job's ingest (trainer, `ranktrace
run`), which would otherwise wait on the dashboard's for the store's lock."""
LIVE_WINDOW_STEPS = WATCH_WINDOW_STEPS
"""Steps per window of a training run the store does not hold yet (a watch's, so that the two
agree; a run already stored keeps its own)."""
_LOG = logging.getLogger(__name__)


def stored_runs(runs_dir: Path) -> dict[str, str]:
    """Run id -> its status as the store holds it (`running` for one ingested while it
    trained), for every run the store under `runs_dir` holds (none without a store)."""
    if not store_path(runs_dir).exists():
        return {}
    con = open_reader(runs_dir)
    try:
        return dict(con.execute("SELECT run_id, status FROM runs").fetchall())
    finally:
        con.close()


def stored_run_ids(runs_dir: Path) -> set[str]:
    """The ids of the runs the store under `runs_dir` holds (none when there is no store)."""
    return set(stored_runs(runs_dir))


def finished_unstored(runs_dir: Path) -> dict[str, float]:
    """Run id -> run.json mtime of the runs under `runs_dir` that finished at least
    OWN_INGEST_GRACE_S ago and that the store lacks, or holds as they stood while training."""
    stored = stored_runs(runs_dir)
    finished_before = time.time() - OWN_INGEST_GRACE_S
    return {
        run_id: mtime for run_id, (mtime, record) in run_records(runs_dir).items()
        if record.get("status") in FINISHED_STATUSES
        and stored.get(run_id) not in FINISHED_STATUSES
        and float(record.get("finished_at") or 0.0) <= finished_before
    }  # fmt: skip


def telemetry_state(run_dir: Path) -> tuple:
    """Changes whenever a rank adds a segment: each rank folder's modification time (a
    segment is renamed into its folder whole)."""
    telemetry = run_dir / names.TELEMETRY_DIR
    try:
        return tuple(sorted((entry.name, entry.stat().st_mtime_ns)
                            for entry in os.scandir(telemetry) if entry.is_dir()))  # fmt: skip
    except OSError:  # no segments yet
        return ()


def training(runs_dir: Path) -> list[str]:
    """The ids of the runs under `runs_dir` still training."""
    return [run_id for run_id, (_, record) in run_records(runs_dir).items()
            if record.get("status") == "running"]  # fmt: skip


def ingest_in_child(runs_dir: Path, run_ids: list[str], *options: str) -> str | None:
    """`ranktrace ingest [OPTIONS] RUN...` in a child process; None when it succeeded, else its
    last line of error output."""
    argv = [sys.executable, "-m", "ranktrace.app.cli", "ingest", "--runs-dir", str(runs_dir),
            *options, *run_ids]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


STOP_WAIT_S = 60.0
"""How long a stopping dashboard waits for the scan under way (an ingest runs in a child)."""


class Ingester(threading.Thread):
    """A daemon thread that ingests, every SCAN_EVERY_S: the windows training runs have
    completed since its last look, and finished runs the store lacks (all of them at once when
    the dashboard starts, then each one within SCAN_EVERY_S of its finishing). A finished run
    whose ingest failed is tried again only once its run.json changes."""

    def __init__(self, runs_dir: Path, every_s: float = SCAN_EVERY_S):
        super().__init__(name="ranktrace-dash-ingest", daemon=True)
        self.runs_dir = Path(runs_dir)
        self.every_s = every_s
        self._tried: dict[str, float] = {}  # run id -> run.json mtime at the last try
        self._seen: dict[str, tuple] = {}  # training run id -> telemetry_state at the last try
        self._stopping = threading.Event()  # not `_stop`: a method of Thread that join calls

    def scan_once(self) -> list[str]:
        """Ingest what is due now; returns the run ids tried."""
        try:
            return self._ingest_finished() + self._ingest_training()
        except Exception as error:  # a damaged store, a lock held too long: the next scan
            _LOG.warning("dashboard ingest: %s", error)  # tries again; the pages keep serving
            return []

    def _ingest_finished(self) -> list[str]:
        pending = finished_unstored(self.runs_dir)
        due = sorted(r for r, mtime in pending.items() if self._tried.get(r) != mtime)
        if due:
            self._report(due, ingest_in_child(self.runs_dir, due))
            self._tried.update({r: pending[r] for r in due})
        return due

    def _ingest_training(self) -> list[str]:
        """The windows every rank of a training run has finished, when a rank wrote a segment
        since the last look: a run not stored yet in windows of LIVE_WINDOW_STEPS."""
        states = {r: telemetry_state(self.runs_dir / r) for r in training(self.runs_dir)}
        due = sorted(r for r, state in states.items() if state and self._seen.get(r) != state)
        if not due:
            return []
        stored = stored_runs(self.runs_dir)
        for run_ids, options in (([r for r in due if r in stored], ()),
                                 ([r for r in due if r not in stored],
                                  ("--window", str(LIVE_WINDOW_STEPS)))):  # fmt: skip
            if run_ids:
                problem = ingest_in_child(self.runs_dir, run_ids, "--complete-windows", *options)
                self._report(run_ids, problem)
        self._seen.update({r: states[r] for r in due})
        return due

    @staticmethod
    def _report(run_ids: list[str], problem: str | None) -> None:
        if problem:
            _LOG.warning("dashboard ingest of %s failed: %s", ", ".join(run_ids), problem)

    def run(self) -> None:
        while not self._stopping.is_set():
            if self.runs_dir.is_dir():
                self.scan_once()
            self._stopping.wait(self.every_s)

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """End the scans and wait (at most `timeout_s`) for the one under way: a thread left
        inside DuckDB's or Arrow's C++ code while the interpreter exits is ended by a forced
        unwind those frames swallow, and the process aborts ("FATAL: exception not rethrown",
        SIGABRT: `ranktrace demo` Ctrl-C'd while its dashboard stored the runs it had just made,
        in a run of tools/timing_loop.py here)."""
        self._stopping.set()
        if self.is_alive():
            self.join(timeout_s)
