"""`Instrumentor`: attach a rank's recorder to our trainer's comm module, or wrap the plain
`torch.distributed` collectives of any training script; `uninstrument()` undoes either fully.

Any script, in five lines (see docs/instrumenting.md):

    telemetry = RankTelemetry.open(identity, run_dir, context, group_ids)
    instrumentor = Instrumentor(telemetry.recorder)
    instrumentor.instrument(axis_of_group={dp_group: "dp"})   # unnamed groups are "world"
    ... begin_step / end_step around each step ...
    instrumentor.uninstrument(); telemetry.close()
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ranktrace.telemetry.recorder import StepTelemetry

# Blocking torch.distributed calls that are timed, with where their tensor argument is.
WRAPPED_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather",  # all_gather_into_tensor calls it (deprecated in 2.13)
    "reduce_scatter_single": "reduce_scatter",  # so does reduce_scatter_tensor
    "all_gather_into_tensor": "all_gather",  # torch < 2.13 only (see RENAMED)
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
}


RENAMED = {"all_gather_into_tensor": "all_gather_single",
           "reduce_scatter_tensor": "reduce_scatter_single"}  # fmt: skip
"""Old names wrapped only where their new one does not exist (it would record a call twice)."""


def _tensor_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


class Instrumentor:
    """Times communication for one `StepTelemetry` recorder.

    `instrument(comm=...)` observes our trainer's comm module (every call already carries its
    axis). `instrument()` without comm wraps torch.distributed's module-level collectives;
    each call's axis is looked up in `axis_of_group` (the default group is "world").
    Async calls (`async_op=True`) are passed through untimed.
    """

    def __init__(self, recorder: StepTelemetry) -> None:
        self.recorder = recorder
        self._comm = None
        self._originals: dict[str, object] = {}
        self._previous_mark = None

    @property
    def is_instrumented(self) -> bool:
        return self._comm is not None or bool(self._originals)

    def instrument(self, comm=None, axis_of_group: dict | None = None) -> None:
        if self.is_instrumented:
            raise RuntimeError("already instrumented; call uninstrument() first")
        if comm is not None:
            self._comm = comm
            self._previous_mark = comm.mark
            comm.mark = self.recorder.timer.mark
            comm.observers.append(self.recorder)
            return
        groups = {id(group): axis for group, axis in (axis_of_group or {}).items()}
        for group, axis in (axis_of_group or {}).items():  # members share the lowest rank as id
            self.recorder.group_ids[axis] = min(dist.get_process_group_ranks(group))
        self.recorder.group_ids.setdefault("world", 0)
        for name, op in WRAPPED_COLLECTIVES.items():
            if not hasattr(dist, name) or hasattr(dist, RENAMED.get(name, "")):
                continue
            original = getattr(dist, name)
            self._originals[name] = original
            setattr(dist, name, self._wrap(original, op, groups))

    def uninstrument(self) -> None:
        if self._comm is not None:
            self._comm.observers.remove(self.recorder)
            self._comm.mark = self._previous_mark
            self._comm = None
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals = {}

    def _wrap(self, original, op: str, axis_by_group_id: dict[int, str]):
        recorder = self.recorder
        mark = recorder.timer.mark

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if kwargs.get("async_op"):
                return original(*args, **kwargs)
            group = kwargs.get("group") or dist.group.WORLD
            start = mark()
            result = original(*args, **kwargs)
            end = mark()
            tensor = _tensor_of(args, kwargs)
            nbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
            dtype = tensor.dtype if tensor is not None else None
            peer = -1
            if op in ("send", "recv"):
                peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else -1))
            axis = axis_by_group_id.get(id(group), "world")
            size = dist.get_world_size(group)
            recorder.on_comm(op, axis, size, nbytes, dtype, start, end, peer)
            return result

        return timed
