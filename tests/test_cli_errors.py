"""Bad input to `ranktrace train` ends in one line naming the value and the valid choices, exit
code 2, before any rank process is spawned (no run directory appears). The cases call the CLI's
`main` in this process (the checks end before anything starts); two run as a user runs them,
in a new interpreter, to prove the same line reaches the terminal."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ranktrace, ranktrace_in_process

CASES = {
    "world size vs processes": (
        ("--tp", "2", "--pp", "2", "--dp", "2", "--nproc", "4"),
        ["tp*pp*dp = 2*2*2 = 8", "4 processes"],
    ),
    "heads not divisible by tp": (("--tp", "3"), ["tp=3", "n_heads=4", "[1, 2, 4]"]),
    "layers not divisible by pp": (("--pp", "3"), ["pp=3", "n_layers=4", "[1, 2, 4]"]),
    "global batch vs dp*micro-batches": (
        ("--dp", "2", "--micro-batches", "3", "--global-batch", "8"),
        ["--global-batch=8", "2*3 = 6", "[6, 12"],
    ),
    "unknown model": (("--model", "70b"), ["'70b'", "tiny", "small"]),
    "steps not positive": (
        (
            "--steps",
            "0",
        ),
        ["--steps=0"],
    ),
    "negative steps": (
        (
            "--steps",
            "-5",
        ),
        ["--steps=-5"],
    ),
    "unknown precision": (
        (
            "--precision",
            "fp8",
        ),
        ["fp8", "bf16", "fp32"],
    ),
    "not a number": (
        (
            "--tp",
            "two",
        ),
        ["--tp", "'two'"],
    ),
    "cuda without enough GPUs": (("--device", "cuda", "--dp", "2"), ["--device cuda", "2 GPUs"]),
    "sequence parallel needs divisible seq-len": (
        ("--tp", "2", "--sequence-parallel", "--seq-len", "33"),
        ["--seq-len=33", "tp=2"],
    ),
    "unknown fault kind": (("--inject", "gpu:rank=0"), ["'gpu'", "compute", "link"]),
    "fault field not a number": (
        ("--dp", "2", "--inject", "link:rank=1,delay=slow"),
        ["delay=slow", "not a number"],
    ),
    "fault missing a field": (("--inject", "pause:rank=0,every=3"), ["needs duration="]),
    "fault on a rank outside the job": (
        ("--dp", "2", "--inject", "compute:rank=5,factor=2"),
        ["rank=5", "0..1"],
    ),
    "fault with an unknown field": (
        ("--inject", "data:rank=0,delay=1,axis=tp"),
        ["data takes rank, delay, from, to", "'axis'"],
    ),
    "fault after the last step": (
        ("--steps", "5", "--inject", "crash:rank=0,step=9"),
        ["never reached", "--steps=5"],
    ),
    "stage layers not summing to the model": (
        ("--pp", "2", "--stage-layers", "3,2"),
        ["--stage-layers=3,2", "n_layers=4"],
    ),
    "stage layers for the wrong pp": (
        ("--pp", "2", "--stage-layers", "1,1,2"),
        ["3 stages", "pp=2"],
    ),
    "lengths longer than the sequence": (
        ("--seq-len-dist", "uniform:16,100"),
        ["--seq-len-dist=uniform:16,100", "MAX <= --seq-len=64"],
    ),
    "an unknown length distribution": (
        ("--seq-len-dist", "zipf:3"),
        ["'zipf'", "uniform:MIN,MAX"],
    ),
    "length buckets without lengths": (("--length-buckets", "4"), ["--seq-len-dist"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_train_input_is_one_line_exit_2_and_spawns_nothing(runs_dir, case):
    args, expected_fragments = CASES[case]
    result = ranktrace_in_process("train", *args, runs_dir=runs_dir)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ranktrace train: error:")
    for fragment in expected_fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert "Traceback" not in result.stderr + result.stdout
    assert not runs_dir.exists()  # nothing was launched


def test_an_unwritable_runs_dir_is_one_line_exit_2(tmp_path):
    result = ranktrace_in_process("train", "--steps", "2", runs_dir=Path("/proc/nope"))
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "--runs-dir /proc/nope cannot be created" in line and "writable" in line


def test_missing_command_is_one_line(runs_dir):
    result = ranktrace(runs_dir=runs_dir, timeout=60)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("case", ["world size vs processes", "fault on a rank outside the job"])
def test_bad_train_input_from_a_new_interpreter_is_the_same_one_line(runs_dir, case):
    args, expected_fragments = CASES[case]
    result = ranktrace("train", *args, runs_dir=runs_dir, timeout=60, new_process=True)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("ranktrace train: error:")
    assert all(fragment in line for fragment in expected_fragments), line
    assert "Traceback" not in result.stderr + result.stdout
    assert not runs_dir.exists()


def test_sql_without_a_store_says_how_to_make_one(tmp_path):
    result = ranktrace("sql", "SELECT 1", "--runs-dir", str(tmp_path), runs_dir=tmp_path)
    assert result.returncode == 2 and "ranktrace ingest" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


PROBE_CASES = {
    "message size not positive": (("--nproc", "2", "--bytes", "0"), ["--bytes 0", "positive"]),
    "repeats not positive": (("--nproc", "2", "--repeats", "0"), ["--repeats 0", "positive"]),
    "no ranks to measure between": ((), ["torchrun", "$(command -v ranktrace) probe", "--nproc"]),
    "one local rank": (("--nproc", "1"), ["--nproc N (N >= 2)"]),
    "unknown job run": (("--nproc", "2", "--for", "nosuch"), ["--for nosuch", "'nosuch'"]),
}


@pytest.mark.parametrize("case", list(PROBE_CASES))
def test_bad_probe_input_is_one_line_exit_2_and_starts_no_rank(runs_dir, case):
    args, expected_fragments = PROBE_CASES[case]
    result = ranktrace_in_process("probe", *args, "--runs-dir", str(runs_dir), runs_dir=runs_dir)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("ranktrace probe: error:")
    assert all(fragment in line for fragment in expected_fragments), line
    assert not runs_dir.exists()  # nothing was measured or stored


@pytest.mark.parametrize("command", [("ingest",), ("report", "any")])
def test_workers_below_one_is_one_line_exit_2(tmp_path, command):
    """`--workers 0` is refused before anything is read or written."""
    result = ranktrace_in_process(*command, "--workers", "0", "--runs-dir", str(tmp_path),
                                  runs_dir=tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"ranktrace {command[0]}: error:") and "--workers" in line, line
    assert not (tmp_path / "ranktrace.duckdb").exists()


@pytest.mark.parametrize("command", [("ingest",), ("report", "any"), ("sql", "SELECT 1")])
def test_a_store_that_is_not_a_duckdb_file_is_one_line_exit_2(tmp_path, command):
    """A damaged catalog (or another program's file of its name) says what to do about it."""
    damaged = b"not a duckdb file" * 300
    (tmp_path / "ranktrace.duckdb").write_bytes(damaged)
    result = ranktrace_in_process(*command, "--runs-dir", str(tmp_path), runs_dir=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "is not a DuckDB database" in line and "move it aside" in line, line
    assert (tmp_path / "ranktrace.duckdb").read_bytes() == damaged  # left as it was


@pytest.mark.parametrize("command", [("report", "any"), ("sql", "SELECT count(*) FROM steps")])
def test_a_truncated_store_is_one_line_exit_2(flushing_run, tmp_path, command):
    """A real store cut short (a disk that filled, a copy interrupted) fails on the first block
    it lacks, wherever the command meets it: one line, not a traceback."""
    import shutil

    runs_dir = tmp_path / "runs"
    shutil.copytree(flushing_run.parent, runs_dir)
    with open(runs_dir / "ranktrace.duckdb", "r+b") as store:
        store.truncate(12288)  # its headers, none of its blocks
    result = ranktrace_in_process(*command, "--runs-dir", str(runs_dir), runs_dir=runs_dir)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "the store cannot be read" in line and "move ranktrace.duckdb aside" in line, line
