"""`ranktrace train` on one machine: spawn tp·pp·dp rank processes with torch's elastic launcher.

The launcher owns the outcome: it writes run.json as `running` before any rank starts, and marks
it `failed` (naming the rank that died) if the job fails. The elastic agent stops the surviving
ranks as soon as one exits abnormally, so a dead rank never leaves the job hanging.
"""

from __future__ import annotations

import logging
import socket
import time

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ranktrace.telemetry.run_record import new_run_id, read_run_json, run_dir, write_run_json
from ranktrace.trainer.config import TrainConfig
from ranktrace.trainer.rank_server import start_rank_server
from ranktrace.trainer.train import base_record, rank_main
from ranktrace.trainer.watchdog import HANG_EXIT_CODE


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _quiet_launcher_logs() -> None:
    """The agent logs each failure as a multi-line traceback; we print one line instead."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def describe_failures(error: ChildFailedError, world_size: int) -> str:
    """One line naming the rank(s) that failed first and how (exit code, signal or exception)."""
    failures = sorted(error.failures.items(), key=lambda item: item[1].timestamp)
    parts = []
    for rank, failure in failures[:3]:
        detail = ""
        if failure.exitcode < 0:
            how = f"killed by {failure.signal_name()}"
        elif failure.exitcode == HANG_EXIT_CODE:
            how = "stopped by the collective timeout"
        else:
            how = f"exit code {failure.exitcode}"
            message = failure.message if isinstance(failure.message, str) else ""
            detail = message.strip().splitlines()[-1] if message.strip() else ""
            if detail.startswith("To enable traceback"):  # the agent's stock text, no cause
                detail = ""
        parts.append(f"rank {rank} of {world_size} {how}" + (f": {detail}" if detail else ""))
    more = f" (+{len(failures) - 3} more)" if len(failures) > 3 else ""
    return "; ".join(parts) + more


def launch(cfg: TrainConfig, ranks_to_stderr: bool = False) -> int:
    """Run the job on this machine; returns the process exit code (0 on success, 1 on failure).

    `cfg` must already be validated. `ranks_to_stderr`: the ranks write their step lines to
    stderr (they fork from the rank server, whose descriptors are those it started with, not
    this process's now: a command printing a document on stdout, app/output.py).
    """
    cfg.run_id = cfg.run_id or new_run_id()
    directory = run_dir(cfg.runs_dir, cfg.run_id)
    if cfg.attempt > 0:  # --resume: the run keeps its results; rank 0 trims what is redone
        record = read_run_json(directory)
        record.update(status="running", attempt=cfg.attempt, error=None, finished_at=None)
        write_run_json(directory, record)
    else:
        write_run_json(directory, base_record(cfg, "running"))
    print(
        f"run {cfg.run_id}: {cfg.world_size} ranks (tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} "
        f"zero={cfg.zero}), model {cfg.model}, {cfg.steps} steps -> {directory}"
        + (f" (attempt {cfg.attempt}, resuming)" if cfg.resume else ""),
        flush=True,
    )
    _quiet_launcher_logs()
    start_rank_server()  # a no-op when the CLI started it already
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.world_size,
        run_id=cfg.run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=cfg.max_restarts,  # each restart resumes from the latest checkpoint
        monitor_interval=0.1,
        start_method="forkserver",
    )
    started = time.perf_counter()
    try:
        elastic_launch(config, rank_main)(cfg.to_dict(), ranks_to_stderr)
    except ChildFailedError as error:
        reason = describe_failures(error, cfg.world_size)
        record = read_run_json(directory)
        record.update(status="failed", error=reason, finished_at=time.time())
        write_run_json(directory, record)
        print(f"ranktrace train: error: run {cfg.run_id} failed: {reason}", flush=True)
        return 1
    record = read_run_json(directory)
    print(
        f"run {cfg.run_id} {record['status']} in {time.perf_counter() - started:.1f} s: "
        f"final loss {record['losses'][-1]:.4f}, {record['tokens_per_s']:.0f} tokens/s; "
        f"{directory / 'run.json'}",
        flush=True,
    )
    return 0
