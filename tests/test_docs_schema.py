"""Every SQL example in docs/schema.md runs against a real store and returns rows, and every
table and column the document lists exists in that store."""

from __future__ import annotations

import re

import pytest

from ranktrace.analysis.store import open_reader, query
from tests.conftest import REPO

DOC = (REPO / "docs" / "schema.md").read_text()
EXAMPLES = re.findall(r"```sql\n(.*?)```", DOC, flags=re.S)
# Back-quoted words in the column lists that are values, not columns.
VALUE_WORDS = {
    "running",
    "completed",
    "failed",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "send",
    "recv",
    "send_recv",
    "tp",
    "pp",
    "dp",
    "world",
    "run_id",
    "run_json",
    "migrated",
    "rank",
}


TABLE_NAMES = {
    "runs",
    "ranks",
    "steps",
    "collectives",
    "spans",
    "span_records",
    "events",
    "step_stats",
    "step_breakdown",
    "group_transfers",
    "attempt_steps",
    "rank_attempts",
    "windows",
    "segments",
}


@pytest.fixture(scope="module")
def store(dash_runs_dir):
    """The dashboard's store (tests/conftest.py): three real runs, one with a straggler, one
    with checkpoints."""
    con = open_reader(dash_runs_dir)
    yield con
    con.close()


def test_the_document_has_examples():
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize("sql", EXAMPLES, ids=[f"example-{i}" for i in range(len(EXAMPLES))])
def test_example_query_returns_rows(store, sql):
    _, rows = query(store, sql)
    assert rows, sql
    assert all(any(value is not None for value in row) for row in rows)


def test_documented_columns_exist(store):
    for table in sorted(TABLE_NAMES - {"span_records"}):  # span_records is described in spans
        section = DOC.split(f"## `{table}`")[1].split("\n## ")[0]
        documented = set(re.findall(r"`([a-z_0-9]+)`", section)) - TABLE_NAMES
        actual = {row[0] for row in query(store, f"SELECT column_name FROM (DESCRIBE {table})")[1]}
        missing = documented - actual - VALUE_WORDS
        assert not missing, (table, missing)
