"""The windowed part of the store: each run's derived telemetry as Parquet, one folder per
window of steps, published whole and read in place through the catalog's views.

    runs/ranktrace.windows/run_id=<run>/window=<WWWWWW>/<table>-g<G>.parquet

A window holds steps [window × window_steps, (window + 1) × window_steps) of every rank, one
file per table of WINDOWED_TABLES. Its files are written under temporary names and renamed into
place, and a new version of a window (its segments changed: a resumed attempt redid its steps,
or it was the still-growing last window of a run) is a new generation G beside the old one, so a
reader never sees a half-written file. The catalog (`runs/ranktrace.duckdb`) lists the
published windows in `windows` and defines each table as a view over exactly their files: a
window becomes visible when the catalog commits it, and an older generation's files are
deleted after that.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI reads DEFAULT_WINDOW_STEPS without loading DuckDB
    import duckdb

WINDOWED_TABLES = ("span_records", "collectives", "steps", "group_transfers", "attempt_steps")
"""The store's per-step tables, kept as windows of Parquet (the others are catalog tables)."""
DEFAULT_WINDOW_STEPS = 100
"""Steps per window unless `ranktrace ingest --window` says otherwise: 8,192 ranks × 100 steps
is ~11 M collective rows, what one window's derivation holds in memory."""
ROOT_NAME = "ranktrace.windows"
PARTITION_TYPES = "{'run_id': VARCHAR, 'window': INTEGER}"


def windows_root(runs_dir: Path) -> Path:
    """The folder holding every run's windows (beside the catalog file)."""
    return Path(runs_dir) / ROOT_NAME


def run_windows_dir(root: Path, run_id: str) -> Path:
    return root / f"run_id={run_id}"


def window_dir(root: Path, run_id: str, window: int) -> Path:
    return run_windows_dir(root, run_id) / f"window={window:06d}"


def window_files(root: Path, run_id: str, window: int, generation: int) -> dict[str, Path]:
    """{table: the Parquet file of that table} of one generation of one window."""
    folder = window_dir(root, run_id, window)
    return {table: folder / f"{table}-g{generation}.parquet" for table in WINDOWED_TABLES}


def write_window(con: duckdb.DuckDBPyConnection, run_id: str, files: dict[str, Path],
                 relations: dict[str, Callable[[], str]]) -> dict[str, int]:  # fmt: skip
    """Write each table's relation (a function returning SQL naming this run's rows of one
    window, called just before its table is written) to its file in `files`, each under a
    temporary name first, then rename them all into place. A relation may read the tables
    written before it, through the temporary views `written_<table>`. Returns the rows written
    per table. `run_id` is left out of the files: the folder names it (run_id=...)."""
    folder = next(iter(files.values())).parent
    folder.mkdir(parents=True, exist_ok=True)
    temporary = {t: p.with_name(f".{p.name}.{os.getpid()}.tmp") for t, p in files.items()}
    rows = {}
    try:
        for table, path in temporary.items():
            relation = relations[table]()
            result = con.execute(f"COPY (SELECT * EXCLUDE (run_id) FROM {relation}) TO '{path}' "
                                 "(FORMAT parquet, COMPRESSION zstd)")  # fmt: skip
            rows[table] = int(result.fetchone()[0])
            con.execute(f"CREATE OR REPLACE TEMP VIEW written_{table} AS "
                        f"SELECT '{run_id}' AS run_id, * FROM read_parquet('{path}')")  # fmt: skip
        for table, path in files.items():
            temporary[table].rename(path)
    except BaseException:
        for path in temporary.values():
            path.unlink(missing_ok=True)
        raise
    return rows


def typed_empty(con: duckdb.DuckDBPyConnection, relation: str) -> str:
    """A SELECT of no rows with the columns and types of `relation` (a view of this connection),
    standing alone (a persistent view may not name a temporary one)."""
    columns = con.execute(f"DESCRIBE SELECT * FROM {relation}").fetchall()
    casts = ", ".join(f'CAST(NULL AS {kind}) AS "{name}"' for name, kind, *_ in columns)
    return f"SELECT {casts} WHERE false"


def define_views(con: duckdb.DuckDBPyConnection, files: dict[str, list[Path]],
                 shapes: dict[str, str], by_name: bool) -> None:  # fmt: skip
    """(Re)define each windowed table as a view over `files[table]` (the published windows'
    files), with the columns of `shapes[table]` (typed_empty): columns a file lacks (written by
    an older ranktrace, `by_name`) read as NULL. `run_id` comes from the file's folder, whose
    name also lets a `WHERE run_id = ...` skip every other run's files unopened."""
    for table in WINDOWED_TABLES:
        paths = sorted(str(path) for path in files.get(table, []))
        body = shapes[table]
        if paths:
            listed = ", ".join(f"'{path}'" for path in paths)
            body += (
                f' UNION ALL BY NAME SELECT * EXCLUDE ("window") FROM read_parquet([{listed}], '
                f"hive_partitioning = true, hive_types = {PARTITION_TYPES}, "
                f"union_by_name = {by_name})"
            )
        con.execute(f"CREATE OR REPLACE VIEW {table} AS {body}")


