"""The DuckDB store `runs/ranktrace.duckdb`: ingest (the one writer) and sandboxed readers.

Ingest compacts each run's Parquet segments into tables `runs`, `ranks`, `steps`,
`span_records` (step and phase spans), `collectives`, `group_transfers` and `events` (the view
`spans` has every span), replacing that run's rows in one transaction, so ingesting twice never
duplicates anything. Readers never hold the file: they attach it read-only for one connection's
life, cannot write, and cannot read files outside the runs directory. A run still
in progress is read straight from its segments with the same derivations (`open_live`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from ranktrace.telemetry import names
from ranktrace.telemetry.schema import SCHEMAS

SQL_DIR = Path(__file__).with_name("sql")
TABLES = (
    "span_records",
    "collectives",
    "steps",
    "group_transfers",
    "events",
    "ranks",
    "attempt_steps",
)
"""The store's tables of telemetry, in insertion order (steps and group_transfers read the
stored collectives)."""
SOURCES = {"spans": "spans", "steps": "steps", "events": "events", "ranks": "rank"}
LOCK_RETRY_S = 30.0


class StoreError(RuntimeError):
    """A problem a user can fix (missing store, bad query); the message says how."""


def store_path(runs_dir: Path) -> Path:
    return Path(runs_dir) / names.STORE_FILE


def segment_files(run_dir: Path, kind: str) -> list[Path]:
    """Every finished segment of one kind, over all ranks (temporary files excluded)."""
    pattern = f"{names.TELEMETRY_DIR}/rank=*/{kind}-*.parquet"
    return sorted(run_dir.glob(pattern))


def _connect_with_retry(path: Path, read_only: bool) -> duckdb.DuckDBPyConnection:
    """DuckDB lets one process hold a file for writing; wait briefly for it to let go."""
    deadline = time.monotonic() + LOCK_RETRY_S
    while True:
        try:
            return duckdb.connect(str(path), read_only=read_only)
        except duckdb.IOException as error:
            if "lock" not in str(error).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _define_sources(con: duckdb.DuckDBPyConnection, run_dir: Path, union_by_name: bool) -> None:
    """Temporary views src_<table> over the run's segments (typed empty when none exist), and
    the derivations of 010_derived.sql over them.

    Segments written by one version of telemetry/schema.py share one schema; `union_by_name`
    also reads segments of differing versions (a run resumed by a newer ranktrace), at the cost
    of reading every file's footer each time a query binds a view.
    """
    for table, kind in SOURCES.items():
        if segment_files(run_dir, kind):
            # A glob, not a file list: it also sees segments written after this view was made.
            # `rank=RRRRR` folders would make DuckDB invent a VARCHAR `rank`: hive off.
            pattern = run_dir / names.TELEMETRY_DIR / "rank=*" / f"{kind}-*.parquet"
            source = (f"read_parquet('{pattern}', hive_partitioning = false, "
                      f"union_by_name = {union_by_name})")  # fmt: skip
            con.execute(f"CREATE OR REPLACE TEMP VIEW src_{table} AS SELECT * FROM {source}")
            _with_current_columns(con, table, kind, source, union_by_name)
        else:
            con.register(f"empty_{table}", pa.table(SCHEMAS[kind].empty_table()))
            con.execute(f"CREATE OR REPLACE TEMP VIEW src_{table} AS SELECT * FROM empty_{table}")
    _define_current(con)
    con.execute((SQL_DIR / "010_derived.sql").read_text())


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


def _define_current(con: duckdb.DuckDBPyConnection) -> None:
    """cur_spans / cur_steps: each step's rows from the latest attempt that recorded it. A run
    launched once (nearly all) skips the filtering join; every attempt whose telemetry started
    wrote a `rank` segment, so src_ranks says how many there were."""
    attempts = con.execute("SELECT count(DISTINCT attempt) FROM src_ranks").fetchone()[0]
    for table in ("spans", "steps"):
        if attempts <= 1:
            con.execute(f"CREATE OR REPLACE TEMP VIEW cur_{table} AS SELECT * FROM src_{table}")
            continue
        con.execute(
            f"CREATE OR REPLACE TEMP VIEW cur_{table} AS SELECT s.* FROM src_{table} s "
            "SEMI JOIN (SELECT run_id, step, max(attempt) AS attempt FROM src_steps "
            "GROUP BY ALL) latest USING (run_id, step, attempt)"
        )


def _run_row(run_dir: Path, signature: str) -> dict:
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
        "run_json": json.dumps(record),
    }  # fmt: skip


def _signature(run_dir: Path) -> str:
    """Changes whenever a segment or run.json changes: a cheap 'needs ingest' test."""
    files = [run_dir / "run.json", *sorted(run_dir.glob(f"{names.TELEMETRY_DIR}/rank=*/*.parquet"))]
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists()]
    return hashlib.sha1(repr(stats).encode()).hexdigest()


@dataclass
class IngestReport:
    """What one ingest did."""

    runs: list[str]
    skipped: list[str]
    rows: dict[str, int]


def _define_steps(con: duckdb.DuckDBPyConnection, run_collectives: str) -> None:
    """derived_steps over `run_collectives` (a relation holding this run's collectives)."""
    con.execute(f"CREATE OR REPLACE TEMP VIEW run_collectives AS {run_collectives}")
    con.execute((SQL_DIR / "011_steps.sql").read_text())


def _add_new_columns(con: duckdb.DuckDBPyConnection, table: str) -> None:
    """A store made by an older ranktrace gains the columns this version derives (NULL in the
    rows ingested before; `ranktrace ingest --force` fills them)."""
    stored = {row[0] for row in con.execute(f"DESCRIBE {table}").fetchall()}
    for name, kind, *_ in con.execute(f"DESCRIBE SELECT * FROM derived_{table}").fetchall():
        if name not in stored:
            con.execute(f'ALTER TABLE {table} ADD COLUMN "{name}" {kind}')


def _add_run_kind(con: duckdb.DuckDBPyConnection) -> None:
    """A `runs` table from before `ranktrace probe` gains `kind`, read from each run's run.json
    (`train` where it has none: trained or imported)."""
    if "kind" in {row[0] for row in con.execute("DESCRIBE runs").fetchall()}:
        return
    con.execute("ALTER TABLE runs ADD COLUMN kind VARCHAR")
    con.execute(
        "UPDATE runs SET kind = coalesce(json_extract_string(run_json, '$.kind'), ?)",
        [names.RUN_KIND_TRAIN],
    )


@functools.cache
def _schema_stamp() -> str:
    """Changes whenever this version's tables or views may: the SQL deriving them, the
    segment schemas and this module (whose DDL makes `runs` and `reports`)."""
    parts = [path.read_text() for path in sorted(SQL_DIR.glob("*.sql"))]
    parts += [repr(SCHEMAS), Path(__file__).read_text()]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


def _ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
    """Create or upgrade the store's tables and views to this version's shapes; skipped when
    the store's `store_schema` stamp says it is already there."""
    con.execute("CREATE TABLE IF NOT EXISTS store_schema (stamp VARCHAR)")
    stamp = _schema_stamp()
    if con.execute("SELECT count(*) FROM store_schema WHERE stamp = ?", [stamp]).fetchone()[0]:
        return
    for table in TABLES:
        # A store made by an older ranktrace may have had this relation as a view.
        view = con.execute(
            "SELECT count(*) FROM duckdb_views() WHERE view_name = ? AND NOT temporary", [table]
        ).fetchone()[0]
        if view:
            con.execute(f"DROP VIEW {table}")
        con.execute(f"CREATE TABLE IF NOT EXISTS {table} AS SELECT * FROM derived_{table} LIMIT 0")
        _add_new_columns(con, table)
    con.execute(
        "CREATE TABLE IF NOT EXISTS runs (run_id VARCHAR PRIMARY KEY, name VARCHAR, "
        "status VARCHAR, tp INTEGER, pp INTEGER, dp INTEGER, zero INTEGER, world_size INTEGER, "
        "model VARCHAR, n_params BIGINT, precision VARCHAR, steps INTEGER, steps_done INTEGER, "
        "global_batch INTEGER, micro_batches INTEGER, seq_len INTEGER, schedule VARCHAR, "
        "tokens_per_s DOUBLE, started_at DOUBLE, finished_at DOUBLE, error VARCHAR, "
        "host VARCHAR, job_peak_flops DOUBLE, segments_signature VARCHAR, ingested_at DOUBLE, "
        "run_json JSON, kind VARCHAR)"
    )
    _add_run_kind(con)
    con.execute(
        "CREATE TABLE IF NOT EXISTS reports (run_id VARCHAR PRIMARY KEY, "
        "analysis_version VARCHAR, report VARCHAR, error VARCHAR, computed_at DOUBLE)"
    )
    con.execute((SQL_DIR / "020_views.sql").read_text())
    con.execute("DELETE FROM store_schema")
    con.execute("INSERT INTO store_schema VALUES (?)", [stamp])


def ingest(runs_dir: Path, run_ids: list[str] | None = None, force: bool = False) -> IngestReport:
    """Compact runs (all under `runs_dir`, or `run_ids`) into the store; the one writer.

    A run whose segments and run.json did not change since its last ingest is skipped unless
    `force`. Each run is replaced in one transaction: ingesting twice never duplicates rows.
    """
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise StoreError(f"runs directory {runs_dir} does not exist; train a run first")
    run_dirs = sorted(p.parent for p in runs_dir.glob("*/run.json"))
    if run_ids is not None:
        unknown = set(run_ids) - {d.name for d in run_dirs}
        if unknown:
            raise StoreError(f"no run {sorted(unknown)} under {runs_dir}")
        run_dirs = [d for d in run_dirs if d.name in run_ids]
    report = IngestReport([], [], dict.fromkeys(TABLES, 0))
    con = _connect_with_retry(store_path(runs_dir), read_only=False)
    # Row order within a table carries no meaning here; not keeping it lets inserts run freely.
    con.execute("SET preserve_insertion_order = false")
    try:
        for run_dir in run_dirs:
            _ingest_run(con, run_dir, force, report)
    finally:
        con.close()
    return report


def remove_run(runs_dir: Path, run_id: str) -> None:
    """Delete every row of one run from the store (its files are the caller's)."""
    path = store_path(Path(runs_dir))
    if not path.exists():
        return
    con = _connect_with_retry(path, read_only=False)
    try:
        tables = {row[0] for row in con.execute("SHOW TABLES").fetchall()}
        con.execute("BEGIN TRANSACTION")
        for table in (*TABLES, "runs", "reports"):
            if table in tables:
                con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
        con.execute("COMMIT")
    finally:
        con.close()


def _ingest_run(con, run_dir: Path, force: bool, report: IngestReport) -> None:
    try:
        _ingest_run_from(con, run_dir, force, report, union_by_name=False)
    except (duckdb.BinderException, duckdb.InvalidInputException):
        # Segments of differing schemas (a missing column or a schema mismatch in the glob):
        # read them by name, slower. Any other problem raises again from this second try.
        _ingest_run_from(con, run_dir, force, report, union_by_name=True)


def _ingest_run_from(
    con, run_dir: Path, force: bool, report: IngestReport, union_by_name: bool
) -> None:
    run_id, signature = run_dir.name, _signature(run_dir)
    _define_sources(con, run_dir, union_by_name)
    # The stored collectives of this run, so the window over them is computed once.
    _define_steps(con, f"SELECT * FROM derived_collectives WHERE run_id = '{run_id}'")
    _ensure_schema(con)
    _define_steps(con, f"SELECT * FROM main.collectives WHERE run_id = '{run_id}'")
    known = con.execute("SELECT segments_signature FROM runs WHERE run_id = ?", [run_id]).fetchall()
    if known and known[0][0] == signature and not force:
        report.skipped.append(run_id)
        return
    con.execute("BEGIN TRANSACTION")
    try:
        for table in (*TABLES, "runs"):
            con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
        inserted = {}
        for table in TABLES:  # collectives before steps, which read them
            result = con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM derived_{table}")
            inserted[table] = result.fetchone()[0]
        row = _run_row(run_dir, signature)
        columns = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        con.execute(f"INSERT INTO runs ({columns}) VALUES ({marks})", list(row.values()))
        con.execute(  # the MFU denominator of the whole job, from the ranks' calibrations
            "UPDATE runs SET job_peak_flops = (SELECT max(job_peak_flops) FROM ranks "
            "WHERE run_id = $1) WHERE run_id = $1",
            [run_id],
        )
        con.execute("COMMIT")
    except Exception:
        con.execute("ROLLBACK")
        raise
    _store_report(con, run_id)
    report.runs.append(run_id)
    for table, count in inserted.items():
        report.rows[table] += count


def _store_report(con: duckdb.DuckDBPyConnection, run_id: str) -> None:
    """The run's diagnosis (analysis.run.report), computed once here so that readers find it
    ready; kept with the version of the analysis code that made it."""
    from ranktrace.analysis.run import analysis_version, report  # the facade reads this module too

    try:
        text, error = json.dumps(report(con, run_id), default=_json_value), None
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


def _sandbox(con: duckdb.DuckDBPyConnection, runs_dir: Path) -> None:
    """No writes outside memory, no files outside runs_dir, and no way to undo either."""
    allowed = str(Path(runs_dir).resolve())
    con.execute(f"SET allowed_directories = ['{allowed}']")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def _is_current(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the attached `store` carries this version's schema stamp."""
    stamped = con.execute(
        "SELECT count(*) FROM duckdb_tables() "
        "WHERE database_name = 'store' AND table_name = 'store_schema'"
    ).fetchone()[0]
    return bool(stamped) and bool(
        con.execute(
            "SELECT count(*) FROM store.store_schema WHERE stamp = ?", [_schema_stamp()]
        ).fetchone()[0]
    )


def _upgrade(path: Path) -> None:
    """Give a store made by an older ranktrace this version's tables and views (new columns
    NULL in the rows already there): the analysis reads columns an older store's views lack."""
    con = _connect_with_retry(path, read_only=False)
    try:
        _define_sources(con, path.parent / "(no run)", union_by_name=False)  # typed, empty
        _define_steps(con, "SELECT * FROM derived_collectives")
        _ensure_schema(con)
    finally:
        con.close()


def _attach_read_only(con: duckdb.DuckDBPyConnection, path: Path) -> None:
    """ATTACH the store as `store`, waiting briefly for a writer to let go of it."""
    deadline = time.monotonic() + LOCK_RETRY_S
    while True:
        try:
            con.execute(f"ATTACH '{path}' AS store (READ_ONLY)")
            return
        except duckdb.IOException as error:
            if "lock" not in str(error).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def open_reader(runs_dir: Path) -> duckdb.DuckDBPyConnection:
    """A sandboxed connection over the store, attached read-only (a store of an older
    ranktrace is upgraded first). Close it soon after use."""
    path = store_path(runs_dir)
    if not path.exists():
        raise StoreError(
            f"no store at {path}; train a run (`ranktrace train`) or run `ranktrace ingest`"
        )
    con = duckdb.connect(":memory:")
    _attach_read_only(con, path)
    if not _is_current(con):
        con.execute("DETACH store")
        _upgrade(path)
        _attach_read_only(con, path)
    con.execute("USE store")
    _sandbox(con, runs_dir)
    return con


def open_live(runs_dir: Path, run_id: str) -> duckdb.DuckDBPyConnection:
    """A sandboxed in-memory connection whose `steps`, `collectives`, `spans`, `events`,
    `ranks` and `group_transfers` views read a (possibly running) run's segments as they are
    now; `runs` holds its run.json."""
    run_dir = Path(runs_dir) / run_id
    if not (run_dir / "run.json").exists():
        raise StoreError(f"no run {run_id} under {runs_dir}")
    con = duckdb.connect(":memory:")
    _define_sources(con, run_dir, union_by_name=True)  # any segments, a few per query
    _define_steps(con, "SELECT * FROM derived_collectives")
    for table in TABLES:
        con.execute(f"CREATE OR REPLACE TEMP VIEW {table} AS SELECT * FROM derived_{table}")
    row = _run_row(run_dir, signature="live")
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
