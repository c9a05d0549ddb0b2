"""Shared fixtures: running the real `ranktrace` CLI in a subprocess and reading its run."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launcher import LauncherService

REPO = Path(__file__).resolve().parents[1]
os.environ["RANKTRACE_SELF_CHECK"] = "strict"
"""Every report the suite makes, in this process, the launcher service or a job's subprocess,
fails when its numbers contradict each other (analysis/self_check.py)."""


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    runs_dir: Path

    def runs(self) -> list[dict]:
        """Every run.json under the runs dir (one per run started)."""
        return [json.loads(p.read_text()) for p in sorted(self.runs_dir.glob("*/run.json"))]

    def run(self) -> dict:
        (only,) = self.runs()
        return only


def cli_env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


LAUNCHER = LauncherService(REPO, cli_env())
"""The session's `ranktrace` commands run in this one launcher process (see `ranktrace` below
and tests/launcher_service.py); ended by pytest_sessionfinish."""


def pytest_sessionfinish(session, exitstatus) -> None:
    LAUNCHER.close()


PACE: list[float] = []
"""Seconds this machine's Python takes for 10M additions, measured as the session starts."""


def pytest_sessionstart(session) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: only the controller prints
        return
    started = time.perf_counter()
    total = 0
    for number in range(2_000_000):
        total += number
    PACE.append(5 * (time.perf_counter() - started))


def pytest_terminal_summary(terminalreporter) -> None:
    """This machine's pace, printed below the results (`-q` hides pytest's header), so that
    suite times on two VMs of one kind can be compared: CI ran this suite in 528-613 s at
    three stops, 976 s at the next."""
    if PACE:
        terminalreporter.write_line(f"python pace: 10M additions in {PACE[0]:.2f} s")


SESSION_RUNS = ("flushing_run", "dash_runs_dir", "demo_run")
"""The session fixtures that train runs: the modules reading one share a worker (below)."""

LONGEST_FIRST = ("test_run_command.py", "test_dashboard.py", "test_multinode.py",
                 "test_stragglers.py", "test_fault_tolerance.py", "test_parity.py")  # fmt: skip
"""The modules that took longest (61% of the suite's 689 s, measured serially on 2026-12-06),
started first so that neither worker ends the session alone with one of them."""


def pytest_collection_modifyitems(config, items) -> None:
    """Tests reading the dashboard's or the demo's runs (trained by rank processes) are
    `multiprocess`, like the modules marked so; `make test-fast` leaves them out. The modules
    of LONGEST_FIRST's groups run first (the order is kept within a group)."""
    for item in items:
        if {"dash_runs_dir", "demo_run"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multiprocess)
    group = worker_groups()
    first = {}  # group -> where its first module stands in LONGEST_FIRST, else after them
    for index, name in enumerate(LONGEST_FIRST):
        first.setdefault(group.get(name, name), index)
    items.sort(key=lambda item: first.get(group.get(item.path.name, item.path.name),
                                          len(LONGEST_FIRST)))  # fmt: skip


def worker_groups() -> dict[str, str]:
    """Test module file name -> its worker group under `pytest -n 2` (`make test`): a
    module is its own group, and the modules whose source names one of SESSION_RUNS join one
    group, so that a session's runs, like a module's fixtures, are built by one worker, never
    twice. (Read from the sources: xdist's controller schedules without collecting, and its
    `xdist_group` marks are lost under pytest 9: every test still ran on either worker.)"""
    group: dict[str, str] = {}
    for fixture in SESSION_RUNS:
        readers = [p.name for p in sorted(Path(__file__).parent.glob("test_*.py"))
                   if fixture in p.read_text()]  # fmt: skip
        joined = {group.get(name, name) for name in readers}  # groups already formed
        into = min(joined, default="")
        for name, current in [*group.items(), *((r, r) for r in readers)]:
            if current in joined:
                group[name] = into
    return group


