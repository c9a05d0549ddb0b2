"""A long run diagnosed window by window (analysis/windows.py `analysis_spans`): each analysis
window on a DuckDB connection of its own over that window's files and the run's few catalog rows,
so that windows are independent tasks (analysis/task_pool.py: this process, local workers, or a
Ray cluster reading the same runs directory) and where one ran changes nothing in what it found;
their parts merged (analysis/window_merge.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import pyarrow as pa

from ranktrace.analysis import part_cache, replay_timeline, stragglers, window_merge, windows
from ranktrace.analysis.catalog import SQL_DIR
from ranktrace.analysis.run_part import Part, diagnosed_part
from ranktrace.analysis.task_pool import map_tasks

RUN_ROWS = ("ranks",)
"""The catalog tables whose rows of the run a window's diagnosis reads (small: no steps)."""
RECORD_KEYS = ("imported", "model_config", "config", "stage_layers")
"""The run.json keys it reads (run_part.replay_model, remedies.RunShape.of): not the ones a
trainer rewrites every step, so a live run's closed windows stay as they were diagnosed."""


@dataclass(frozen=True)
class SpanTask:
    """One analysis window to diagnose, with everything it reads but its files."""

    span: windows.AnalysisSpan
    shapes: dict[str, str]
    """windows.view_shapes of the store: the windowed tables' columns."""
    rows: dict[str, pa.Table]
    """{RUN_ROWS table: the run's rows}."""
    run: dict
    """What the diagnosis reads of the run's `runs` row (analysis/run.py resolve_run): its id,
    micro-batches and run.json's RECORD_KEYS."""
    max_calls: int
    """Its share of the replay's budget: MAX_REPLAY_CALLS × its recorded steps / the run's, or
    of a live run, / analysis_target (the same whatever the run's length)."""


def diagnose_span(task: SpanTask, threads: int | None = None) -> Part:
    """The Part of one analysis window, on a connection of its own (`threads` DuckDB threads;
    None: every core). Whether a finding costs enough is the run's to judge
    (stragglers.cost_judged_by_the_run)."""
    con = duckdb.connect()
    try:
        if threads is not None:
            con.execute(f"SET threads = {threads}")
        for table, rows in task.rows.items():
            con.register("run_rows", rows)
            con.execute(f"CREATE TABLE {table} AS SELECT * FROM run_rows")
            con.unregister("run_rows")
        windows.define_views(con, task.span.files, task.shapes, task.span.by_name)
        con.execute((SQL_DIR / "020_views.sql").read_text())
        with stragglers.cost_judged_by_the_run():
            return diagnosed_part(con, task.run, task.max_calls)
    finally:
        con.close()


def run_part(con: duckdb.DuckDBPyConnection, row: dict, workers: int = 1,
             ray_address: str | None = None) -> Part:  # fmt: skip
    """The Part of the run `row`: in one piece on `con` when it fits in one analysis window
    (or `con` holds no windows: a live run read from its segments), else its windows' parts
    merged, each diagnosed in this process, in `workers` local processes, or on the Ray cluster
    at `ray_address`. A run still training keeps its closed analysis windows' parts
    (analysis/part_cache.py): each window it adds costs the diagnosis of the last one only."""
    run_id, ranks = row["run_id"], int(row["world_size"] or 1)
    live = row["record"].get("status") == "running"
    spans = windows.analysis_spans(con, run_id, ranks, live=live)
    root = windows.stored_root(con)
    folder = part_cache.parts_dir(windows.run_windows_dir(root, run_id)) if root else None
    if not live and folder is not None:
        part_cache.forget(folder)
    if len(spans) <= 1:
        return diagnosed_part(con, row)
    shapes = windows.view_shapes(con)
    rows = {table: _run_rows(con, table, run_id) for table in RUN_ROWS}
    record = row["record"]
    run = {"run_id": run_id, "micro_batches": row["micro_batches"],
           "record": {key: record[key] for key in RECORD_KEYS if key in record}}  # fmt: skip
    budget = replay_timeline.MAX_REPLAY_CALLS
    if live:
        target = windows.analysis_target(ranks)
        budgets = [budget * min(span.steps, target) // target for span in spans]
    else:
        steps = max(1, sum(span.steps for span in spans))
        budgets = [budget * span.steps // steps for span in spans]
    pairs = zip(spans, budgets, strict=True)
    tasks = [SpanTask(span, shapes, rows, run, calls) for span, calls in pairs]

    def diagnose(todo: list[SpanTask]) -> list[Part]:
        return map_tasks(diagnose_span, todo, workers, ray_address)

    parts = part_cache.diagnosed(tasks, folder, diagnose) if live else diagnose(tasks)
    return window_merge.merge_parts(parts)


def _run_rows(con: duckdb.DuckDBPyConnection, table: str, run_id: str) -> pa.Table:
    return con.sql(
        f"SELECT * FROM {table} WHERE run_id = $run", params={"run": run_id}
    ).to_arrow_table()
