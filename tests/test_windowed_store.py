"""The windowed store's promises: a growing run is ingested window by window without rewriting
a complete window, a window is listed only once its files are whole, and the report does not
depend on the window size."""

from __future__ import annotations

import json
import shutil

import pytest

from ranktrace.analysis.ingest import ingest
from ranktrace.analysis.run import report
from ranktrace.analysis.store import open_reader, query, segment_files
from ranktrace.analysis.windows import WINDOWED_TABLES
from ranktrace.telemetry.run_record import write_run_json
from tests.conftest import FLUSHING_RUN_STEPS, growing_copy, ranktrace

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)

STEPS, WINDOW = FLUSHING_RUN_STEPS, 10


def _windows(runs_dir) -> dict[int, tuple[int, bool]]:
    con = open_reader(runs_dir)
    try:
        rows = query(con, "SELECT window_index, generation, complete FROM windows")[1]
    finally:
        con.close()
    return {window: (generation, complete) for window, generation, complete in rows}


def _ingested_at(runs_dir) -> float:
    con = open_reader(runs_dir)
    try:
        return query(con, "SELECT ingested_at FROM runs")[1][0][0]
    finally:
        con.close()


def _report(runs_dir, run_id: str) -> dict:
    con = open_reader(runs_dir)
    try:
        result = report(con, run_id)
    finally:
        con.close()
    return json.loads(json.dumps(result, default=str))


def test_a_growing_run_rewrites_only_its_last_window(flushing_run, tmp_path):
    runs_dir = tmp_path / "runs"
    growing_copy(flushing_run, runs_dir, last_step=14)
    held = ingest(runs_dir, window_steps=WINDOW, complete_only=True)
    assert held.incomplete == [flushing_run.name]
    assert _windows(runs_dir) == {0: (0, True)}  # steps 10-14 of window 1: held back
    stored_at = _ingested_at(runs_dir)
    run_json = runs_dir / flushing_run.name / "run.json"
    write_run_json(run_json.parent, json.loads(run_json.read_text()))  # a trainer's update
    again = ingest(runs_dir, window_steps=WINDOW, complete_only=True)
    assert (again.runs, again.incomplete) == ([], [flushing_run.name])  # no window completed:
    assert _ingested_at(runs_dir) == stored_at  # nothing published, no report redone
    ingest(runs_dir)  # a plain ingest shows the last window as far as it got
    assert _windows(runs_dir) == {0: (0, True), 1: (1, False)}
    window0_files = {p.name for p in runs_dir.glob("ranktrace.windows/*/window=000000/*")}

    shutil.copytree(flushing_run, runs_dir / flushing_run.name, dirs_exist_ok=True)  # it ended
    grown = ingest(runs_dir)
    assert grown.windows == 2  # window 1 again (it grew), window 2 new; window 0 untouched
    assert _windows(runs_dir) == {0: (0, True), 1: (2, True), 2: (2, True)}
    assert {p.name for p in runs_dir.glob("ranktrace.windows/*/window=000000/*")} == window0_files
    files = list(runs_dir.glob("ranktrace.windows/*/window=*/*"))
    assert len(files) == 3 * len(WINDOWED_TABLES), files  # generation 1 of window 1 deleted

    whole = tmp_path / "whole"
    shutil.copytree(flushing_run, whole / flushing_run.name)
    ingest(whole, window_steps=WINDOW)
    con_grown, con_whole = open_reader(runs_dir), open_reader(whole)
    try:
        for table in WINDOWED_TABLES:
            sql = f"SELECT * FROM {table} ORDER BY ALL"
            assert query(con_grown, sql)[1] == query(con_whole, sql)[1], table
    finally:
        con_grown.close()
        con_whole.close()


