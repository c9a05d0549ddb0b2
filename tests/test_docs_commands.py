"""The documentation is true: every SQL cookbook query answers its question on a real store,
docs/cli.md is what `--help` prints, and every `ranktrace` command in README.md and docs/ runs as
written (the cheap ones are run; training, sweeps and servers are parsed and validated)."""

from __future__ import annotations

import re
import shlex
import shutil

import pytest

from ranktrace.analysis.store import open_reader, query
from ranktrace.app.cli import build_parser
from ranktrace.app.cli_reference import render_reference
from ranktrace.trainer.cli_args import config_from_args
from tests.conftest import DASH_STRAGGLER_RANK, REPO, ranktrace

COOKBOOK = (REPO / "docs" / "sql_cookbook.md").read_text()
RECIPES = dict(re.findall(r"### (.+?)\n.*?```sql\n(.*?)```", COOKBOOK, flags=re.S))
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DOCUMENTS.remove(REPO / "docs" / "cli.md")  # help text, not commands
PLACEHOLDERS = {"RUN": "slow", "RUN_ID": "slow", "RUN_A": "slow", "RUN_B": "other"}
"""Example values for the upper-case placeholders some commands are written with."""
CHEAP = ("plan", "sql", "report", "compare", "export-trace", "ingest")
"""Commands run for real by the test; the others (train, demo, sweep, dash) are parsed."""


def _commands() -> list[tuple[str, str]]:
    """(document, command line) of every `ranktrace ...` line in a bash block."""
    found = []
    for path in DOCUMENTS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                command = line.split("#")[0].strip()
                if command.startswith("ranktrace "):
                    found.append((path.name, command))
    return found


COMMANDS = _commands()


@pytest.fixture(scope="module")
def store(dash_runs_dir):
    con = open_reader(dash_runs_dir)
    yield con
    con.close()


def test_the_cookbook_has_ten_or_more_recipes():
    assert len(RECIPES) >= 10


@pytest.mark.parametrize("title", sorted(RECIPES))
def test_recipe_answers_on_a_real_store(store, title):
    columns, rows = query(store, RECIPES[title])
    assert rows, title
    assert all(any(value is not None for value in row) for row in rows), title
    if title.startswith("Which rank do its data- and tensor-parallel peers wait for"):
        # The straggler's whole pipeline replica (dp=0: ranks 0 and 2) keeps its peers waiting.
        top_two = [dict(zip(columns, row, strict=True)) for row in rows[:2]]
        assert {(r["name"], r["last_rank"]) for r in top_two} == {("slow", 0), ("slow", 2)}
    if title.startswith("Is a rank slow in its own work"):
        assert rows[0][columns.index("rank")] == DASH_STRAGGLER_RANK
    if title.startswith("When did each injected fault start"):
        (row,) = rows
        assert row[columns.index("found_kind")] == "compute"
        assert row[columns.index("found_rank")] == str(DASH_STRAGGLER_RANK)


def test_cli_reference_is_what_help_prints():
    assert (REPO / "docs" / "cli.md").read_text() == render_reference(), (
        "docs/cli.md is stale: run `python -m ranktrace.app.cli_reference > docs/cli.md`"
    )


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 10
    assert {"quickstart.md", "training.md", "fault_tolerance.md"} <= {doc for doc, _ in COMMANDS}


@pytest.mark.parametrize("doc, command", COMMANDS, ids=[f"{d}:{c[:50]}" for d, c in COMMANDS])
def test_documented_command_runs_as_written(doc, command, dash_runs_dir, tmp_path):
    argv = shlex.split(command)[1:]
    filled = [PLACEHOLDERS.get(arg, arg) for arg in argv]
    args = build_parser().parse_args(filled)  # every command parses, templates included
    if args.command == "train" and not args.resume:
        config_from_args(args).validate()
    if args.command not in CHEAP or filled != argv:
        return  # parsed only: a long-running command, or one written with placeholders
    shutil.copytree(dash_runs_dir, tmp_path / "runs")
    result = ranktrace(*argv, runs_dir=tmp_path / "runs", cwd=tmp_path, timeout=120)
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, (
        f"{doc}: `{command}` failed:\n{result.stderr[-1500:]}"
    )
