"""The catalog file `runs/ranktrace.duckdb`: its tables, its views over the published windows
(analysis/windows.py), and the upgrade of a store made by an older ranktrace.

Catalog tables: `runs`, `reports`, `ranks`, `rank_attempts`, `events`, `windows` (the
published windows), `segments` (analysis/segment_catalog.py) and `store_schema` (the stamp of
the version that shaped the store, and where its windows are). The per-step tables
(windows.WINDOWED_TABLES) are views over the windows' Parquet files. A store from before
windows held those as tables: its rows move into windows of DEFAULT_WINDOW_STEPS, unchanged.

Every function here needs the temporary views derived_* of 010_derived.sql and 011_steps.sql
(their columns are the tables' columns).
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import time
from pathlib import Path

import duckdb

from ranktrace.analysis import windows
from ranktrace.telemetry.schema import SCHEMAS

SQL_DIR = Path(__file__).with_name("sql")
CATALOG_TABLES = ("events", "ranks", "rank_attempts")
"""Per-run tables kept in the catalog itself (small: no step dimension, or few rows)."""
MIGRATED = "migrated"
"""The `windows.stamp` of a window moved out of an older store's table: its files may lack
columns this version derives (read as NULL until `ranktrace ingest --force`)."""


@functools.cache
def schema_stamp() -> str:
    """Changes whenever this version's tables or views may: the SQL deriving them, the
    segment schemas and the modules making the catalog and the windows."""
    parts = [path.read_text() for path in sorted(SQL_DIR.glob("*.sql"))]
    parts += [repr(SCHEMAS), Path(__file__).read_text(), Path(windows.__file__).read_text()]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


def is_current(con: duckdb.DuckDBPyConnection, runs_dir: Path, database: str | None = None) -> bool:
    """Whether the catalog `database` (the connection's own by default) carries this version's
    stamp and its views read the windows where they are now (a moved runs folder needs its
    views pointed again)."""
    database = database or con.execute("SELECT current_database()").fetchall()[0][0]
    stamped = con.execute(
        "SELECT count(*) FROM duckdb_columns() WHERE database_name = ? "
        "AND table_name = 'store_schema' AND column_name = 'windows_root'", [database],
    ).fetchall()[0][0]  # fmt: skip
    if not stamped:
        return False
    return bool(
        con.execute(
            f'SELECT count(*) FROM "{database}".store_schema WHERE stamp = ? AND windows_root = ?',
            [schema_stamp(), str(windows.windows_root(runs_dir).resolve())],
        ).fetchall()[0][0]  # fetched to the end: DuckDB refuses a `register` beside a result
    )


def ensure_schema(con: duckdb.DuckDBPyConnection, runs_dir: Path) -> None:
    """Create or upgrade the catalog's tables and views to this version's shapes; nothing to do
    when `is_current`."""
    if is_current(con, runs_dir):
        return
    for table in CATALOG_TABLES:
        _drop_view(con, table)
        con.execute(f"CREATE TABLE IF NOT EXISTS {table} AS SELECT * FROM derived_{table} LIMIT 0")
        _add_new_columns(con, table)
    con.execute(
        "CREATE TABLE IF NOT EXISTS runs (run_id VARCHAR PRIMARY KEY, name VARCHAR, "
        "status VARCHAR, tp INTEGER, pp INTEGER, dp INTEGER, zero INTEGER, world_size INTEGER, "
        "model VARCHAR, n_params BIGINT, precision VARCHAR, steps INTEGER, steps_done INTEGER, "
        "global_batch INTEGER, micro_batches INTEGER, seq_len INTEGER, schedule VARCHAR, "
        "tokens_per_s DOUBLE, started_at DOUBLE, finished_at DOUBLE, error VARCHAR, "
        "host VARCHAR, job_peak_flops DOUBLE, segments_signature VARCHAR, ingested_at DOUBLE, "
        "run_json JSON, kind VARCHAR, window_steps INTEGER)"
    )
    _add_column(con, "runs", "kind", "VARCHAR",
                "coalesce(json_extract_string(run_json, '$.kind'), 'train')")  # fmt: skip
    _add_column(con, "runs", "window_steps", "INTEGER", str(windows.DEFAULT_WINDOW_STEPS))
    con.execute(
        "CREATE TABLE IF NOT EXISTS reports (run_id VARCHAR PRIMARY KEY, "
        "analysis_version VARCHAR, report VARCHAR, error VARCHAR, computed_at DOUBLE)"
    )
    con.execute(
        "CREATE TABLE IF NOT EXISTS windows (run_id VARCHAR, window_index INTEGER, "
        "first_step BIGINT, end_step BIGINT, generation INTEGER, complete BOOLEAN, "
        "signature VARCHAR, stamp VARCHAR, rows BIGINT, published_at DOUBLE, "
        "PRIMARY KEY (run_id, window_index))"
    )
    _migrate_tables(con, runs_dir)
    refresh_views(con, runs_dir)
    con.execute((SQL_DIR / "020_views.sql").read_text())
    con.execute("DROP TABLE IF EXISTS store_schema")
    con.execute("CREATE TABLE store_schema (stamp VARCHAR, windows_root VARCHAR)")
    con.execute(
        "INSERT INTO store_schema VALUES (?, ?)",
        [schema_stamp(), str(windows.windows_root(runs_dir).resolve())],
    )


def refresh_views(con: duckdb.DuckDBPyConnection, runs_dir: Path) -> None:
    """Point each windowed table's view at exactly the windows `windows` lists."""
    root = windows.windows_root(runs_dir).resolve()
    published = con.execute(
        "SELECT run_id, window_index, generation, stamp FROM windows"
    ).fetchall()
    files: dict[str, list[Path]] = {table: [] for table in windows.WINDOWED_TABLES}
    for run_id, window, generation, _ in published:
        for table, path in windows.window_files(root, run_id, window, generation).items():
            files[table].append(path)
    shapes = {t: windows.typed_empty(con, f"derived_{t}") for t in windows.WINDOWED_TABLES}
    by_name = any(stamp != schema_stamp() for *_, stamp in published)
    windows.define_views(con, files, shapes, by_name)


def _drop_view(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """A store made by an older ranktrace may have had this relation as a view."""
    if con.execute(
        "SELECT count(*) FROM duckdb_views() WHERE view_name = ? AND NOT temporary "
        "AND database_name = current_database()", [name],
    ).fetchone()[0]:  # fmt: skip
        con.execute(f"DROP VIEW {name}")


def _add_new_columns(con: duckdb.DuckDBPyConnection, table: str) -> None:
    """A catalog table made by an older ranktrace gains the columns this version derives (NULL
    in the rows ingested before; `ranktrace ingest --force` fills them)."""
    stored = {row[0] for row in con.execute(f"DESCRIBE {table}").fetchall()}
    for name, kind, *_ in con.execute(f"DESCRIBE SELECT * FROM derived_{table}").fetchall():
        if name not in stored:
            con.execute(f'ALTER TABLE {table} ADD COLUMN "{name}" {kind}')


def _add_column(con: duckdb.DuckDBPyConnection, table: str, name: str, kind: str,
                value_sql: str) -> None:  # fmt: skip
    """Add a column an older store's table lacks, filled with `value_sql` in its rows."""
    if name in {row[0] for row in con.execute(f"DESCRIBE {table}").fetchall()}:
        return
    con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
    con.execute(f"UPDATE {table} SET {name} = {value_sql}")


def _base_table_exists(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return bool(
        con.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE table_name = ? AND NOT temporary "
            "AND database_name = current_database()",
            [name],
        ).fetchone()[0]
    )


def _migrate_tables(con: duckdb.DuckDBPyConnection, runs_dir: Path) -> None:
    """Move the rows of a store from before windows (WINDOWED_TABLES as tables) into windows of
    DEFAULT_WINDOW_STEPS steps, as they are (no segment is read again), then drop the tables."""
    old = [t for t in windows.WINDOWED_TABLES if _base_table_exists(con, t)]
    if not old:
        for table in windows.WINDOWED_TABLES:
            _drop_view(con, table)  # the older views over these tables, redefined after this
        return
    root = windows.windows_root(runs_dir).resolve()
    size = windows.DEFAULT_WINDOW_STEPS
    staging = root / f".migrating-{time.time_ns()}"
    staging.mkdir(parents=True)
    published: set[tuple[str, int]] = set()
    for table in old:
        target = staging / table
        con.execute(
            f'COPY (SELECT *, (step // {size})::INTEGER AS "window" FROM {table}) TO '
            f"'{target}' (FORMAT parquet, COMPRESSION zstd, PARTITION_BY (run_id, \"window\"))"
        )
        for path in sorted(target.glob("run_id=*/window=*/*.parquet")):
            run_id = path.parent.parent.name.split("=", 1)[1]
            window = int(path.parent.name.split("=", 1)[1])
            destination = windows.window_files(root, run_id, window, 0)[table]
            destination.parent.mkdir(parents=True, exist_ok=True)
            if destination.exists():  # DuckDB writes one file a partition (420 of 420 here)
                raise RuntimeError(f"{destination} exists: stopped before losing a row")
            path.rename(destination)
            published.add((run_id, window))
    shutil.rmtree(staging, ignore_errors=True)
    for run_id, window in published:
        for table, path in windows.window_files(root, run_id, window, 0).items():
            if not path.exists():  # a table with no rows in this window
                con.execute(f"COPY (SELECT * EXCLUDE (run_id) FROM derived_{table} LIMIT 0) "
                            f"TO '{path}' (FORMAT parquet)")  # fmt: skip
        con.execute(
            "INSERT OR REPLACE INTO windows VALUES (?, ?, ?, ?, 0, true, NULL, ?, NULL, ?)",
            [run_id, window, window * size, (window + 1) * size, MIGRATED, time.time()],
        )
    for table in old:
        con.execute(f"DROP TABLE {table}")
    for table in windows.WINDOWED_TABLES:
        _drop_view(con, table)
