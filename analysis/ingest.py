"""Ingest, the store's one writer: publishes each run's windows from its segments and keeps the
catalog's run rows, events, ranks and report up to date.

A window (analysis/windows.py) is written again only when the segments holding its steps
changed (analysis/segment_catalog.py): ingesting a growing run adds its new windows and
rewrites the last one it had, nothing before it; ingesting twice writes nothing. Each run's
catalog rows are replaced in one transaction with the windows they list, so a reader sees a run
as one ingest left it, never a window half-written or half-listed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from ranktrace.analysis import catalog, segment_catalog, store, window_writer, windows
from ranktrace.analysis.store import StoreError
from ranktrace.telemetry.run_record import FINISHED_STATUSES

HELD = "+held"
"""Suffix of a run's stored signature while a window of it was held back (complete_only)."""


@dataclass
class IngestReport:
    """What one ingest did: runs written and skipped (unchanged), rows written per table (the
    windowed tables' rows are those of the windows written), windows written."""

    runs: list[str]
    skipped: list[str]
    rows: dict[str, int]
    windows: int = 0
    incomplete: list[str] = field(default_factory=list)
    """Runs with steps held back (`complete_only`): a window not every rank has finished."""


def ingest(
    runs_dir: Path,
    run_ids: list[str] | None = None,
    force: bool = False,
    window_steps: int | None = None,
    complete_only: bool = False,
    workers: int = 1,
    ray_address: str | None = None,
) -> IngestReport:
    """Bring the store up to date with runs' segments (all under `runs_dir`, or `run_ids`).

    Args:
        force: write every window again (a run's windows are otherwise written only when
            their segments changed).
        window_steps: steps per window (the run's earlier ingest's, else DEFAULT_WINDOW_STEPS);
            a new size writes the run's windows again.
        complete_only: write only windows every rank has finished (or of a run that ended),
            as `ranktrace watch` does; otherwise the last window of a run still going is
            written as far as it got, and written again as it grows.
        workers: derive windows, and diagnose the report's analysis windows, in this many
            local processes (analysis/window_writer.py, analysis/window_report.py).
        ray_address: derive them as tasks on the Ray cluster there instead.
    """
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise StoreError(f"runs directory {runs_dir} does not exist; train a run first")
    if window_steps is not None and window_steps < 1:
        raise StoreError(f"--window must be at least 1 step, not {window_steps}")
    if workers < 1:
        raise StoreError(f"--workers must be at least 1, not {workers}")
    run_dirs = sorted(p.parent for p in runs_dir.glob("*/run.json"))
    if run_ids is not None:
        unknown = set(run_ids) - {d.name for d in run_dirs}
        if unknown:
            raise StoreError(f"no run {sorted(unknown)} under {runs_dir}")
        run_dirs = [d for d in run_dirs if d.name in run_ids]
    report = IngestReport([], [], dict.fromkeys(store.TABLES, 0))
    con = store.connect_writer(runs_dir)
    options = _Options(force, window_steps, complete_only, workers, ray_address)
    try:
        for run_dir in run_dirs:
            _ingest_run(con, runs_dir, run_dir, options, report)
    finally:
        con.close()
    return report


@dataclass(frozen=True)
class _Options:
    force: bool
    window_steps: int | None
    complete_only: bool
    workers: int
    ray_address: str | None


def remove_run(runs_dir: Path, run_id: str) -> None:
    """Delete one run from the store: its rows and its windows (its own files are the
    caller's)."""
    runs_dir = Path(runs_dir)
    path = store.store_path(runs_dir)
    if not path.exists():
        return
    con = store.connect_writer(runs_dir)
    try:
        tables = {row[0] for row in con.execute("SHOW TABLES").fetchall()}
        store.define_shapes(con)  # what refresh_views reads
        con.execute("BEGIN TRANSACTION")
        for table in (*catalog.CATALOG_TABLES, "runs", "reports", "windows", "segments"):
            if table in tables:
                con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
        if "windows" in tables:
            catalog.refresh_views(con, runs_dir)
        con.execute("COMMIT")
    finally:
        con.close()
    shutil.rmtree(windows.run_windows_dir(windows.windows_root(runs_dir), run_id),
                  ignore_errors=True)  # fmt: skip


def _ingest_run(con, runs_dir: Path, run_dir: Path, options: _Options,
                report: IngestReport) -> None:  # fmt: skip
    try:
        _ingest_run_from(con, runs_dir, run_dir, options, report, union_by_name=False)
    except (duckdb.BinderException, duckdb.InvalidInputException):
        # Segments of differing schemas (a missing column or a schema mismatch in a list):
        # read them by name, slower. Any other problem raises again from this second try.
        try:
            _ingest_run_from(con, runs_dir, run_dir, options, report, union_by_name=True)
        except (duckdb.InvalidInputException, duckdb.IOException) as error:
            if str(run_dir) not in str(error):  # not about one of the run's own files
                raise
            raise segment_catalog.unreadable_segment(run_dir, error) from None


