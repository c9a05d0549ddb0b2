"""The store's promises: idempotent ingest, older segments and stores read, a read-only sandboxed
`ranktrace sql`, and the telemetry levels. (Crash safety and live readers: test_failures.py.)"""

from __future__ import annotations

import json
import shutil

import duckdb
import pyarrow.parquet as pq
import pytest

from ranktrace.analysis.ingest import ingest
from ranktrace.analysis.store import open_reader, query, segment_files
from ranktrace.analysis.windows import WINDOWED_TABLES
from tests.conftest import ranktrace

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("store") / "runs"
    result = ranktrace("train", "--dp", "2", "--steps", "3", "--seq-len", "32", runs_dir=runs_dir)
    assert result.returncode == 0, result.stderr
    return runs_dir


def _table_counts(runs_dir) -> dict:
    con = open_reader(runs_dir)
    try:
        return {
            table: query(con, f"SELECT count(*) FROM {table}")[1][0][0]
            for table in ("runs", "ranks", "steps", "spans", "collectives", "events")
        }
    finally:
        con.close()


def test_ingest_twice_never_duplicates_rows(small_store):
    before = _table_counts(small_store)
    assert before["steps"] == 6 and before["collectives"] > 0
    for _ in range(2):
        forced = ranktrace(
            "ingest", "--force", "--runs-dir", str(small_store), runs_dir=small_store
        )
        assert forced.returncode == 0, forced.stderr
        assert _table_counts(small_store) == before
        # each forced ingest wrote the window again and deleted the generation before it
        files = list(small_store.glob("ranktrace.windows/run_id=*/window=*/*.parquet"))
        assert len(files) == len(WINDOWED_TABLES), files
    unchanged = ranktrace("ingest", "--runs-dir", str(small_store), runs_dir=small_store)
    assert "ingested 0 run(s) (0 window(s) written), 1 unchanged" in unchanged.stdout


def test_ingest_reads_segments_of_an_older_schema(small_store, tmp_path):
    """A run whose segments differ in columns (resumed by another version) still ingests whole;
    the missing column reads as NULL."""
    (run_dir,) = (p.parent for p in small_store.glob("*/run.json"))
    copy = tmp_path / "runs" / run_dir.name
    shutil.copytree(run_dir, copy)
    older = segment_files(copy, "spans")[0]
    pq.write_table(pq.read_table(older).drop_columns(["dtype"]), older, compression="zstd")
    report = ingest(tmp_path / "runs")
    assert report.rows["collectives"] == _table_counts(small_store)["collectives"]
    con = open_reader(tmp_path / "runs")
    try:
        ((missing,),) = query(con, "SELECT count(*) FROM collectives WHERE dtype IS NULL")[1]
    finally:
        con.close()
    assert missing == pq.read_table(older, filters=[("name", "=", "ranktrace.collective")]).num_rows


