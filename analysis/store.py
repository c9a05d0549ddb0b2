"""The store's readers and the derivations they share with ingest (analysis/ingest.py).

The store is the catalog `runs/ranktrace.duckdb` (analysis/catalog.py) and the windows of
Parquet its per-step tables read (analysis/windows.py). Readers never hold the catalog: they
attach it read-only for one connection's life, cannot write, and cannot read files outside the
runs directory. A run still in progress is read straight from its segments with the same
derivations (`open_live`).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import duckdb
import pyarrow as pa

from ranktrace.analysis import catalog, windows
from ranktrace.analysis.catalog import SQL_DIR
from ranktrace.telemetry import names
from ranktrace.telemetry.schema import SCHEMAS

TABLES = (*windows.WINDOWED_TABLES, *catalog.CATALOG_TABLES)
"""The store's tables of telemetry (windowed ones are views over the windows' files)."""
T = TypeVar("T")
SOURCES = {"spans": "spans", "steps": "steps", "events": "events", "ranks": "rank"}
LOCK_RETRY_S = 30.0
SHORT_READ_TRIES = 3
SHORT_READ_PAUSE_S = 0.25
"""A read that met the catalog shorter than its own header said (DuckDB's `Could not read
enough bytes`) is made again on a fresh reader, this many times this far apart, before it is
reported: a live watch met one as the run's own ingest ended (a tools/timing_loop.py run on
2026-12-07), on a store that read whole a moment later. A store truly cut short still fails,
~0.5 s later."""


class StoreError(RuntimeError):
    """A problem a user can fix (missing store, bad query); the message says how."""


def store_path(runs_dir: Path) -> Path:
    return Path(runs_dir) / names.STORE_FILE


def segment_files(run_dir: Path, kind: str) -> list[Path]:
    """Every finished segment of one kind, over all ranks (temporary files excluded)."""
    pattern = f"{names.TELEMETRY_DIR}/rank=*/{kind}-*.parquet"
    return sorted(run_dir.glob(pattern))


def store_problem(error: BaseException) -> StoreError | None:
    """The StoreError for a DuckDB error about the catalog file itself, wherever it was met,
    else None: not a DuckDB database (damaged, or another program's), cut short (a truncated
    file fails on the first block it lacks), or held by another process past LOCK_RETRY_S."""
    text = str(error).splitlines()[0] if str(error) else ""
    if not isinstance(error, duckdb.Error) or names.STORE_FILE not in text:
        return None
    if "lock" in text.lower():
        return StoreError(f"the store is held by another process ({text}); try again once it "
                          "is done")  # fmt: skip
    if "not a valid DuckDB database" in text:
        quoted = re.search(r'"([^"]+)"', text)
        path = quoted.group(1) if quoted else names.STORE_FILE
        return StoreError(f"{path} is not a DuckDB database (damaged, or another program's): "
                          "move it aside and run `ranktrace ingest` to rebuild the store from "
                          "the runs' segments")  # fmt: skip
    return StoreError(f"the store cannot be read ({text}): move {names.STORE_FILE} aside and "
                      "run `ranktrace ingest` to rebuild it from the runs' segments")  # fmt: skip


def _retry_on_lock(open_store, deadline: float):
    """`open_store()`, again while another process holds the catalog (until `deadline`); any
    other problem with the catalog file is a StoreError (store_problem)."""
    while True:
        try:
            return open_store()
        except duckdb.IOException as error:
            if "lock" in str(error).lower() and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            problem = store_problem(error)
            if problem is None:
                raise
            raise problem from None


def _connect_with_retry(path: Path, read_only: bool) -> duckdb.DuckDBPyConnection:
    """DuckDB lets one process hold a file for writing; wait briefly for it to let go."""
    return _retry_on_lock(lambda: duckdb.connect(str(path), read_only=read_only),
                          time.monotonic() + LOCK_RETRY_S)  # fmt: skip


def connect_writer(runs_dir: Path) -> duckdb.DuckDBPyConnection:
    """The one writable connection to the catalog (ingest's), waiting for another to let go."""
    con = _connect_with_retry(store_path(runs_dir), read_only=False)
    # Row order within a table carries no meaning here; not keeping it lets inserts run freely.
    con.execute("SET preserve_insertion_order = false")
    # Each segment and window file is read once or twice, from the OS's page cache; DuckDB's own
    # cache of them grew the process by ~3 MiB per window derived (1,024 ranks).
    con.execute("SET enable_external_file_cache = false")
    return con


def glob_source(run_dir: Path, kind: str, union_by_name: bool) -> str | None:
    """A read of every segment of one kind of a run, as a glob (it also sees segments written
    after a view over it was made), or None when there is none."""
    if not segment_files(run_dir, kind):
        return None
    # `rank=RRRRR` folders would make DuckDB invent a VARCHAR `rank`: hive off.
    pattern = run_dir / names.TELEMETRY_DIR / "rank=*" / f"{kind}-*.parquet"
    return (f"read_parquet('{pattern}', hive_partitioning = false, "
            f"union_by_name = {union_by_name})")  # fmt: skip


def files_source(paths: list[Path], union_by_name: bool,
                 steps: tuple[int, int] | None = None) -> str | None:  # fmt: skip
    """A read of these segment files (None when there are none), of steps [first, end) only
    when `steps` is given."""
    if not paths:
        return None
    listed = ", ".join(f"'{path}'" for path in paths)
    source = (f"read_parquet([{listed}], hive_partitioning = false, "
              f"union_by_name = {union_by_name})")  # fmt: skip
    if steps is not None:
        source = f"(SELECT * FROM {source} WHERE step >= {steps[0]} AND step < {steps[1]})"
    return source


def define_sources(con: duckdb.DuckDBPyConnection, sources: dict[str, str | None],
                   union_by_name: bool) -> None:  # fmt: skip
    """Temporary views src_<table> over `sources` ({table of SOURCES: a relation, or None for
    none: typed empty}), and the derivations of 010_derived.sql over them.

    Segments written by one version of telemetry/schema.py share one schema; `union_by_name`
    also reads segments of differing versions (a run resumed by a newer ranktrace), at the cost
    of reading every file's footer each time a query binds a view.
    """
    for table, kind in SOURCES.items():
        source = sources.get(table)
        if source is not None:
            con.execute(f"CREATE OR REPLACE TEMP VIEW src_{table} AS SELECT * FROM {source}")
            _with_current_columns(con, table, kind, source, union_by_name)
        else:
            con.register(f"empty_{table}", pa.table(SCHEMAS[kind].empty_table()))
            con.execute(f"CREATE OR REPLACE TEMP VIEW src_{table} AS SELECT * FROM empty_{table}")
    _define_current(con)
    con.execute((SQL_DIR / "010_derived.sql").read_text())


def _define_run_sources(con: duckdb.DuckDBPyConnection, run_dir: Path, union_by_name: bool) -> None:
    """define_sources over every segment of a run (globs)."""
    sources = {table: glob_source(run_dir, kind, union_by_name) for table, kind in SOURCES.items()}
    define_sources(con, sources, union_by_name)


def _with_current_columns(con: duckdb.DuckDBPyConnection, table: str, kind: str,
                          source: str, union_by_name: bool) -> None:  # fmt: skip
    """src_<table> with every column of this version's segment schema: NULL where segments
    predate a column (an older ranktrace), `attempt` 0. Read by position (not `union_by_name`),
    segments take the first one's columns: a missing one there may exist in the others, so that
    raises (the caller then reads by name)."""
    columns = {row[0] for row in con.execute(f"DESCRIBE src_{table}").fetchall()}
    missing = [name for name in SCHEMAS[kind].names if name not in columns]
    if missing and not union_by_name:
        raise duckdb.BinderException(f"{kind} segments without columns {missing}")
    if missing:
        con.register(f"empty_{table}", pa.table(SCHEMAS[kind].empty_table()))
        source = f"(SELECT * FROM {source} UNION ALL BY NAME SELECT * FROM empty_{table})"
    con.execute(
        f"CREATE OR REPLACE TEMP VIEW src_{table} AS "
        f"SELECT * REPLACE (coalesce(attempt, 0)::INTEGER AS attempt) FROM {source}"
    )


def launched_once(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the run of src_ranks has one attempt: every attempt whose telemetry started
    wrote a `rank` segment."""
    return con.execute("SELECT count(DISTINCT attempt) FROM src_ranks").fetchone()[0] <= 1


def _define_current(con: duckdb.DuckDBPyConnection) -> None:
    """cur_spans / cur_steps: each step's rows from the latest attempt that recorded it. A run
    launched once (nearly all) skips the filtering join."""
    for table in ("spans", "steps"):
        if launched_once(con):
            con.execute(f"CREATE OR REPLACE TEMP VIEW cur_{table} AS SELECT * FROM src_{table}")
            continue
        con.execute(
            f"CREATE OR REPLACE TEMP VIEW cur_{table} AS SELECT s.* FROM src_{table} s "
            "SEMI JOIN (SELECT run_id, step, max(attempt) AS attempt FROM src_steps "
            "GROUP BY ALL) latest USING (run_id, step, attempt)"
        )


def run_row(run_dir: Path, signature: str, window_steps: int | None = None,
            record: dict | None = None) -> dict:  # fmt: skip
    """The `runs` row of a run, from its run.json (`record`: as read already)."""
    if record is None:
        record = json.loads((run_dir / "run.json").read_text())
    layout = record.get("layout", {})
    return {
        "run_id": record["run_id"], "name": record.get("name"), "status": record.get("status"),
        "tp": layout.get("tp"), "pp": layout.get("pp"), "dp": layout.get("dp"),
        "zero": layout.get("zero"), "world_size": record.get("world_size"),
        "model": record.get("model"), "n_params": record.get("n_params"),
        "precision": record.get("precision"), "steps": record.get("steps"),
        "steps_done": len(record.get("losses", [])), "global_batch": record.get("global_batch"),
        "micro_batches": record.get("micro_batches"), "seq_len": record.get("seq_len"),
        "schedule": record.get("schedule"), "tokens_per_s": record.get("tokens_per_s"),
        "started_at": record.get("started_at"), "finished_at": record.get("finished_at"),
        "error": record.get("error"), "host": record.get("host"),
        "kind": record.get("kind", names.RUN_KIND_TRAIN),
        "segments_signature": signature, "ingested_at": time.time(),
        "run_json": json.dumps(record), "window_steps": window_steps,
    }  # fmt: skip


def define_steps(con: duckdb.DuckDBPyConnection, run_collectives: str) -> None:
    """derived_steps over `run_collectives` (a relation holding this run's collectives)."""
    con.execute(f"CREATE OR REPLACE TEMP VIEW run_collectives AS {run_collectives}")
    con.execute((SQL_DIR / "011_steps.sql").read_text())


def define_shapes(con: duckdb.DuckDBPyConnection) -> None:
    """The derivations over typed, empty sources: the tables' shapes, which the catalog's views
    are made from (`catalog.ensure_schema`, `catalog.refresh_views`) outside an ingest."""
    define_sources(con, {}, union_by_name=False)
    define_steps(con, "SELECT * FROM derived_collectives")


def _sandbox(con: duckdb.DuckDBPyConnection, runs_dir: Path) -> None:
    """No writes outside memory, no files outside runs_dir, and no way to undo either."""
    allowed = str(Path(runs_dir).resolve())
    con.execute(f"SET allowed_directories = ['{allowed}']")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def _upgrade(runs_dir: Path) -> None:
    """Give a store made by an older ranktrace (or moved with its runs folder) this version's
    tables and views: the analysis reads columns an older store's views lack."""
    con = connect_writer(runs_dir)
    try:
        define_shapes(con)
        catalog.ensure_schema(con, runs_dir)
    finally:
        con.close()


def _attach_read_only(con: duckdb.DuckDBPyConnection, path: Path) -> None:
    """ATTACH the store as `store`, waiting briefly for a writer to let go of it."""
    _retry_on_lock(lambda: con.execute(f"ATTACH '{path}' AS store (READ_ONLY)"),
                   time.monotonic() + LOCK_RETRY_S)  # fmt: skip


def open_reader(runs_dir: Path) -> duckdb.DuckDBPyConnection:
    """A sandboxed connection over the store, attached read-only (a store of an older
    ranktrace is upgraded first). Close it soon after use."""
    path = store_path(runs_dir)
    if not path.exists():
        raise StoreError(
            f"no store at {path}; train a run (`ranktrace train`) or run `ranktrace ingest`"
        )
    con = duckdb.connect(":memory:")
    try:
        _attach_read_only(con, path)
        if not catalog.is_current(con, runs_dir, database="store"):
            con.execute("DETACH store")
            _upgrade(runs_dir)
            _attach_read_only(con, path)
    except duckdb.Error as error:  # a catalog cut short fails on the first block it lacks
        con.close()
        problem = store_problem(error)
        if problem is None:
            raise
        raise problem from None
    con.execute("USE store")
    _sandbox(con, runs_dir)
    return con


def read_store(runs_dir: Path, read: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
    """`read(con)` over a fresh `open_reader` connection, closed after it; made again on a new
    one where it met the catalog cut short (SHORT_READ_TRIES), as a reader may while another
    process ends its ingest. Any other error, and the last try's, is raised as it was."""
    tries = 1
    while True:
        try:
            con = open_reader(runs_dir)
            try:
                return read(con)
            finally:
                con.close()
        except (duckdb.IOException, StoreError) as error:
            if tries == SHORT_READ_TRIES or not _short_read(error):
                raise
            tries += 1
            time.sleep(SHORT_READ_PAUSE_S)


def _short_read(error: BaseException) -> bool:
    """Whether `error` is a read of the catalog file that found fewer bytes than it asked."""
    text = str(error)
    return names.STORE_FILE in text and "Could not read" in text


def open_live(runs_dir: Path, run_id: str) -> duckdb.DuckDBPyConnection:
    """A sandboxed in-memory connection whose `steps`, `collectives`, `spans`, `events`,
    `ranks` and `group_transfers` views read a (possibly running) run's segments as they are
    now; `runs` holds its run.json."""
    run_dir = Path(runs_dir) / run_id
    if not (run_dir / "run.json").exists():
        raise StoreError(f"no run {run_id} under {runs_dir}")
    con = duckdb.connect(":memory:")
    _define_run_sources(con, run_dir, union_by_name=True)  # any segments, a few per query
    define_steps(con, "SELECT * FROM derived_collectives")
    for table in TABLES:
        con.execute(f"CREATE OR REPLACE TEMP VIEW {table} AS SELECT * FROM derived_{table}")
    row = run_row(run_dir, signature="live")
    con.register("live_run", pa.Table.from_pylist([row]))
    con.execute("CREATE OR REPLACE TEMP VIEW runs AS SELECT * FROM live_run")
    con.execute((SQL_DIR / "020_views.sql").read_text())
    _sandbox(con, runs_dir)
    return con


def check_read_only_query(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Allow exactly one SELECT (WITH ... SELECT included); anything else is a StoreError."""
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as error:
        raise StoreError(f"SQL does not parse: {str(error).splitlines()[0]}") from None
    if len(statements) != 1:
        raise StoreError(f"give exactly one SQL statement, not {len(statements)}")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise StoreError(f"only SELECT queries are allowed here, not {kind.name}")


def query(con: duckdb.DuckDBPyConnection, sql: str, max_rows: int | None = None):
    """Run one read-only SELECT; returns (column names, rows)."""
    check_read_only_query(con, sql)
    try:
        result = con.execute(sql)
        rows = result.fetchmany(max_rows) if max_rows else result.fetchall()
    except duckdb.Error as error:
        raise StoreError(f"query failed: {str(error).splitlines()[0]}") from None
    return [d[0] for d in result.description], rows