def _run_signature(run_dir: Path, segments) -> str:
    """Changes whenever a segment or run.json changes: a cheap 'needs ingest' test."""
    stat = (run_dir / "run.json").stat()
    parts = f"{segment_catalog.signature(segments)} {stat.st_size} {stat.st_mtime_ns}"
    return hashlib.sha1(parts.encode()).hexdigest()


@dataclass
class _RunPlan:
    """What one ingest of one run writes (_plan_run)."""

    signature: str
    window_steps: int
    todo: list[segment_catalog.WindowPlan]
    """The windows to write: new, changed, or all of them (forced, or a new window size)."""
    held_back: list[segment_catalog.WindowPlan]
    published: dict[int, int]
    """{window: generation} of the run's windows listed now."""
    replaced: set[int]
    """Listed windows the new ones replace."""
    record: dict
    """The run's run.json as the plan read it (its `runs` row is made from this one)."""

    @property
    def ended(self) -> bool:
        return self.record.get("status") in FINISHED_STATUSES

    @property
    def generation(self) -> int:
        """The generation of the windows written now: one past every earlier one."""
        return max(self.published.values(), default=-1) + 1


def _ingest_run_from(con, runs_dir: Path, run_dir: Path, options: _Options, report: IngestReport,
                     union_by_name: bool) -> None:  # fmt: skip
    run_id = run_dir.name
    done = _write_run(con, runs_dir, run_dir, options, union_by_name)
    if done is None:
        report.skipped.append(run_id)
        held = con.execute("SELECT segments_signature FROM runs WHERE run_id = ?", [run_id])
        if held.fetchall()[0][0].endswith(HELD):  # its last window still held back
            report.incomplete.append(run_id)
        return
    windows_written, held_back, counts = done
    if counts is None:  # complete_only: no window completed since its last ingest
        report.skipped.append(run_id)
        if held_back:
            report.incomplete.append(run_id)
        return
    # (the run's segment lists and plan are gone by now: the report's windows need the memory)
    _store_report(con, run_id, options)
    report.runs.append(run_id)
    report.windows += windows_written
    if held_back:
        report.incomplete.append(run_id)
    for rows in counts:
        for table, count in rows.items():
            report.rows[table] += count


def _write_run(con, runs_dir: Path, run_dir: Path, options: _Options, union_by_name: bool
               ) -> tuple[int, bool, list[dict[str, int]] | None] | None:  # fmt: skip
    """Write the run's windows that changed and publish them with its catalog rows: (windows
    written, whether some were held back, rows written per table of each window and of the
    catalog: None when nothing was published), or None when the run is unchanged since its
    last ingest."""
    run_id = run_dir.name
    segments = segment_catalog.refresh(con, run_dir, run_id)
    current = catalog.is_current(con, runs_dir)
    if not current:  # the tables' shapes come from the derivations over the run's rows
        _define_run_rows(con, run_dir, segments, union_by_name)
        catalog.ensure_schema(con, runs_dir)
    plan = _plan_run(con, run_dir, segments, options)
    if plan is None:
        return None
    if options.complete_only and not plan.todo and not plan.ended:
        # a run still going with no window completed since its last ingest (a segment or its
        # run.json changed): nothing to publish, no report to redo
        return 0, bool(plan.held_back), None
    if current:  # (a watch's ingest finds most runs unchanged: it reads nothing of theirs)
        _define_run_rows(con, run_dir, segments, union_by_name)
    root = windows.windows_root(runs_dir).resolve()
    rank_files = segment_catalog.files_of(segments, "rank")
    tasks = []
    for window in plan.todo:
        outputs = windows.window_files(root, run_id, window.window, plan.generation)
        tasks.append(window_writer.WindowTask(
            str(run_dir), window.first_step, window.end_step, window.files,
            {table: str(path) for table, path in outputs.items()}, rank_files, union_by_name,
        ))  # fmt: skip
    try:
        rows = window_writer.write_windows(con, tasks, options.workers, options.ray_address)
        written = {w.window: r for w, r in zip(plan.todo, rows, strict=True)}
        inserted = _publish(con, runs_dir, run_dir, plan, written)
    except BaseException:
        for window in plan.todo:  # the new generation's files, whole or not: listed nowhere
            _remove_generation(root, run_id, window.window, plan.generation)
        raise
    for window, generation in plan.published.items():
        if window in plan.replaced:
            _remove_generation(root, run_id, window, generation)
    return len(plan.todo), bool(plan.held_back), [*written.values(), inserted]


