"""Deriving windows from segments: one window's tables from the segments holding its steps
(analysis/windows.py writes them), and many at once — in this process, in local worker
processes (`ranktrace ingest --workers N`), or as tasks on a Ray cluster (`--ray ADDRESS`)
whose nodes read the same runs directory. Windows are independent: each task needs only its
segments and the run's rank rows (clock offsets), and writes only its own files, so where it
ran changes nothing in them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from ranktrace.analysis import store, windows
from ranktrace.analysis.task_pool import map_tasks
from ranktrace.telemetry.schema import SCHEMAS

RUN_SOURCES = {"events": "run_events", "ranks": "run_rank_rows"}
"""The run's events and rank rows, as temporary tables of a connection (load_run_rows)."""


@dataclass(frozen=True)
class WindowTask:
    """One window to derive: where its segments are and where its files go."""

    run_dir: str
    first_step: int
    end_step: int
    """Steps [first_step, end_step)."""
    segments: dict[str, list[str]]
    """{kind (spans, steps): paths relative to run_dir} of the segments holding its steps."""
    outputs: dict[str, str]
    """{table: the file to write}."""
    rank_files: list[str]
    """The run's rank segments (relative to run_dir): the clock offsets of every attempt."""
    union_by_name: bool


def load_run_rows(con: duckdb.DuckDBPyConnection, run_dir: Path, rank_files: list[str],
                  event_files: list[str], union_by_name: bool) -> None:  # fmt: skip
    """Temporary tables run_rank_rows and run_events: every rank and event segment of the run
    (typed empty where there are none), read once for all its windows."""
    for table, paths, kind in (("run_rank_rows", rank_files, "rank"),
                               ("run_events", event_files, "events")):  # fmt: skip
        source = store.files_source([run_dir / p for p in paths], union_by_name)
        if source is None:
            con.register(f"no_{table}", pa.table(SCHEMAS[kind].empty_table()))
            source = f"no_{table}"
        con.execute(f"CREATE OR REPLACE TEMP TABLE {table} AS SELECT * FROM {source}")


def write_window(con: duckdb.DuckDBPyConnection, task: WindowTask) -> dict[str, int]:
    """Derive one window on `con` (holding the run's rows: load_run_rows) and write its files;
    rows written per table."""
    run_dir = Path(task.run_dir)
    steps = (task.first_step, task.end_step)
    sources = dict(RUN_SOURCES)
    for kind in ("spans", "steps"):
        paths = [run_dir / p for p in task.segments.get(kind, [])]
        sources[kind] = store.files_source(paths, task.union_by_name, steps)
    store.define_sources(con, sources, task.union_by_name)

    def over_written_collectives(relation: str):
        def make() -> str:  # the collectives just written, not derived a second time
            store.define_steps(con, "SELECT * FROM written_collectives")
            return relation

        return make

    def over_written_steps() -> str:
        # a run launched once has no redone steps: the steps just written are every attempt's,
        # read from one file instead of the ranks' segments again
        if store.launched_once(con):
            con.execute("CREATE OR REPLACE TEMP VIEW attempt_step_rows AS "
                        "SELECT * FROM written_steps")  # fmt: skip
        return "derived_attempt_steps"

    relations = {  # collectives first: steps and group_transfers read them
        "collectives": lambda: "derived_collectives",
        "span_records": lambda: "derived_span_records",
        "steps": over_written_collectives("derived_steps"),
        "group_transfers": over_written_collectives("derived_group_transfers"),
        "attempt_steps": over_written_steps,
    }
    outputs = {table: Path(task.outputs[table]) for table in relations}
    try:
        return windows.write_window(con, run_dir.name, outputs, relations)
    finally:  # the written files had temporary names: views over them end with the window
        with contextlib.suppress(duckdb.Error):  # (a connection broken by the error raised)
            store.define_steps(con, "SELECT * FROM derived_collectives")
            con.execute("CREATE OR REPLACE TEMP VIEW attempt_step_rows AS SELECT * FROM src_steps")


def run_task(task: WindowTask, threads: int = 1) -> dict[str, int]:
    """One window in a process of its own (a local worker, a Ray task): its own connection
    with `threads` threads and the run's rank rows."""
    con = duckdb.connect()
    try:
        con.execute("SET preserve_insertion_order = false")
        con.execute("SET enable_external_file_cache = false")  # as store.connect_writer
        con.execute(f"SET threads = {threads}")
        load_run_rows(con, Path(task.run_dir), task.rank_files, [], task.union_by_name)
        return write_window(con, task)
    finally:
        con.close()


def write_windows(con: duckdb.DuckDBPyConnection, tasks: list[WindowTask], workers: int = 1,
                  ray_address: str | None = None) -> list[dict[str, int]]:  # fmt: skip
    """Every task's rows written, in order: on a Ray cluster, in `workers` local processes, or
    on `con` (holding the run's rows) one after the other (analysis/task_pool.py)."""
    return map_tasks(run_task, tasks, workers, ray_address,
                     here=lambda task: write_window(con, task))  # fmt: skip
