"""Instrumenting a process of a job at start-up, before the job's own code runs (`ranktrace run`).

`arm()` runs in the startup hook (ranktrace/_startup/sitecustomize.py) and imports nothing heavy:
it waits for the job to import torch (a finder on `sys.meta_path` watches for it), because a
job may set environment variables that torch reads at import (CUDA_VISIBLE_DEVICES,
OMP_NUM_THREADS) before it imports torch itself. Once torch is imported, `instrument()` installs
the hooks of telemetry/torch_hooks.py and telemetry/comm_hooks.py for this process's
`JobRecorder`, and those of telemetry/pipelining_hooks.py once the job imports
`torch.distributed.pipelining`. A process that never trains (the torchrun agent, a data-loader
worker) opens no telemetry and writes nothing: telemetry opens at a rank's first step.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import time

_job = None


def arm() -> None:
    """Instrument this process when it imports torch (now, if it already has)."""
    when_imported("torch", _instrument_or_say_why)


def when_imported(name: str, then) -> None:
    """Call `then()` once module `name` is imported: now if it is, else right after its own
    code has run (a finder on `sys.meta_path` wraps its loader)."""
    if name in sys.modules:
        then()
        return
    sys.meta_path.insert(0, _ImportWatcher(name, then))


def _instrument_or_say_why() -> None:
    try:
        instrument()
    except Exception as error:
        print(f"ranktrace: not recording this process: {type(error).__name__}: {error}",
              file=sys.stderr)  # fmt: skip


def instrument(settings=None):
    """The process's JobRecorder (recording as `settings` say, else as `ranktrace run`'s
    environment does), with its hooks installed (once)."""
    global _job
    if _job is not None:
        return _job
    from ranktrace.telemetry.comm_hooks import CommHooks
    from ranktrace.telemetry.job import JobRecorder, Settings
    from ranktrace.telemetry.torch_hooks import TorchHooks

    settings = settings or Settings.from_environment()
    if settings is None:
        return None
    _job = JobRecorder(settings)
    _job.comm_hooks = CommHooks(_job)
    _job.comm_hooks.install()
    torch_hooks = TorchHooks(_job)
    torch_hooks.install()
    _job.capture_notes = _job.comm_hooks.notes + torch_hooks.notes
    # torch.distributed.pipelining takes a second to import: hooked once the job imports it
    when_imported("torch.distributed.pipelining", _hook_pipelining)
    return _job


def _hook_pipelining() -> None:
    from ranktrace.telemetry.pipelining_hooks import PipeliningHooks

    try:
        hooks = PipeliningHooks(_job)
        hooks.install()
        notes = hooks.notes
    except Exception as error:  # never the job's failure
        notes = [f"pipeline stages not recorded: {type(error).__name__}: {error}"]
    for note in notes:
        _job.note_capture_limited(note)


def init_run(name: str | None, runs_dir: str, level: str, trace_every: int) -> str:
    """`ranktrace.init()`: this rank recorded into a run that rank 0 creates (its id sent to
    the other ranks); under `ranktrace run`, that run. Returns the run id."""
    if _job is not None:
        return _job.settings.run_id
    from pathlib import Path

    import torch.distributed as dist

    from ranktrace.telemetry import names
    from ranktrace.telemetry.job import Settings
    from ranktrace.telemetry.run_record import new_run_id, write_run_json

    if level not in (names.LEVEL_STEPS, names.LEVEL_COLLECTIVES):
        raise ValueError(f"telemetry={level!r}: use 'steps' or 'collectives'")
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    run_id = [new_run_id() if rank == 0 else None]
    if distributed and dist.get_world_size() > 1:
        dist.broadcast_object_list(run_id, src=0)
    run_dir = Path(runs_dir) / run_id[0]
    if rank == 0:
        write_run_json(run_dir, {"run_id": run_id[0], "name": name or run_id[0],
                                 "status": "running", "kind": names.RUN_KIND_TRAIN,
                                 "launcher": "ranktrace.init", "started_at": time.time(),
                                 "layout": {}, "world_size": None})  # fmt: skip
    instrument(Settings(run_dir, run_id[0], level, trace_every, owns_record=True))
    return run_id[0]


def current_job():
    """This process's JobRecorder, or None when it is not instrumented."""
    return _job


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when module `name` is being imported, wraps its loader so that
    `then()` runs right after the module's own code (and a failure there is the module's)."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        then = self.then

        def exec_then_hook(module) -> None:
            exec_module(module)
            then()

        loader.exec_module = exec_then_hook
        return spec