def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N`: whole groups of `worker_groups` to a worker, longest first."""
    from xdist.scheduler import LoadScopeScheduling

    groups = worker_groups()

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return groups.get(Path(module).name, module)

    return GroupScheduling(config, log)


def ranktrace(*args: str, runs_dir: Path, timeout: float = 300, cwd: Path = REPO,
              new_process: bool = False) -> CliResult:  # fmt: skip
    """Run `ranktrace ARGS` (`--runs-dir RUNS_DIR` added for `train`) in `cwd` as a user
    would; wait.

    Commands run in the session's launcher process (`app.cli.main`, the code the `ranktrace`
    command runs, without a new interpreter importing torch, DuckDB and the analysis: about
    1 s saved a command, 3 s a job); `new_process` runs one in a new interpreter instead.
    A job's ranks start in the directory the launcher's rank forkserver started in, so give
    `train` an absolute `--runs-dir` (`runs_dir` is one)."""
    argv = [*args, "--runs-dir", str(runs_dir)] if args and args[0] == "train" else list(args)
    if not new_process:
        return CliResult(*LAUNCHER.run(argv, timeout, cwd), runs_dir)
    proc = subprocess.run([sys.executable, "-m", "ranktrace.app.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, env=cli_env(), cwd=cwd)  # fmt: skip
    return CliResult(proc.returncode, proc.stdout, proc.stderr, runs_dir)


def ranktrace_in_process(*args: str, runs_dir: Path) -> CliResult:
    """`ranktrace ARGS` (`--runs-dir RUNS_DIR` added for `train`) through `app.cli.main` in this
    process, for commands that end before any job starts (usage errors, refused resumes): the
    code a user's command runs, without ~2 s of a new interpreter importing torch. Output is
    captured; a SystemExit becomes the return code."""
    from ranktrace.app.cli import main

    argv = [*args, "--runs-dir", str(runs_dir)] if args and args[0] == "train" else list(args)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
    return CliResult(code, stdout.getvalue(), stderr.getvalue(), runs_dir)


def start_training(*args: str, runs_dir: Path) -> subprocess.Popen:
    """Start `ranktrace train ARGS --runs-dir RUNS_DIR` without waiting (output on stdout)."""
    argv = [sys.executable, "-m", "ranktrace.app.cli", "train", *args, "--runs-dir", str(runs_dir)]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(), cwd=REPO
    )


def wait_for(predicate, timeout: float, what: str):
    """Poll `predicate` until it returns something truthy (returned), or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


FLUSHING_RUN_STEPS = 25


@pytest.fixture(scope="session")
def flushing_run(tmp_path_factory) -> Path:
    """The folder of a 25-step dp 2 run whose ranks flush every 5 steps (segments of 5 steps):
    the windowed store's and Ray's tests ingest copies of it."""
    runs_dir = tmp_path_factory.mktemp("flushing") / "runs"
    result = ranktrace("train", "--dp", "2", "--steps", str(FLUSHING_RUN_STEPS), "--seq-len",
                       "32", "--flush-every", "5", runs_dir=runs_dir)  # fmt: skip
    assert result.returncode == 0, result.stderr
    (run_json,) = runs_dir.glob("*/run.json")
    return run_json.parent


def growing_copy(flushing_run: Path, runs_dir: Path, last_step: int) -> Path:
    """A copy of `flushing_run` under `runs_dir` as it stood when every rank had flushed up to
    `last_step`: still running."""
    import shutil

    import pyarrow.parquet as pq

    from ranktrace.analysis.store import segment_files
    from ranktrace.telemetry.run_record import write_run_json

    copy = runs_dir / flushing_run.name
    shutil.copytree(flushing_run, copy, dirs_exist_ok=True)
    for kind in ("steps", "spans"):
        for path in segment_files(copy, kind):
            if pq.read_table(path, columns=["step"])["step"].to_pylist()[0] > last_step:
                path.unlink()
    record = json.loads((copy / "run.json").read_text())
    write_run_json(copy, {**record, "status": "running"})
    return copy


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs"


DASH_STRAGGLER_RANK = 2
DASH_STRAGGLER_FROM = 4
"""The first step of `slow` whose compute is slowed (trainer/faults.py: active from it on)."""


@pytest.fixture(scope="session")
def dash_runs_dir(tmp_path_factory) -> Path:
    """Two real runs for the dashboard tests: `slow` (pp=2, dp=2, 20 steps) with a 3x compute
    straggler on rank 2 from step 4; `other` (tp=2, dp=2, 6 steps, a checkpoint every 3
    steps): a two-axis pair with it. (The demo's runs, `demo_run`, serve the one-axis sweep.)"""
    runs_dir = tmp_path_factory.mktemp("dash") / "runs"
    fault = f"compute:rank={DASH_STRAGGLER_RANK},factor=3,from={DASH_STRAGGLER_FROM}"
    straggler = ("--pp", "2", "--dp", "2", "--steps", "20", "--run-name", "slow",
                 "--inject", fault)  # fmt: skip
    other = ("--tp", "2", "--dp", "2", "--steps", "6", "--run-name", "other",
             "--checkpoint-every", "3")  # fmt: skip
    for args in (straggler, other):
        result = ranktrace("train", *args, runs_dir=runs_dir)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return runs_dir


@dataclass
class DemoRun:
    """`ranktrace demo` as `make demo` runs it, in its own process, stopped with Ctrl-C once it
    serves the dashboard."""

    output: str
    """Everything it printed up to and with the dashboard's line."""
    after_ctrl_c: str
    """What it printed after SIGINT."""
    returncode: int
    runs_dir: Path
    """Its three runs, for the dashboard's pages (served again by the tests)."""


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> DemoRun:
    """The README's main job, once a session: its output checked by tests/test_demo.py, its
    runs looked at in the browser by tests/test_dashboard.py."""
    from tests.browser import free_port

    runs_dir = tmp_path_factory.mktemp("demo") / "runs"
    argv = [sys.executable, "-m", "ranktrace.app.cli", "demo", "--runs-dir", str(runs_dir),
            "--port", str(free_port())]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=cli_env(), cwd=REPO)  # fmt: skip
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ranktrace dashboard of"):
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return DemoRun("".join(lines), rest, proc.returncode, runs_dir)
