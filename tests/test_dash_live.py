"""The dashboard while a run trains: its pages read the windows every rank has finished (the
dashboard's ingester stores them as they complete) and the report ingest computed over them, not
every segment at each refresh; once the run ended, the whole run."""

from __future__ import annotations

import json
import shutil
import sys
import time

import dash
import pytest

from ranktrace.app import dash_data
from ranktrace.app.cli import DASH_REFRESH_S
from ranktrace.app.dash_ingest import Ingester, stored_runs
from ranktrace.app.dashboard import create_app
from ranktrace.telemetry.run_record import write_run_json
from tests.conftest import FLUSHING_RUN_STEPS, growing_copy

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)


def _page(name: str):
    return sys.modules[dash.page_registry[f"pages.{name}"]["module"]]


def test_a_training_run_is_shown_from_its_completed_windows(flushing_run, tmp_path):
    """A run flushing 5-step segments: at step 4 no window is complete and the pages read its
    segments; at step 14 the ingester stores window 0 (steps 0-9, the dashboard's windows are a
    watch's 10 steps) and holds back window 1, and the pages read the store, refreshing; once
    the run ended, the whole run."""
    runs_dir = tmp_path / "runs"
    run_dir = growing_copy(flushing_run, runs_dir, last_step=4)
    run_id = run_dir.name
    ingester = Ingester(runs_dir)
    with create_app(runs_dir, refresh_s=DASH_REFRESH_S).server.test_request_context():
        assert ingester.scan_once() == [run_id]  # no window complete: nothing stored,
        assert dash_data.reads_segments(run_id) and dash_data.refreshes(run_id)  # segments
        assert dash_data.run_report(run_id)["steps"] == 4

        growing_copy(flushing_run, runs_dir, last_step=14)
        assert ingester.scan_once() == [run_id]
        assert ingester.scan_once() == []  # no rank wrote a segment since: nothing to ingest
        assert not dash_data.reads_segments(run_id) and dash_data.refreshes(run_id)
        report = dash_data.run_report(run_id)
        assert (report["status"], report["steps"]) == ("running", 9)  # the warm-up left out
        assert dash_data.live_windows(run_id) == (1, 10)
        content = str(_page("run").run_content(run_id))
        assert "running · 9 steps" in content and "live: steps 0-9, the 1 window(s)" in content
        rows = _page("runs").runs_rows(dash_data.unstored_runs())
        assert [row["status"] for row in rows] == ["running (live)"]
        record = json.loads((run_dir / "run.json").read_text())
        write_run_json(run_dir, {**record, "status": "completed"})  # until its final ingest:
        assert _page("runs").runs_rows({})[0]["status"] == "completed (being stored)"

        shutil.copytree(flushing_run, run_dir, dirs_exist_ok=True)  # it ended, 2 minutes ago
        record = json.loads((run_dir / "run.json").read_text())
        write_run_json(run_dir, {**record, "finished_at": time.time() - 120})
        assert ingester.scan_once() == [run_id]
        report = dash_data.run_report(run_id)
        assert (report["status"], report["steps"]) == ("completed", FLUSHING_RUN_STEPS - 1)
        assert dash_data.live_windows(run_id) is None and not dash_data.refreshes(run_id)
        assert "live:" not in str(_page("run").run_content(run_id))


def test_a_stopped_ingester_has_ended_its_scan(flushing_run, tmp_path):
    """`stop` returns once the scan under way has ended (the ingest of a finished run the store
    lacks, in a child): no thread of the dashboard is left inside DuckDB or Arrow while the
    process exits (see `Ingester.stop`)."""
    runs_dir = tmp_path / "runs"
    run_dir = runs_dir / flushing_run.name
    shutil.copytree(flushing_run, run_dir)
    record = json.loads((run_dir / "run.json").read_text())
    write_run_json(run_dir, {**record, "finished_at": time.time() - 120})  # due at once
    ingester = Ingester(runs_dir)
    ingester.start()
    time.sleep(0.2)  # inside its first scan: the run's ingest takes seconds
    ingester.stop()
    assert not ingester.is_alive()
    assert stored_runs(runs_dir) == {run_dir.name: "completed"}  # the scan ran to its end
