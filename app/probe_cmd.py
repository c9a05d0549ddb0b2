"""`ranktrace probe`: measure the network between a job's ranks (trainer/probe.py), store the
result as a run of kind `probe`, linked to the job's run (`--for`), and print its verdict."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

from ranktrace.app.output import CommandResult
from ranktrace.telemetry.names import RUN_KIND_PROBE

LAUNCH_LINE = (
    "torchrun --nnodes N --nproc-per-node R --rdzv-backend c10d --rdzv-endpoint HOST:29400 "
    "$(command -v ranktrace) probe --for RUN --runs-dir DIR"
)


def under_torchrun() -> bool:
    """This process is one rank of a torchrun (or torch elastic) launch."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def add_probe_parser(commands: argparse._SubParsersAction) -> None:
    """The `probe` command and its options."""
    probe = commands.add_parser(
        "probe",
        help="measure send bandwidth between every pair of nodes and name a slow NIC",
        description="Launched like the job, on every node: `" + LAUNCH_LINE + "` (or `--nproc "
        "N` ranks on this machine). Measures the send bandwidth of every ordered pair of nodes "
        "and of ranks inside a node, each pair alone, and names the slow sender or receiver. "
        "The result is a run of kind probe (`ranktrace report PROBE_RUN`), shown in the report "
        "of the run given by --for.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    probe.add_argument("--runs-dir", default="runs", help="directory holding the runs and store")
    probe.add_argument("--name", default="probe", help="the probe run's name")
    probe.add_argument(
        "--for", dest="for_run", metavar="RUN", default=None,
        help="the job's run (id or name) whose report shows this probe",
    )  # fmt: skip
    probe.add_argument(
        "--bytes", type=int, default=4 * 2**20, help="largest message per pair (bytes)"
    )
    probe.add_argument(
        "--repeats", type=int, default=5, help="timed samples per pair (the fastest counts)"
    )
    probe.add_argument(
        "--pair-seconds", type=float, default=0.5,
        help="about how long one pair's samples take together (slow pairs send smaller "
        "messages, fast ones several)",
    )  # fmt: skip
    probe.add_argument(
        "--nproc", type=int, default=0,
        help="ranks to start on this machine, when not under torchrun (at least 2)",
    )  # fmt: skip
    probe.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cpu (gloo) or cuda (nccl, one GPU per local rank)",
    )  # fmt: skip
    probe.add_argument("--timeout", type=float, default=300.0, help="seconds one transfer may take")
    probe.add_argument("--json", action="store_true", help="print the report as JSON")
    probe.set_defaults(handler=run_probe, command_parser=probe)


