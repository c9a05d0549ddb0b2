"""ranktrace: profiling and straggler diagnosis for distributed training.

Everything installs under this one import name, so a training job with its own `trainer.py`,
`app/` or `analysis/` never shadows ranktrace (nor ranktrace its modules). The project's folders
keep their places in the source tree and are mapped into this package by pyproject.toml:

    ranktrace.trainer    the reference 3D-parallel trainer       (trainer/)
    ranktrace.telemetry  per-rank recording into Parquet segments (telemetry/)
    ranktrace.analysis   the store, its SQL views and analyzers   (analysis/)
    ranktrace.app        the CLI and the dashboard                 (app/)
    ranktrace.importers  per-op and torch profiler traces          (importers/)
    ranktrace.tools      test tools (network namespaces)           (tools/)

Your own training job, recorded:

    ranktrace run --name my-job -- torchrun --nproc-per-node 4 train.py   # no code change

or, for control over what a step is, three calls (docs/instrumenting.md has a whole example):

    import ranktrace

    ranktrace.init(name="my-job")                 # after init_process_group; every rank
    for batch in loader:
        with ranktrace.step(tokens=batch.numel()):
            with ranktrace.phase("data"):
                batch = batch.to(device)
            loss = model(batch).mean()            # forward, backward and the optimizer's step
            loss.backward()                       # are timed by torch's own hooks
            optimizer.step()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__version__ = "0.1.0"

__all__ = ["init", "phase", "step"]


def init(name: str | None = None, runs_dir: str = "runs", telemetry: str = "collectives",
         trace_every: int = 1) -> str:  # fmt: skip
    """Record this rank of the job into `runs_dir` (call it on every rank, after
    `torch.distributed.init_process_group` when there are several). Returns the run id; under
    `ranktrace run` the run already exists and this only returns its id. When the process
    exits, rank 0 marks the run completed; `ranktrace report NAME` ingests it."""
    from ranktrace.telemetry import startup

    return startup.init_run(name, runs_dir, telemetry, trace_every)


@contextmanager
def step(**values) -> Iterator[None]:
    """One training step: what runs inside is the step (optimizer steps no longer end steps).
    `values` are recorded with it: `tokens` (for tokens/s), `loss`, `lr`, `grad_norm`."""
    job = _job()
    job.begin_explicit_step()
    try:
        yield
    finally:
        job.end_explicit_step(**values)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """A named part of the current step: one of data, forward, backward, pipeline_wait,
    grad_sync, optimizer, checkpoint."""
    from ranktrace.telemetry.names import PHASES

    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}: use one of {', '.join(PHASES)}")
    job = _job()
    job.open_named_phase(name)
    try:
        yield
    finally:
        job.close_named_phase()


def _job():
    from ranktrace.telemetry import startup

    job = startup.current_job()
    if job is None:
        raise RuntimeError("ranktrace is not recording this process: call ranktrace.init() "
                           "first, or launch the job with `ranktrace run -- ...`")  # fmt: skip
    return job