def test_the_report_does_not_depend_on_the_window_size(flushing_run, tmp_path):
    """Windows of 10 steps (three) and of 100 (one) give the same rows and the same report."""
    reports = {}
    for window in (WINDOW, 100):
        runs_dir = tmp_path / f"w{window}"
        shutil.copytree(flushing_run, runs_dir / flushing_run.name)
        ingest(runs_dir, window_steps=window)
        assert len(_windows(runs_dir)) == -(-STEPS // window)
        reports[window] = _report(runs_dir, flushing_run.name)
        _assert_attempt_steps_summarise_steps(runs_dir)
    assert reports[WINDOW]["steps"] == STEPS - 1  # the warm-up step left out
    assert reports[WINDOW] == reports[100]


def _assert_attempt_steps_summarise_steps(runs_dir) -> None:
    """A run launched once: attempt_steps (written from the window's steps file, not from the
    segments again) is its steps' summary, every step of every window."""
    con = open_reader(runs_dir)
    try:
        summary = query(
            con,
            "SELECT run_id, attempt, step, count(*), max(step_time_s), "
            "min(start_ns), max(end_ns) FROM steps GROUP BY ALL ORDER BY ALL",
        )[1]
        written = query(con, "SELECT run_id, attempt, step, ranks, step_time_s, start_ns, "
                        "end_ns FROM attempt_steps ORDER BY ALL")[1]  # fmt: skip
    finally:
        con.close()
    assert len(written) == STEPS
    assert written == summary


def test_a_window_is_listed_only_once_its_files_are_whole(flushing_run, tmp_path):
    """An ingest that meets a damaged segment says which, in one line, and leaves no file and
    lists nothing new: the store reads as before it began."""
    runs_dir = tmp_path / "runs"
    growing_copy(flushing_run, runs_dir, last_step=9)
    ingest(runs_dir, window_steps=WINDOW)
    before = _windows(runs_dir)
    shutil.copytree(flushing_run, runs_dir / flushing_run.name, dirs_exist_ok=True)
    broken = segment_files(runs_dir / flushing_run.name, "spans")[-1]
    broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])  # a torn segment
    result = ranktrace("ingest", "--runs-dir", str(runs_dir), runs_dir=runs_dir)
    assert result.returncode == 2 and "is not a readable Parquet file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert _windows(runs_dir) == before
    leftovers = [p for p in runs_dir.glob("ranktrace.windows/**/*") if p.name.startswith(".")]
    assert not leftovers
    assert len(list(runs_dir.glob("ranktrace.windows/*/window=*/*"))) == len(WINDOWED_TABLES)


def test_a_read_that_meets_the_catalog_cut_short_reads_it_again_once_whole(flushing_run, tmp_path):
    """A watch's look once failed with `Could not read enough bytes` from the catalog as the
    run's own ingest ended (analysis/store.py SHORT_READ_TRIES). Here the real catalog is cut to
    its headers while a reader has it attached, and made whole again before that read ends: the
    read fails on the missing blocks, and `read_store` reads again on a fresh reader."""
    from ranktrace.analysis.store import read_store

    runs_dir = tmp_path / "runs"
    growing_copy(flushing_run, runs_dir, STEPS - 1)
    ingest(runs_dir)
    catalog = runs_dir / "ranktrace.duckdb"
    whole = catalog.read_bytes()
    failures = []

    def steps_and_runs(con) -> tuple[int, int]:
        if not failures:  # the first read: a writer is rewriting the file under it
            with open(catalog, "r+b") as file:
                file.truncate(12288)  # its headers, none of its blocks
            try:
                con.execute("SELECT sum(length(report)) FROM reports").fetchall()  # (as a watch)
            except Exception as error:
                failures.append(str(error))
                raise
            finally:
                catalog.write_bytes(whole)  # (in place: the reader holds the file open)
        (row,) = con.execute("SELECT count(*), count(DISTINCT run_id) FROM steps").fetchall()
        return row

    assert read_store(runs_dir, steps_and_runs) == (STEPS * 2, 1)
    assert len(failures) == 1 and "Could not read" in failures[0], failures


def test_a_removed_run_leaves_the_store_readable_with_the_others(flushing_run, tmp_path):
    """`remove_run` (an import whose report failed, a job run again after torch aborted it) once
    failed on any store with windows: the views it points again need the derivations' shapes
    (`Table with name derived_span_records does not exist`, a traceback from `ranktrace
    import`)."""
    from ranktrace.analysis.ingest import remove_run
    from ranktrace.analysis.windows import run_windows_dir, windows_root

    runs_dir = tmp_path / "runs"
    kept = growing_copy(flushing_run, runs_dir, STEPS - 1)
    gone = runs_dir / "gone"
    shutil.copytree(kept, gone)
    write_run_json(gone, {**json.loads((kept / "run.json").read_text()), "run_id": "gone"})
    ingest(runs_dir)
    remove_run(runs_dir, "gone")
    con = open_reader(runs_dir)
    try:
        rows = query(con, "SELECT run_id, count(*) FROM steps GROUP BY run_id")[1]
        runs = query(con, "SELECT run_id FROM runs")[1]
    finally:
        con.close()
    assert rows == [(kept.name, STEPS * 2)] and runs == [(kept.name,)]
    assert not run_windows_dir(windows_root(runs_dir), "gone").exists()
    assert run_windows_dir(windows_root(runs_dir), kept.name).exists()