def _usage_error(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """What is wrong with the options (before any process group is joined), or None."""
    numbers = {"--bytes": args.bytes, "--repeats": args.repeats,
               "--pair-seconds": args.pair_seconds, "--timeout": args.timeout}  # fmt: skip
    for flag, value in numbers.items():
        if value <= 0:
            return f"{flag} {value:g} must be positive"
    if under_torchrun() and args.nproc:
        return (f"--nproc {args.nproc} starts ranks on this machine; under torchrun the ranks "
                "are torchrun's: drop --nproc")  # fmt: skip
    if not under_torchrun() and args.nproc < 2:
        return (f"a probe measures between ranks: launch it on every node like the job "
                f"(`{LAUNCH_LINE}`) or give --nproc N (N >= 2) for ranks on this "
                "machine")  # fmt: skip
    runs_dir = Path(args.runs_dir)
    if runs_dir.exists() and not runs_dir.is_dir():
        return f"--runs-dir {runs_dir} is a file, not a directory of runs"
    if args.device == "cuda":
        import torch

        wanted = int(os.environ.get("LOCAL_WORLD_SIZE", args.nproc or 1))
        if torch.cuda.device_count() < wanted:
            return (f"--device cuda needs {wanted} GPUs on this machine but torch sees "
                    f"{torch.cuda.device_count()}; use --device cpu")  # fmt: skip
    return None


def resolve_job(runs_dir: Path, run: str) -> str:
    """The run id of `--for RUN` (an id or name): from the store, else from the run.json files
    (a torchrun job not ingested yet). Raises StoreError when none matches."""
    from ranktrace.analysis.run import resolve_run
    from ranktrace.analysis.store import StoreError, open_reader, store_path

    if store_path(runs_dir).exists():
        con = open_reader(runs_dir)
        try:
            row = resolve_run(con, run)
        except StoreError:
            row = None
        finally:
            con.close()
        if row is not None:
            if row.get("kind") == RUN_KIND_PROBE:
                raise StoreError(f"--for {run}: that run is a probe; give the job's run")
            return row["run_id"]
    records = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*/run.json"))]
    matches = [r for r in records if run in (r.get("run_id"), r.get("name"))
               and r.get("kind") != RUN_KIND_PROBE]  # fmt: skip
    if not matches:
        raise StoreError(f"--for {run}: no run with id or name '{run}' under {runs_dir}; give "
                         "the id or name of the job's run")  # fmt: skip
    return max(matches, key=lambda r: r.get("started_at") or 0)["run_id"]


def run_probe(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Measure (this rank's part, or `--nproc` local ranks), then on rank 0 store and print."""
    rank0 = os.environ.get("RANK", "0") == "0"

    def refuse(message: str):
        if rank0:  # one line, from one rank
            parser.error(message)
        sys.exit(2)

    error = _usage_error(parser, args)
    if error:
        refuse(error)
    from ranktrace.analysis.store import StoreError
    from ranktrace.telemetry.run_record import new_run_id
    from ranktrace.trainer.probe import ProbeOptions, ProbeRefused, probe_rank

    runs_dir = Path(args.runs_dir)
    options = ProbeOptions(args.bytes, args.repeats, args.pair_seconds, args.device, args.timeout)
    run_id, job = new_run_id(), {"run_id": None}

    def check() -> str | None:  # on rank 0, before anything is measured
        try:
            job["run_id"] = resolve_job(runs_dir, args.for_run) if args.for_run else None
        except StoreError as failure:
            return str(failure)
        return None

    try:
        if under_torchrun():
            measured = probe_rank(options, check)
            if measured is None:
                return 0  # not rank 0: rank 0 stores and prints
        else:
            refused = check()
            if refused:
                refuse(refused)
            measured = _launch_local(options, args.nproc, run_id)
            if measured is None:
                return 1
    except ProbeRefused as refused:
        refuse(str(refused))
    record = {
        "run_id": run_id, "name": args.name or run_id, "status": "completed",
        "kind": RUN_KIND_PROBE, "for": job["run_id"], "world_size": measured["world_size"],
        "host": socket.gethostname(), "started_at": measured["started_at"],
        "finished_at": measured["finished_at"], "probe": measured,
    }  # fmt: skip
    return _store_and_print(runs_dir, record, args.json, args.command_result)


def _launch_local(options, nproc: int, run_id: str) -> dict | None:
    """The probe as `nproc` local ranks; a failed rank reported in one line (None then)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ranktrace.trainer.launch import describe_failures
    from ranktrace.trainer.probe import launch_local

    try:
        return launch_local(options, nproc, run_id)
    except ChildFailedError as failure:
        print(f"ranktrace probe: error: {describe_failures(failure, nproc)}", file=sys.stderr)
        return None


def _store_and_print(runs_dir: Path, record: dict, as_json: bool,
                     command_result: CommandResult) -> int:  # fmt: skip
    """Write the probe run, ingest it, print its report (the verdict and the pairs) through
    `command_result` (app/output.py)."""
    from ranktrace.analysis.ingest import ingest
    from ranktrace.analysis.run import cached_report
    from ranktrace.analysis.store import open_reader
    from ranktrace.app.output import to_json
    from ranktrace.app.probe_text import format_probe_report
    from ranktrace.telemetry.run_record import run_dir, write_run_json

    directory = run_dir(runs_dir, record["run_id"])
    write_run_json(directory, record)
    started = time.perf_counter()
    try:
        ingest(runs_dir, [record["run_id"]], force=True)
        con = open_reader(runs_dir)
        try:
            report = cached_report(con, record["run_id"])
        finally:
            con.close()
    except Exception as error:  # the measurement is safe in run.json
        print(f"ranktrace probe: warning: could not ingest {directory} ({error}); run "
              f"`ranktrace ingest --runs-dir {runs_dir}` later")  # fmt: skip
        return 0
    command_result.print(to_json(report) if as_json else format_probe_report(report))
    if not as_json:
        print(f"\nstored as run {record['run_id']} in {runs_dir} "
              f"({time.perf_counter() - started:.1f} s to ingest)")  # fmt: skip
    return 0
