"""`ranktrace run [options] -- COMMAND...`: run a job ranktrace did not write, unchanged, and
record every rank of it.

COMMAND is the job's own launch line (`torchrun --nproc-per-node 4 train.py ...`, or `python
train.py`). ranktrace puts its startup hook first on the job's PYTHONPATH
(ranktrace/_startup/sitecustomize.py; telemetry/startup.py says what it does) and tells the job's
processes where to record through the environment (RANKTRACE_RUN_DIR, RANKTRACE_RUN_ID,
RANKTRACE_TELEMETRY, RANKTRACE_TRACE_EVERY). When the job ends, however it ends, run.json gets
its status and exit code and the run is ingested: `ranktrace report NAME`, the dashboard and SQL
work on it as on a trainer run. The command's exit code is ranktrace run's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import ranktrace
from ranktrace.app.jobs import runs_dir_problem
from ranktrace.telemetry import names
from ranktrace.telemetry.run_record import new_run_id, update_run_json, write_run_json

STARTUP_DIR = Path(ranktrace.__file__).parent / "_startup"


def add_run_parser(commands: argparse._SubParsersAction) -> None:
    """The `run` command and its options."""
    run = commands.add_parser(
        "run",
        help="run your own training job, unchanged, and record every rank",
        description="Run COMMAND (your job's launch line: `torchrun --nproc-per-node 4 train.py "
        "...` or `python train.py ...`) with every rank recorded from process start, no code "
        "change: steps (bounded by the optimizer's step), forward/backward/optimizer/data phases, "
        "every torch.distributed collective and point-to-point call (DDP's buckets, FSDP2's and "
        "DTensor's async work included) with its axis, memory and MFU. When the job ends the run "
        "is ingested: `ranktrace report NAME`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument("--name", default=None, help="the run's name (default: the run id)")
    run.add_argument("--runs-dir", default="runs", help="directory holding the runs and store")
    run.add_argument(
        "--telemetry", choices=(names.LEVEL_STEPS, names.LEVEL_COLLECTIVES),
        default=names.LEVEL_COLLECTIVES,
        help="steps: steps and phases only; collectives: every call too",
    )  # fmt: skip
    run.add_argument(
        "--trace-every", type=int, default=1, metavar="N",
        help="record calls one by one on every Nth step",
    )  # fmt: skip
    run.add_argument(
        "--peak-flops", type=float, default=0.0, metavar="FLOPS",
        help="peak FLOP/s of one rank's device, for MFU (0: the GPU's datasheet figure, or the "
        "host's peak measured once and stored in the runs dir's peaks.json)",
    )  # fmt: skip
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the job's launch line")
    run.set_defaults(handler=run_job, command_parser=run)


def _usage_error(args: argparse.Namespace, command: list[str]) -> str | None:
    if not command:
        return "no command to run: give the job's launch line after --, e.g. ranktrace run -- " \
               "torchrun --nproc-per-node 4 train.py"  # fmt: skip
    if args.trace_every < 1:
        return f"--trace-every {args.trace_every} must be at least 1"
    if args.peak_flops < 0:
        return f"--peak-flops {args.peak_flops:g} must be positive (e.g. 9.89e14), or 0 to measure"
    if shutil.which(command[0]) is None:
        return f"command not found: {command[0]} (give the job's launch line after --)"
    return runs_dir_problem(Path(args.runs_dir))


def run_job(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the job (module docstring); returns its exit code."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    problem = _usage_error(args, command)
    if problem:
        parser.error(problem)
    run_id = new_run_id()
    name = args.name or run_id
    run_dir = Path(args.runs_dir) / run_id
    write_run_json(run_dir, {
        "run_id": run_id, "name": name, "status": "running", "kind": names.RUN_KIND_TRAIN,
        "launcher": "ranktrace run", "command": command, "host": socket.gethostname(),
        "started_at": time.time(), "layout": {}, "world_size": None,
    })  # fmt: skip
    environment = dict(os.environ, RANKTRACE_RUN_DIR=str(run_dir.resolve()),
                       RANKTRACE_RUN_ID=run_id, RANKTRACE_TELEMETRY=args.telemetry,
                       RANKTRACE_TRACE_EVERY=str(args.trace_every),
                       RANKTRACE_PEAK_FLOPS=repr(args.peak_flops))  # fmt: skip
    environment.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # NCCL's own events time async work
    path = environment.get("PYTHONPATH")
    environment["PYTHONPATH"] = os.pathsep.join([str(STARTUP_DIR), *([path] if path else [])])
    print(f"ranktrace run: recording {name} ({run_id}) into {args.runs_dir}", flush=True)
    code = _run(command, environment)
    update_run_json(run_dir, status="completed" if code == 0 else "failed", exit_code=code,
                    finished_at=time.time())  # fmt: skip
    _ingest(args.runs_dir, run_id)
    verdict = "completed" if code == 0 else f"failed (exit code {code})"
    print(f"ranktrace run: {name} {verdict}; see `ranktrace report {name} --runs-dir "
          f"{args.runs_dir}`", flush=True)  # fmt: skip
    return code


def _run(command: list[str], environment: dict) -> int:
    """Run `command`; SIGINT and SIGTERM go to it (and it decides); its exit code."""
    process = subprocess.Popen(command, env=environment)
    forwarded = {}

    def forward(signum, frame) -> None:
        process.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        forwarded[signum] = signal.signal(signum, forward)
    try:
        code = process.wait()
    finally:
        for signum, handler in forwarded.items():
            signal.signal(signum, handler)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def _ingest(runs_dir: str, run_id: str) -> None:
    """Put the finished job's run in the store; whatever fails here (a damaged store, a lock
    held too long, a full disk) is a line, never the job's exit code: its segments are kept."""
    from ranktrace.analysis.ingest import ingest

    try:
        ingest(Path(runs_dir), [run_id])
    except Exception as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"ranktrace run: the run was recorded but not ingested: {reason}; run "
              f"`ranktrace ingest --runs-dir {runs_dir}`", file=sys.stderr)  # fmt: skip
