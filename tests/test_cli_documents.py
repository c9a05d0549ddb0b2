"""A command asked for a document (`--json`, `--format csv|json`) prints exactly that one
document on stdout, for a program to read whole (`json.loads`, the csv module); its progress and
the trainer's step lines go to stderr. CASES must hold a case for every subcommand the parser
gives such an option; each runs the real command on one small real run."""

from __future__ import annotations

import argparse
import csv
import io
import json
from pathlib import Path

import pytest

from ranktrace.app.cli import build_parser
from tests.conftest import ranktrace

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)

DOCUMENT_OPTIONS = ("--json", "--format")
RUN = "slow"
TRAIN = ("--dp", "2", "--steps", "10", "--seq-len", "32", "--run-name", RUN,
         "--inject", "compute:rank=1,factor=3,from=2")  # fmt: skip
"""The cheapest run with a remedy `remedy --apply` can train (replace rank 1's host): 2 ranks,
9 steps after the warm-up step (a verdict takes 8), its 4 runs ~3 s each on 2 cores."""
RUNS_DIR = "RUNS_DIR"
"""Stands for the module's runs dir in CASES."""
RUNS_QUERY = "SELECT run_id, name FROM runs ORDER BY name"

CASES = {
    "report": [(("report", RUN, "--runs-dir", RUNS_DIR, "--json"), None)],
    "compare": [(("compare", RUN, RUN, "--runs-dir", RUNS_DIR, "--json"), None)],
    "plan": [(("plan", "--model", "small", "--gpus", "8", "--gpu-mem", "80", "--json"), None)],
    "sql": [(("sql", RUNS_QUERY, "--runs-dir", RUNS_DIR, "--format", "json"), None),
            (("sql", RUNS_QUERY, "--runs-dir", RUNS_DIR, "--format", "csv"), None)],
    "probe": [(("probe", "--nproc", "2", "--for", RUN, "--repeats", "2", "--pair-seconds", "0.05",
                "--runs-dir", RUNS_DIR, "--json"), None)],
    "remedy": [(("remedy", RUN, "--runs-dir", RUNS_DIR, "--json"), None),
               (("remedy", RUN, "--apply", "--runs-dir", RUNS_DIR, "--json"),
                "== ranktrace remedy: training")],
}  # fmt: skip
"""Subcommand -> its cases: (arguments, the start of its progress lines on stderr, or None)."""


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


ALL_CASES = [pytest.param(args, progress, id=" ".join(args).replace(RUNS_QUERY, "QUERY"))
             for cases in CASES.values() for args, progress in cases]  # fmt: skip


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    """A runs dir holding the run TRAIN (its remedy's 4 runs join it)."""
    runs_dir = tmp_path_factory.mktemp("documents") / "runs"
    trained = ranktrace("train", *TRAIN, runs_dir=runs_dir)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    return runs_dir


def test_every_subcommand_with_a_document_option_has_a_case():
    commands = _subcommands()
    with_documents = {name for name, sub in commands.items()
                      if _options(sub) & set(DOCUMENT_OPTIONS)}  # fmt: skip
    missing = sorted(with_documents - set(CASES))
    assert not missing, f"no case in CASES for {missing}: add one that asks each for a document"
    assert sorted(set(CASES) - with_documents) == [], "CASES names commands without --json"
    for cases in CASES.values():
        for args, _ in cases:
            assert set(args) & set(DOCUMENT_OPTIONS), f"{args} does not ask for a document"


@pytest.mark.parametrize(("args", "progress"), ALL_CASES)
def test_a_document_is_all_that_stdout_holds(runs_dir, args, progress):
    argv = [str(runs_dir) if arg == RUNS_DIR else arg for arg in args]

    result = ranktrace(*argv, runs_dir=runs_dir, timeout=120)

    assert result.returncode == 0, result.stderr[-2000:]
    if args[-1] == "csv":
        header, *rows = csv.reader(io.StringIO(result.stdout))
        assert header == ["run_id", "name"]
        assert rows and all(len(row) == len(header) for row in rows), result.stdout
        assert RUN in [name for _, name in rows]
    else:
        document = json.loads(result.stdout)  # fails on any line beside the document
        assert isinstance(document, dict | list) and document
    if progress:  # A B A B trained, their step lines (rank 0's, a child process) on stderr
        assert result.stderr.count(progress) == 4, result.stderr[-2000:]
        assert "loss" in result.stderr and "ms/step" in result.stderr
        assert document["settings"] == {"replace_rank": 1} and "measured_gain_pct" in document


def test_stdout_is_stdout_again_after_a_document_or_a_refusal(runs_dir):
    """The tests' launcher runs many commands in one process: descriptor 1 is put back."""
    runs = ("--runs-dir", str(runs_dir))
    refused = ranktrace("report", "no-such-run", *runs, "--json", runs_dir=runs_dir)
    assert refused.returncode == 2 and refused.stdout == "" and "error" in refused.stderr
    ranktrace("sql", RUNS_QUERY, *runs, "--format", "json", runs_dir=runs_dir)

    table = ranktrace("sql", RUNS_QUERY, *runs, runs_dir=runs_dir)

    assert table.returncode == 0 and "run_id" in table.stdout and "row" in table.stdout
    assert table.stderr == ""
