"""`Instrumentor`: attach a rank's recorder to our trainer's comm module, or time every
`torch.distributed` call of any training script for a recorder the script steps itself;
`uninstrument()` undoes either fully.

Any script, in five lines (see docs/instrumenting.md):

    telemetry = RankTelemetry.open(identity, run_dir, context, group_ids)
    instrumentor = Instrumentor(telemetry.recorder)
    instrumentor.instrument(axis_of_group={dp_group: "dp"})   # or DeviceMesh dimension names
    ... begin_step / end_step around each step ...
    instrumentor.uninstrument(); telemetry.close()

The calls are timed by the wrappers `ranktrace run` installs (telemetry/comm_hooks.py): blocking
calls from entry to return, async work from issue to its wait, functional collectives, and
point-to-point calls.
"""

from __future__ import annotations

from ranktrace.telemetry.comm_hooks import CommHooks
from ranktrace.telemetry.recorder import StepTelemetry


class ScriptSteps:
    """What the wrappers ask of a job (`issue_comm`, `complete_comm`, `waited`, `on_mesh`), for
    a recorder whose steps the script begins and ends itself: a call is recorded when it is
    issued inside a step."""

    def __init__(self, recorder: StepTelemetry) -> None:
        self.recorder = recorder

    def issue_comm(self, op, axis, group_id, size, nbytes, dtype, peer, is_async):
        mark = self.recorder.timer.mark(sample=not is_async)
        return self.recorder.issue(op, axis, group_id, size, nbytes, dtype, mark, peer, is_async)

    def complete_comm(self, call, end_ns: int | None = None) -> None:
        self.recorder.complete(call, end_ns if end_ns is not None else self.recorder.timer.mark())

    def waited(self, call, start_ns: int, end_ns: int) -> None:
        self.recorder.add_wait(call, start_ns, end_ns)

    def on_mesh(self, mesh) -> None:
        pass  # its dimension names are the wrappers' axes already


class Instrumentor:
    """Times communication for one `StepTelemetry` recorder.

    `instrument(comm=...)` observes our trainer's comm module (every call already carries its
    axis). `instrument()` without comm wraps torch.distributed; a call's axis is its group's
    name in `axis_of_group`, else its DeviceMesh dimension's name (meshes made after
    `instrument()`), else `world` for a group of every rank, else the group's ranks
    (`ranks:0,2`).
    """

    def __init__(self, recorder: StepTelemetry) -> None:
        self.recorder = recorder
        self._comm = None
        self._previous_mark = None
        self._hooks: CommHooks | None = None
        self._replaced_end_step = None  # an end_step set on the recorder before ours

    @property
    def is_instrumented(self) -> bool:
        return self._comm is not None or self._hooks is not None

    def instrument(self, comm=None, axis_of_group: dict | None = None) -> None:
        if self.is_instrumented:
            raise RuntimeError("already instrumented; call uninstrument() first")
        if comm is not None:
            self._comm = comm
            self._previous_mark = comm.mark
            comm.mark = self.recorder.timer.mark
            comm.observers.append(self.recorder)
            return
        hooks = CommHooks(ScriptSteps(self.recorder))
        for group, axis in (axis_of_group or {}).items():
            hooks.groups.name_group(group, axis)
        hooks.install()
        self._hooks = hooks
        end_step = self.recorder.end_step

        def end_step_with_calls(*args, **kwargs):
            """The script's end_step: async GPU work timed by NCCL's events first; after it,
            the waits that never came dropped."""
            hooks.time_gpu_work()
            record = end_step(*args, **kwargs)
            hooks.forget()
            return record

        self._replaced_end_step = vars(self.recorder).get("end_step")
        self.recorder.end_step = end_step_with_calls

    def uninstrument(self) -> None:
        if self._comm is not None:
            self._comm.observers.remove(self.recorder)
            self._comm.mark = self._previous_mark
            self._comm = None
        if self._hooks is not None:
            self._hooks.uninstall()
            if self._replaced_end_step is None:
                del self.recorder.end_step  # the class's own again
            else:
                self.recorder.end_step = self._replaced_end_step
            self._hooks = None
