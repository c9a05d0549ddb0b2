"""`--resume RUN`: the configuration that continues a run, and the checks made before launching.

The run's own configuration (run.json) is the base: a checkpoint only loads into the layout,
model and precision that wrote it. Options that do not change what a step computes may be given
again (more steps, a restart budget, telemetry, checkpoint cadence); others are refused.
A different `--steps` stretches or shrinks the learning-rate schedule (warm-up and cosine decay
are set by the total), so the resumed steps then follow another schedule than the original run
would have: exactness holds for an unchanged `--steps`.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

from ranktrace.telemetry.run_record import latest_run_id, read_rank_info, read_run_json, run_dir
from ranktrace.trainer.checkpoint import CheckpointError, latest_checkpoint
from ranktrace.trainer.cli_args import add_train_arguments
from ranktrace.trainer.config import ConfigError, TrainConfig
from ranktrace.trainer.faults import ONE_OFF_KINDS

MAY_CHANGE_ON_RESUME = frozenset({
    "steps", "max_restarts", "collective_timeout", "checkpoint_every", "checkpoint_minutes",
    "checkpoint_keep", "checkpoint_sync", "inject", "runs_dir", "resume", "device", "nproc",
    "telemetry", "trace_every", "flush_every", "flush_seconds", "otlp_endpoint", "log_every",
    "save_weights",
})  # fmt: skip


def explicit_train_arguments(argv: list[str]) -> dict:
    """The training options `argv` gives explicitly (not their defaults), by field name."""
    parser = argparse.ArgumentParser(add_help=False)
    add_train_arguments(parser)
    for action in parser._actions:  # argparse's documented way: SUPPRESS drops defaults
        action.default = argparse.SUPPRESS
    known, _ = parser.parse_known_args(argv)
    return vars(known)


def _still_training(directory: Path) -> int | None:
    """The pid of a rank of this run still alive on this host, if any."""
    for info in read_rank_info(directory).values() if (directory / "ranks").is_dir() else []:
        if info.get("host") == socket.gethostname():
            try:
                os.kill(int(info["pid"]), 0)
            except (ProcessLookupError, PermissionError, KeyError, ValueError):
                continue
            return int(info["pid"])
    return None


def _attempts_so_far(directory: Path, record: dict) -> int:
    """Launch attempts the run already had: run.json's count, or the telemetry's when an
    attempt died before rank 0 updated run.json (each rank writes `rank-<attempt>.parquet`)."""
    seen = [
        int(p.stem.rsplit("-", 1)[1]) for p in directory.glob("telemetry/rank=*/rank-*.parquet")
    ]
    return max([int(record.get("attempt", 0)), *seen]) + 1


def _run_id_of(runs_dir: str, run: str) -> str:
    """The id of run `run` (an id, or a name: the latest run of that name), like every other
    command takes it; ConfigError when there is none."""
    run_id = latest_run_id(runs_dir, run)
    if run_id is None:
        raise ConfigError(f"--resume {run}: no run with id or name {run} under {runs_dir}; "
                          "give a run id or name (`ranktrace sql \"SELECT run_id, name FROM "
                          "runs\"` lists them)")  # fmt: skip
    return run_id


def resume_config(runs_dir: str, run_id: str, explicit: dict) -> TrainConfig:
    """The validated TrainConfig that continues `run_id` (attempt + 1), after checking that it
    has a complete, intact checkpoint; ConfigError / CheckpointError say what is wrong."""
    run_id = _run_id_of(runs_dir, run_id)
    directory = run_dir(runs_dir, run_id)
    record = read_run_json(directory)
    stored = record.get("config")
    if not stored:
        raise ConfigError(f"--resume {run_id}: run.json has no configuration to resume from")
    fixed = sorted(k for k in explicit if k not in MAY_CHANGE_ON_RESUME and k in stored)
    changed = [k for k in fixed if explicit[k] != stored[k]]
    if changed:
        name = changed[0]
        raise ConfigError(
            f"--{name.replace('_', '-')} cannot change on --resume (the run has "
            f"{name}={stored[name]!r} and its checkpoints hold that); leave it out"
        )
    pid = _still_training(directory)
    if pid is not None:
        raise ConfigError(
            f"--resume {run_id}: the run is still training (pid {pid}); wait or stop it"
        )
    fields = TrainConfig.__dataclass_fields__
    values = {k: v for k, v in stored.items() if k in fields}
    values.update({k: v for k, v in explicit.items() if k in MAY_CHANGE_ON_RESUME})
    if "inject" not in explicit:  # a crash or hang already happened; slow parts stay slow
        values["inject"] = [
            s for s in stored.get("inject", []) if s.split(":")[0] not in ONE_OFF_KINDS
        ]
    cfg = TrainConfig(**values)
    cfg.runs_dir, cfg.run_id, cfg.resume = str(runs_dir), run_id, run_id
    cfg.attempt = _attempts_so_far(directory, record)
    cfg.validate()
    layout = {"tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp, "zero": cfg.zero}
    latest = latest_checkpoint(directory, layout)
    if latest is None:
        raise CheckpointError(
            f"run {run_id} has no complete checkpoint to resume from (train with "
            f"--checkpoint-every N); start a new run instead"
        )
    if latest[1]["next_step"] >= cfg.steps:
        raise ConfigError(
            f"--resume {run_id}: its latest checkpoint is at step {latest[1]['next_step']}, "
            f"already --steps={cfg.steps}; give a larger --steps to train on"
        )
    return cfg