def _plan_run(con, run_dir: Path, segments, options: _Options) -> _RunPlan | None:
    """What to write of a run, or None when it is unchanged since its last ingest."""
    run_id = run_dir.name
    # the signature before the record: a run.json replaced in between makes the next ingest's
    # differ (the record is read once; the runs row is made from it, analysis/store.py)
    signature = _run_signature(run_dir, segments)
    record = json.loads((run_dir / "run.json").read_text())
    known = con.execute(
        "SELECT segments_signature, window_steps FROM runs WHERE run_id = ?", [run_id]
    ).fetchall()
    size = options.window_steps or (known[0][1] if known else None)
    size = size or windows.DEFAULT_WINDOW_STEPS
    # (a run whose last window was held back is unchanged for another complete_only ingest)
    unchanged = {signature, f"{signature}{HELD}"} if options.complete_only else {signature}
    if known and known[0][0] in unchanged and known[0][1] == size and not options.force:
        return None
    plans = segment_catalog.plan_windows(
        segments, size, ended=record.get("status") in FINISHED_STATUSES
    )
    listed = con.execute(
        "SELECT window_index, generation, signature FROM windows WHERE run_id = ?", [run_id]
    ).fetchall()
    published = {window: generation for window, generation, _ in listed}
    signatures = {window: signature_ for window, _, signature_ in listed}
    resized = bool(known) and known[0][1] != size
    held_back = [p for p in plans if options.complete_only and not p.complete]
    todo = [
        p for p in plans if p not in held_back and (
            options.force or resized or signatures.get(p.window) != p.signature)
    ]  # fmt: skip
    replaced = set(published) if resized else {p.window for p in todo} & set(published)
    return _RunPlan(signature, size, todo, held_back, published, replaced, record)


def _publish(con, runs_dir: Path, run_dir: Path, plan: _RunPlan,
             written: dict[int, dict[str, int]]) -> dict[str, int]:  # fmt: skip
    """List the windows written and replace the run's catalog rows, in one transaction; the
    catalog rows inserted per table."""
    run_id = run_dir.name
    con.execute("BEGIN TRANSACTION")
    try:
        inserted = _replace_catalog_rows(con, run_id)
        for window in plan.replaced:
            con.execute("DELETE FROM windows WHERE run_id = ? AND window_index = ?",
                        [run_id, window])  # fmt: skip
        for p in plan.todo:
            con.execute(
                "INSERT INTO windows VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [run_id, p.window, p.first_step, p.end_step, plan.generation, p.complete,
                 p.signature, catalog.schema_stamp(), sum(written[p.window].values()),
                 time.time()],
            )  # fmt: skip
        # a run with windows held back is not up to date: its next ingest writes them
        signature = f"{plan.signature}{HELD}" if plan.held_back else plan.signature
        row = store.run_row(run_dir, signature, plan.window_steps, plan.record)
        con.execute("DELETE FROM runs WHERE run_id = ?", [run_id])
        con.execute(f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                    list(row.values()))  # fmt: skip
        con.execute(  # the MFU denominator of the whole job, from the ranks' calibrations
            "UPDATE runs SET job_peak_flops = (SELECT max(job_peak_flops) FROM ranks "
            "WHERE run_id = $1) WHERE run_id = $1",
            [run_id],
        )
        catalog.refresh_views(con, runs_dir)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    return inserted


def _define_run_rows(con, run_dir: Path, segments, union_by_name: bool) -> None:
    """The run's rank and event rows (window_writer.load_run_rows), derivations over them."""
    rank_files = segment_catalog.files_of(segments, "rank")
    event_files = segment_catalog.files_of(segments, "events")
    window_writer.load_run_rows(con, run_dir, rank_files, event_files, union_by_name)
    store.define_sources(con, window_writer.RUN_SOURCES, union_by_name)
    store.define_steps(con, "SELECT * FROM derived_collectives")


def _replace_catalog_rows(con, run_id: str) -> dict[str, int]:
    """Replace the run's rows of the catalog tables (events, ranks, rank_attempts)."""
    inserted = {}
    for table in catalog.CATALOG_TABLES:
        con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
        result = con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM derived_{table}")
        inserted[table] = result.fetchone()[0]
    return inserted


def _remove_generation(root: Path, run_id: str, window: int, generation: int) -> None:
    for path in windows.window_files(root, run_id, window, generation).values():
        path.unlink(missing_ok=True)
    folder = windows.window_dir(root, run_id, window)
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def _store_report(con: duckdb.DuckDBPyConnection, run_id: str, options: _Options) -> None:
    """The run's diagnosis (analysis.run.report, its analysis windows where the windows are
    derived), computed once here so that readers find it ready; kept with the version of the
    analysis code that made it."""
    from ranktrace.analysis.run import analysis_version, report  # the facade reads the store

    try:
        result = report(con, run_id, options.workers, options.ray_address)
        text, error = json.dumps(result, default=_json_value), None
    except Exception as failure:  # a bug in an analyzer must not undo the ingest itself
        text, error = None, f"{type(failure).__name__}: {failure}"
    con.execute("DELETE FROM reports WHERE run_id = ?", [run_id])
    con.execute(
        "INSERT INTO reports VALUES (?, ?, ?, ?, ?)",
        [run_id, analysis_version(), text, error, time.time()],
    )


def _json_value(value):
    """numpy scalars as plain numbers (report dicts carry a few)."""
    return value.item() if hasattr(value, "item") else str(value)
