"""torch.distributed.pipelining, turned into a job rank's pipeline layout and micro-batch phases
(telemetry/job.py), installed when the job imports it (telemetry/startup.py):

- a `PipelineStage` (any `_PipelineStageBase`) once built: its stage index, the number of
  stages and its process group, whose calls (the stages' sends and receives) are then on the
  `pp` axis; the rank's `pp` coordinate is its place in that group;
- a schedule (`ScheduleGPipe`, `Schedule1F1B`, the interleaved and zero-bubble ones) once
  built: its name and micro-batches, recorded in run.json like the trainer's;
- a schedule's `step()`: the time in it outside the stage's own chunks is `pipeline_wait`
  (sends, receives, the loss); `forward_one_chunk` / `backward_one_chunk` /
  `backward_weight_one_chunk` are the `forward` / `backward` phases of their micro-batch.

Hooks on methods, not on torch.distributed functions: nothing torch compares by identity.
"""

from __future__ import annotations

import functools
import inspect

from torch.compiler import is_compiling

from ranktrace.telemetry.patching import Patches

CHUNK_PHASES = {
    "forward_one_chunk": "forward",
    "backward_one_chunk": "backward",
    "backward_weight_one_chunk": "backward",
}
"""A stage's per-micro-batch methods and the phase each one is."""


class PipeliningHooks:
    """Installs the hooks above for one `JobRecorder`; `uninstall()` removes them."""

    def __init__(self, job) -> None:
        self.job = job
        self._patches = Patches()

    @property
    def notes(self) -> list[str]:
        """What could not be hooked, so is not recorded."""
        return self._patches.notes

    def install(self) -> None:
        from torch.distributed.pipelining import schedules, stage

        patches = self._patches
        base = stage._PipelineStageBase
        patches.attempt("pipeline stages", patches.replace, base, "__init__",
                        self._wrap_stage_init(base.__init__))  # fmt: skip
        for method, phase in CHUNK_PHASES.items():
            if hasattr(base, method):
                patches.attempt(f"pipeline {method}", patches.replace, base, method,
                                self._wrap_chunk(getattr(base, method), phase))  # fmt: skip
        schedule = schedules._PipelineSchedule
        patches.attempt("pipeline schedules", patches.replace, schedule, "__init__",
                        self._wrap_schedule_init(schedule.__init__))  # fmt: skip
        for owner in _defining("step", schedule):
            patches.attempt(f"{owner.__name__}.step", patches.replace, owner, "step",
                            self._wrap_step(vars(owner)["step"]))  # fmt: skip

    def uninstall(self) -> None:
        self._patches.restore()

    def _wrap_stage_init(self, original):
        job = self.job

        @functools.wraps(original)
        def init(stage, *args, **kwargs):
            original(stage, *args, **kwargs)
            job.on_pipeline_stage(stage.stage_index, stage.num_stages, stage.group)

        return init

    def _wrap_schedule_init(self, original):
        job = self.job

        @functools.wraps(original)
        def init(schedule, *args, **kwargs):
            original(schedule, *args, **kwargs)
            job.on_pipeline_schedule(type(schedule).__name__,
                                     getattr(schedule, "_n_microbatches", None))  # fmt: skip

        return init

    def _wrap_step(self, original):
        job = self.job

        @functools.wraps(original)
        def step(schedule, *args, **kwargs):
            if is_compiling():
                return original(schedule, *args, **kwargs)
            job.schedule_begin()
            try:
                return original(schedule, *args, **kwargs)
            finally:
                job.schedule_end()

        return step

    def _wrap_chunk(self, original, phase: str):
        job = self.job
        chunk_argument = list(inspect.signature(original).parameters)[1]  # after self

        @functools.wraps(original)
        def chunk(stage, *args, **kwargs):
            if is_compiling():
                return original(stage, *args, **kwargs)
            chunk_id = args[0] if args else kwargs.get(chunk_argument, -1)
            job.chunk_begin(phase, chunk_id if isinstance(chunk_id, int) else -1)
            try:
                return original(stage, *args, **kwargs)
            finally:
                job.chunk_end()

        return chunk


def _defining(name: str, root: type) -> list[type]:
    """`root` and its loaded subclasses that define `name` themselves."""
    seen, found, todo = set(), [], [root]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if name in vars(cls):
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found