MIN_ANALYSIS_STEPS = DEFAULT_WINDOW_STEPS
"""The report diagnoses a long run window by window (analysis/window_report.py), each analysis
window holding about this many recorded steps at least (a store of 10-step windows, `ranktrace
watch`'s, is analysed 100 steps at a time)..."""
ANALYSIS_RANK_STEPS = 1 << 19
"""...or this many rank-steps (1,024 ranks × 512 steps: ~0.4 GB at the diagnosis' peak),
whichever is more. The run's recorded steps are shared out evenly among as many analysis
windows as that makes, so that the largest, which sets the report's peak memory, is as small as
the others (a run of 5,000 steps is not analysed 600 at a time with 800 at its end)."""


@dataclass
class AnalysisSpan:
    """Consecutive published windows of one run, diagnosed together."""

    first_step: int
    end_step: int
    steps: int = 0
    """The steps the run recorded in [first_step, end_step)."""
    files: dict[str, list[Path]] = field(default_factory=dict)
    """{table: its files in these windows}."""
    by_name: bool = False
    """Some file was written by an older ranktrace: read by column name."""
    windows: list[tuple[int, int, str, str]] = field(default_factory=list)
    """(window, generation, stamp, its segments' signature) of each stored window it holds."""
    closed: bool = True
    """False for a live run's last analysis window, still short of its target: it grows."""


def analysis_target(ranks: int) -> int:
    """The recorded steps an analysis window of a run of `ranks` ranks holds at least."""
    return max(MIN_ANALYSIS_STEPS, ANALYSIS_RANK_STEPS // max(1, ranks))


def stored_root(con: duckdb.DuckDBPyConnection) -> Path | None:
    """The windows' folder of the store `con` reads; None without one (a live run read from
    its segments, an analysis window's own connection)."""
    import duckdb

    try:
        (root,) = con.execute("SELECT windows_root FROM store_schema").fetchone()
    except duckdb.CatalogException:
        return None
    return Path(root)


def analysis_spans(con: duckdb.DuckDBPyConnection, run_id: str, ranks: int,
                   live: bool = False) -> list[AnalysisSpan]:  # fmt: skip
    """The analysis windows of a run of `ranks` ranks, in step order (analysis_target),
    counted in the steps the run recorded (a trace of every 30th step holds 3 in a window of
    100 step numbers); empty for a run that fits in one, and for a connection with no
    published windows (a live run read from its segments).

    A run that has ended shares its recorded steps out evenly. A `live` one (still training,
    growing a window at a time) closes each analysis window at the first stored window where it
    reaches the target and keeps the rest open, so that a closed one stays as it is while the
    run grows (analysis/part_cache.py keeps its diagnosis)."""
    import numpy as np

    from ranktrace.analysis.catalog import schema_stamp

    root = stored_root(con)
    if root is None:
        return []
    published = con.execute(
        "SELECT window_index, first_step, end_step, generation, stamp, signature FROM windows "
        "WHERE run_id = ? ORDER BY window_index", [run_id],
    ).fetchall()  # fmt: skip
    target = analysis_target(ranks)
    if not published or round((published[-1][2] - published[0][1]) / target) <= 1:
        return []  # one analysis window at most, whatever steps were recorded
    recorded = np.array([step for (step,) in con.execute(
        "SELECT DISTINCT step FROM steps WHERE run_id = ? ORDER BY step", [run_id]
    ).fetchall()], dtype=np.int64)  # fmt: skip
    ends = np.array([end for _, _, end, *_ in published])
    before = np.searchsorted(recorded, ends)  # recorded steps before each window's end
    if live:
        stops = _live_stops(before, target)
    else:
        count = round(len(recorded) / target)
        if count <= 1:
            return []
        # each analysis window closes at the stored window where the run's recorded steps pass
        # its even share of them
        closing = np.searchsorted(before, np.arange(1, count) * len(recorded) / count)
        stops = [*sorted(set(closing.tolist())), len(published) - 1]
    spans: list[AnalysisSpan] = []
    start = 0
    for stop in stops:
        chosen = published[start : stop + 1]
        if not chosen:
            continue
        span = AnalysisSpan(int(chosen[0][1]), int(chosen[-1][2]))
        span.steps = int(np.sum((recorded >= span.first_step) & (recorded < span.end_step)))
        for window, _, _, generation, stamp, signature in chosen:
            for table, path in window_files(root, run_id, window, generation).items():
                span.files.setdefault(table, []).append(path)
            span.by_name |= stamp != schema_stamp()
            span.windows.append((int(window), int(generation), stamp, signature))
        spans.append(span)
        start = stop + 1
    if live and spans:
        spans[-1].closed = before[-1] - (before[stops[-2]] if len(stops) > 1 else 0) >= target
    return spans if len(spans) > 1 else []


def _live_stops(before, target: int) -> list[int]:
    """The stored windows closing a live run's analysis windows: each where the recorded steps
    since the last one first reach `target`; the last stored window closes the open one."""
    stops, since = [], 0
    for index, count in enumerate(before.tolist()):
        if count - since >= target:
            stops.append(index)
            since = count
    if not stops or stops[-1] != len(before) - 1:
        stops.append(len(before) - 1)
    return stops


def view_shapes(con: duckdb.DuckDBPyConnection) -> dict[str, str]:
    """{table: typed_empty of its view} for each windowed table (define_views' `shapes`, for
    a connection of its own over some windows' files: analysis/window_report.py)."""
    return {table: typed_empty(con, table) for table in WINDOWED_TABLES}