def test_reading_a_store_of_an_older_version_upgrades_it_first(small_store, tmp_path):
    """A store whose view lacks a column the analysis reads (made by an older ranktrace) is
    upgraded when a reader opens it: the report works without an ingest."""
    runs_dir = tmp_path / "runs"
    shutil.copytree(small_store, runs_dir)
    con = duckdb.connect(str(runs_dir / "ranktrace.duckdb"))
    con.execute("CREATE OR REPLACE VIEW step_breakdown AS SELECT run_id, rank, step FROM steps")
    con.execute("UPDATE store_schema SET stamp = 'an older version'")
    (name,) = con.execute("SELECT name FROM runs").fetchone()
    con.close()
    result = ranktrace("report", name, "--runs-dir", str(runs_dir), "--json", runs_dir=runs_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["steps"] > 0


def _as_a_store_from_before_windows(runs_dir, dropped_column: str) -> None:
    """Turn a store into one an older ranktrace made: its per-step tables stored in the
    catalog itself (one column fewer in `steps`), no windows, no windows_root in its stamp."""
    con = duckdb.connect(str(runs_dir / "ranktrace.duckdb"))
    for table in WINDOWED_TABLES:
        con.execute(f"CREATE TABLE {table}_rows AS SELECT * FROM {table}")
        con.execute(f"DROP VIEW {table}")
        con.execute(f"ALTER TABLE {table}_rows RENAME TO {table}")
    con.execute(f"ALTER TABLE steps DROP COLUMN {dropped_column}")
    con.execute("DROP TABLE windows")
    con.execute("DROP TABLE store_schema")
    con.execute("CREATE TABLE store_schema AS SELECT 'an older version' AS stamp")
    con.close()
    shutil.rmtree(runs_dir / "ranktrace.windows")


def test_a_store_from_before_windows_keeps_its_rows_and_fills_new_columns_on_ingest(
    small_store, tmp_path
):
    """Reading an older store moves its tables' rows into windows as they are (the column it
    lacks reads NULL, its report still works); `ingest --force` then derives them again."""
    runs_dir = tmp_path / "runs"
    shutil.copytree(small_store, runs_dir)
    counts = _table_counts(small_store)
    _as_a_store_from_before_windows(runs_dir, "comm_transfer_s")
    (name,) = (p.parent.name for p in runs_dir.glob("*/run.json"))
    result = ranktrace("report", name, "--runs-dir", str(runs_dir), "--json", runs_dir=runs_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["steps"] > 0
    assert _table_counts(runs_dir) == counts
    filled_sql = "SELECT count(*), count(comm_transfer_s) FROM steps"
    reader = open_reader(runs_dir)
    try:
        assert query(reader, filled_sql)[1] == [(counts["steps"], 0)]
    finally:
        reader.close()
    assert not list(runs_dir.glob("ranktrace.windows/.migrating-*"))
    ingest(runs_dir, force=True)
    reader = open_reader(runs_dir)
    try:
        assert query(reader, filled_sql)[1] == [(counts["steps"], counts["steps"])]
        ((generations,),) = query(reader, "SELECT list(DISTINCT generation) FROM windows")[1]
    finally:
        reader.close()
    assert generations == [1]  # the migrated generation 0 was replaced, then deleted
    assert not list(runs_dir.glob("ranktrace.windows/*/*/*-g0.parquet"))


def _sql(runs_dir, query_text: str, *extra: str):
    return ranktrace("sql", query_text, "--runs-dir", str(runs_dir), *extra, runs_dir=runs_dir)


@pytest.mark.parametrize(
    "query_text, message",
    [
        ("DELETE FROM steps", "only SELECT"),
        ("COPY steps TO 'out.csv'", "only SELECT"),
        ("SELECT 1; SELECT 2", "exactly one SQL statement"),
        ("SELEC * FROM steps", "does not parse"),
        ("SELECT * FROM no_such_table", "query failed"),
        ("SELECT * FROM read_csv('/etc/passwd')", "query failed"),
        ("ATTACH '/tmp/other.duckdb' AS other", "only SELECT"),
    ],
)
def test_sql_refuses_writes_outside_files_and_bad_sql_in_one_line(small_store, query_text, message):
    result = _sql(small_store, query_text)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_sql_formats_csv_and_json(small_store):
    as_json = _sql(
        small_store,
        "SELECT rank, count(*) AS n FROM steps GROUP BY rank ORDER BY rank",
        "--format",
        "json",
    )
    assert json.loads(as_json.stdout) == [{"rank": 0, "n": 3}, {"rank": 1, "n": 3}]
    as_csv = _sql(
        small_store, "SELECT rank FROM steps WHERE step = 0 ORDER BY rank", "--format", "csv"
    )
    assert as_csv.stdout.split() == ["rank", "0", "1"]


def test_telemetry_levels_and_trace_every(tmp_path):
    off = ranktrace(
        "train", "--steps", "2", "--seq-len", "16", "--telemetry", "off", runs_dir=tmp_path / "off"
    )
    assert off.returncode == 0
    assert not (tmp_path / "off" / off.run()["run_id"] / "telemetry").exists()

    sampled = ranktrace(
        "train",
        "--dp",
        "2",
        "--steps",
        "4",
        "--seq-len",
        "16",
        "--trace-every",
        "2",
        runs_dir=tmp_path / "sampled",
    )
    assert sampled.returncode == 0
    con = open_reader(tmp_path / "sampled")
    try:
        traced = query(con, "SELECT DISTINCT step FROM collectives ORDER BY step")[1]
        split = query(
            con,
            "SELECT step, comm_blocking_s IS NOT NULL, comm_s > 0 FROM steps "
            "WHERE rank = 0 ORDER BY step",
        )[1]
    finally:
        con.close()
    assert traced == [(0,), (2,)]
    assert split == [(0, True, True), (1, False, True), (2, True, True), (3, False, True)]

    steps_only = ranktrace(
        "train",
        "--dp",
        "2",
        "--steps",
        "2",
        "--seq-len",
        "16",
        "--telemetry",
        "steps",
        runs_dir=tmp_path / "steps",
    )
    assert steps_only.returncode == 0
    con = open_reader(tmp_path / "steps")
    try:
        counts = query(
            con,
            "SELECT (SELECT count(*) FROM steps), "
            "(SELECT count(*) FROM collectives), "
            "(SELECT count(*) FROM spans WHERE name = 'ranktrace.phase')",
        )[1]
    finally:
        con.close()
    ((n_steps, n_collectives, n_phases),) = counts
    assert n_steps == 4 and n_collectives == 0 and n_phases > 0
