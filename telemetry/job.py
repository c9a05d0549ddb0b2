"""One rank of a job ranktrace did not write: its steps, phases and communication, recorded from
hooks into the same segments as a trainer rank (`ranktrace run`, or `ranktrace.init()`).

Steps and phases, from torch's own hooks (telemetry/torch_hooks.py):
- a step ends with the optimizer's step (its post-hook; the last one before the next forward,
  when the job has several optimizers), or with `ranktrace.step()` when the job uses the API;
- `forward` runs from the first module call after the step began to the backward call,
  `backward` is the backward call, `optimizer` the optimizer's step; each forward/backward pair
  is a micro-batch (gradient accumulation: several per step); the time between the previous
  step's end and the first forward is `data` (loading, host work). Step 0 begins at the first
  forward and is the warm-up step;
- closure style (`optimizer.step(closure)`: Lightning's automatic optimization, LBFGS): the
  forward and backward run inside the optimizer step, which then is the step (once a forward
  was seen inside one, an optimizer step that follows another begins the next step, where
  without closures it is a second optimizer of the same step);
- torch.distributed.pipelining (telemetry/pipelining_hooks.py): a schedule's step is
  `pipeline_wait` outside the stage's micro-batch chunks, which are `forward` / `backward`.

Telemetry opens at the first step (torch.distributed is initialised by then, so the rank and
world size are known); rank 0 records the job's layout in run.json. The FLOPs of one step are
counted once, in step 1, by torch's FLOP counter; MFU is those FLOPs over the step time and the
rank's peak (the GPU's datasheet figure, or the measured matmul rate of a CPU rank).
"""

from __future__ import annotations

import atexit
import functools
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ranktrace.telemetry import clock_sync, names
from ranktrace.telemetry.cpu_clock import process_cpu_ns, thread_core_wait_ns, thread_cpu_ns
from ranktrace.telemetry.exporter import RankIdentity, StepContext
from ranktrace.telemetry.job_layout import MeshSeen, PipelineSeen, job_layout
from ranktrace.telemetry.peaks import rank_peak
from ranktrace.telemetry.run_record import update_run_json
from ranktrace.telemetry.session import RankTelemetry
from ranktrace.telemetry.timers import epoch_anchor_ns, timer_for
from ranktrace.telemetry.torch_hooks import in_ddp_hook  # marks DDP's communication hook's calls

FLOP_COUNT_STEP = 1
"""The step whose FLOPs are counted (the first one after the warm-up step)."""


@dataclass
class Settings:
    """Where and how a job rank records (from `ranktrace run`'s environment or `init()`)."""

    run_dir: Path
    run_id: str
    level: str = names.LEVEL_COLLECTIVES
    trace_every: int = 1
    owns_record: bool = False
    """Set by `ranktrace.init()`: rank 0 marks run.json completed at exit (under `ranktrace
    run`, ranktrace run does)."""
    peak_flops: float = 0.0
    """A rank's device peak FLOP/s (`ranktrace run --peak-flops`); 0: telemetry/peaks.py."""

    @classmethod
    def from_environment(cls) -> Settings | None:
        run_dir = os.environ.get("RANKTRACE_RUN_DIR")
        if not run_dir:
            return None
        return cls(Path(run_dir), os.environ.get("RANKTRACE_RUN_ID", Path(run_dir).name),
                   os.environ.get("RANKTRACE_TELEMETRY", names.LEVEL_COLLECTIVES),
                   int(os.environ.get("RANKTRACE_TRACE_EVERY", "1")),
                   peak_flops=_number(os.environ.get("RANKTRACE_PEAK_FLOPS")))  # fmt: skip


def _guarded(method):
    """A hook of the job's: an error in ranktrace stops the rank's recording (one line on
    stderr), never the job."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if self.failed is not None:
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception as error:
            self.failed = f"{type(error).__name__}: {error}"
            print(f"ranktrace: rank stops recording: {self.failed}", file=sys.stderr, flush=True)
            return None

    return guarded


def _own_time(method):
    """A hook whose time, less the step hand-overs and marks in it (the recorder counts those),
    is ranktrace's own time in the step."""

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        start, transitions, marks = time.perf_counter_ns(), self._transition_ns, self._marks_ns()
        try:
            return method(self, *args, **kwargs)
        finally:
            counted = self._transition_ns - transitions + self._marks_ns() - marks
            self.own_ns += time.perf_counter_ns() - start - counted

    return timed


def _clocks() -> tuple[int, int, int, int | None]:
    """(wall, thread CPU, process CPU, wait for a core) now, ns."""
    return time.perf_counter_ns(), thread_cpu_ns(), process_cpu_ns(), thread_core_wait_ns()


def _waited(start: tuple, end: tuple) -> int | None:
    return None if start[3] is None or end[3] is None else end[3] - start[3]


class JobRecorder:
    """The step/phase state machine of one rank, fed by hooks; see the module docstring."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.telemetry: RankTelemetry | None = None
        self.recorder = None
        self.explicit_steps = False  # ranktrace.step() drives the steps
        self.step = 0
        self.in_step = False
        self.phase: tuple[str, int, tuple] | None = None  # name, micro-batch, clocks
        self.micro_batch = 0
        self.gap_start: tuple | None = None  # where the next step's data begins
        self.step_end: tuple | None = None  # the last optimizer end, pending
        self.optimizer_depth = 0  # optimizer steps running (a closure's forward runs inside)
        self.closure_steps = False  # a forward ran inside an optimizer step (closure style)
        self.schedule_depth = 0  # in a pipelining schedule's step()
        self.chunk_depth = 0  # in a pipeline stage's micro-batch method
        self.pipeline = PipelineSeen()
        self.seen: dict[str, int] = {}  # what ran in the step being recorded (incomplete_step)
        self.step_flops: float | None = None
        self._flop_counter = None
        self._ddp_calls: list = []
        self.meshes: list[MeshSeen] = []  # never the meshes: they hold process groups
        self.own_ns = 0
        self._transition_ns = 0  # time in step hand-overs so far (the recorder's own count)
        self._lock = threading.RLock()
        self.comm_hooks = None
        self.capture_notes: list[str] = []  # hooks that could not be installed (events at open)
        self._clock: clock_sync.ClockExchange | None = None
        self._metadata_lock = threading.Lock()
        self.failed: str | None = None
        atexit.register(self.close)

    def _marks_ns(self) -> int:
        """The time of the marks' reads of the wait for a core so far in this step (the
        recorder adds it to the step's own time; telemetry.cpu_clock `CoreWaitSeries.mark`)."""
        series = self.recorder.core_wait if self.recorder is not None else None
        return series.own_ns if series is not None else 0

    # -- hooks --------------------------------------------------------------------------------

    @_guarded
    @_own_time
    def forward_begin(self) -> None:
        if self.phase is not None and self.phase[0] in ("forward", "backward"):
            return  # nested module calls, recomputation in backward
        if self.schedule_depth or self.chunk_depth:
            return  # a pipeline schedule's chunks are the phases
        if self.optimizer_depth:
            self.closure_steps = True
        if self._ensure_step():
            self._count("forward pass")
            self._close_phase()
            self._open_phase("forward")

    @_guarded
    @_own_time
    def backward_begin(self) -> None:
        if self.schedule_depth or self.chunk_depth:
            return
        if self._ensure_step():
            self._count("backward pass")
            self._close_phase()
            self._open_phase("backward")

    @_guarded
    @_own_time
    def backward_end(self) -> None:
        if self.schedule_depth or self.chunk_depth:
            return
        if self.in_step and self.phase is not None and self.phase[0] == "backward":
            self._close_phase()
            self.micro_batch += 1
            self._expose_ddp_wait()
            if self.optimizer_depth:  # a closure's backward: back in the optimizer step
                self._open_phase("optimizer")

    @_guarded
    @_own_time
    def optimizer_begin(self) -> None:
        self.optimizer_depth += 1
        if self.optimizer_depth > 1:
            return  # an optimizer stepping another (a wrapper's step calls the inner one's)
        if self.step_end is not None and not self.explicit_steps and not self.closure_steps:
            self.step_end = None  # another optimizer right after the last: the same step
            self._open_phase("optimizer")
        elif self._ensure_step():
            self._close_phase()
            self._open_phase("optimizer")

    @_guarded
    @_own_time
    def optimizer_end(self) -> None:
        self.optimizer_depth = max(0, self.optimizer_depth - 1)
        if self.optimizer_depth or not self.in_step:
            return
        self._close_phase()  # the optimizer's (or, closure style, what the closure left open)
        if not self.explicit_steps:
            self.step_end = _clocks()

    # -- torch.distributed.pipelining (telemetry/pipelining_hooks.py) --------------------------

    @_guarded
    def on_pipeline_stage(self, stage_index: int, num_stages: int, group) -> None:
        """A PipelineStage was built on this rank: its sends and receives are on `pp`."""
        group = group if group is not None else dist.group.WORLD
        self.pipeline.stages.append(int(stage_index))
        self.pipeline.num_stages = int(num_stages)
        self.pipeline.group_ranks = list(dist.get_process_group_ranks(group))
        if self.comm_hooks is not None:
            self.comm_hooks.groups.name_group(group, "pp")

    @_guarded
    def on_pipeline_schedule(self, class_name: str, micro_batches: int | None) -> None:
        self.pipeline.schedule_class = class_name
        self.pipeline.micro_batches = micro_batches

    @_guarded
    @_own_time
    def schedule_begin(self) -> None:
        self.schedule_depth += 1
        if self.schedule_depth == 1 and self._ensure_step():
            self._close_phase()
            self._open_phase(names.PIPELINE_WAIT)

    @_guarded
    @_own_time
    def schedule_end(self) -> None:
        self.schedule_depth = max(0, self.schedule_depth - 1)
        if self.schedule_depth == 0 and self.phase is not None \
                and self.phase[0] == names.PIPELINE_WAIT:  # fmt: skip
            self._close_phase()

    @_guarded
    @_own_time
    def chunk_begin(self, phase: str, micro_batch: int) -> None:
        self.chunk_depth += 1
        if self.chunk_depth == 1 and self._ensure_step():
            self._count(f"pipeline {phase} chunk")
            self._close_phase()
            if micro_batch >= 0:
                self.micro_batch = micro_batch
            self._open_phase(phase)

    @_guarded
    @_own_time
    def chunk_end(self) -> None:
        self.chunk_depth = max(0, self.chunk_depth - 1)
        if self.chunk_depth or not self.in_step:
            return
        self._close_phase()
        if self.schedule_depth:
            self._open_phase(names.PIPELINE_WAIT)

    # -- the API (ranktrace.step / ranktrace.phase) ---------------------------------------------

    @_guarded
    def begin_explicit_step(self) -> None:
        self.explicit_steps = True
        self._finish_pending_step()
        if self.in_step:
            self.end_step(_clocks())
        self._begin_step(_clocks())

    @_guarded
    def end_explicit_step(self, **values) -> None:
        if self.in_step:
            self._close_phase()
            self.end_step(_clocks(), **values)

    @_guarded
    def open_named_phase(self, name: str) -> None:
        if self._ensure_step():
            self._close_phase()
            self._open_phase(name)

    @_guarded
    def close_named_phase(self) -> None:
        self._close_phase()

    # -- communication (telemetry/comm_hooks.py) ----------------------------------------------

    @_guarded
    @_own_time
    def issue_comm(self, op, axis, group_id, size, nbytes, dtype, peer, is_async):
        """A call is being issued: the recorder's call entry, or None outside recorded steps."""
        if self.step == 0 and not self.in_step:
            return None  # set-up before the first step (broadcasts, process groups)
        if not self._ensure_step() or self.recorder.trace_every == 0:
            return None
        self._count(f"{op} call")
        # DDP's buckets are waited for in C++: the last one's exposure begins at its issue
        in_ddp = is_async and op == "all_reduce" and in_ddp_hook()
        mark = self.recorder.timer.mark(sample=in_ddp or not is_async)  # GPU: a CUDA event
        call = self.recorder.issue(op, axis, group_id, size, nbytes, dtype, mark, peer, is_async)
        if call is not None and in_ddp:
            self._ddp_calls.append(call)
        return call

    @_guarded
    def complete_comm(self, call, end_ns: int | None = None) -> None:
        """A call completed: now for a blocking call (a CUDA event after it on GPU, where the
        current stream waits for it), at host time `end_ns` for async work."""
        end = end_ns if end_ns is not None else self.recorder.timer.mark()
        with self._lock:
            self.recorder.complete(call, end)

    @_guarded
    def waited(self, call, start_ns: int, end_ns: int) -> None:
        """The rank blocked in a wait() for `call` from `start_ns` to `end_ns`."""
        with self._lock:
            self.recorder.add_wait(call, start_ns, end_ns)

    def _expose_ddp_wait(self) -> None:
        """DDP's reducer waits for its buckets in C++ at the end of backward: the rank was blocked
        for the last-issued bucket from its issue to its completion (the earlier buckets ran
        during the backward compute)."""
        if not self._ddp_calls:
            return
        now = self.recorder.host_mark()
        with self._lock:
            last = self._ddp_calls[-1]
            self.recorder.complete(last, now)
            if isinstance(last[8], int) and isinstance(last[9], int):  # host times (CPU)
                last[10] = max(0, last[9] - last[8])
        self._ddp_calls = []

    @_guarded
    def on_mesh(self, mesh) -> None:
        seen = MeshSeen.of(mesh)
        if seen is not None:
            self.meshes.append(seen)

    def note_capture_limited(self, note: str) -> None:
        """A hook that could not be installed after start-up: in the run's events."""
        if self.telemetry is not None:
            self.telemetry.event(names.EVENT_CAPTURE_LIMITED, self.step, note)
        else:
            self.capture_notes.append(note)

    # -- steps ----------------------------------------------------------------------------------

    def _ensure_step(self) -> bool:
        """Whether a step is being recorded now (beginning one when the job's hooks say so)."""
        if self.failed is not None:
            return False
        self._finish_pending_step()
        if self.in_step:
            return True
        if self.explicit_steps:
            return False
        self._begin_step(self.gap_start or _clocks())
        return self.in_step

    def _finish_pending_step(self) -> None:
        if self.step_end is not None:
            end, self.step_end = self.step_end, None
            self.end_step(end)

    def _begin_step(self, start: tuple) -> None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            return  # a model called before the job joined its process group: not a step yet
        if self.telemetry is None and not self._open():
            return
        began = time.perf_counter_ns()
        self.recorder.begin_step(self.step, start_ns=start[0], start_core_wait_ns=start[3])
        self._transition_ns += time.perf_counter_ns() - began
        self.in_step, self.micro_batch, self.own_ns = True, 0, 0
        now = _clocks()
        if self.gap_start is not None and not self.explicit_steps and now[0] > start[0]:
            self.recorder.add_phase(names.DATA, -1, start[0], now[0], now[1] - start[1],
                                    now[2] - start[2], _waited(start, now))  # fmt: skip
        if self.step == FLOP_COUNT_STEP:
            self._start_flop_count()

    def end_step(self, end: tuple, **values) -> None:
        """Close the current step at `end` and hand it to the recorder."""
        self._close_phase()
        flops = self._stop_flop_count() if self.step == FLOP_COUNT_STEP else None
        if flops is not None:
            self.step_flops = flops
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self.step_flops is not None and "flops" not in values:
            values["flops"] = self.step_flops * world  # the job's FLOPs (MFU: over the job's peak)
        values.setdefault("tokens", 0)
        self.recorder.own_ns += self.own_ns
        began = time.perf_counter_ns()
        if self.comm_hooks is not None:
            self.comm_hooks.time_gpu_work()
        self.recorder.end_step(end_ns=end[0], end_core_wait_ns=end[3], **values)
        self._transition_ns += time.perf_counter_ns() - began
        if self.comm_hooks is not None:
            self.comm_hooks.forget()
        self.in_step, self.gap_start, self.step = False, end, self.step + 1
        self.seen = {}

    def _count(self, what: str) -> None:
        self.seen[what] = self.seen.get(what, 0) + 1

    @_guarded
    def count_forward(self) -> None:
        """A call of a module that starts forwards, inside an open forward (no backward between:
        evaluation, or forwards before one backward): one more forward pass."""
        if self.in_step:
            self._count("forward pass")

    def _open_phase(self, name: str) -> None:
        self.phase = (name, self.micro_batch if name in ("forward", "backward") else -1, _clocks())

    def _close_phase(self) -> None:
        if self.phase is None:
            return
        name, micro_batch, start = self.phase
        now = _clocks()
        self.recorder.add_phase(name, micro_batch, start[0], now[0], now[1] - start[1],
                                now[2] - start[2], _waited(start, now))  # fmt: skip
        self.phase = None

    # -- FLOPs ------------------------------------------------------------------------------------

    def _start_flop_count(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        try:
            self._flop_counter = FlopCounterMode(display=False)
            self._flop_counter.__enter__()
        except Exception as error:
            self._flop_counter = None
            self.telemetry.event("flops_unavailable", self.step, f"{type(error).__name__}: {error}")

    def _stop_flop_count(self) -> float | None:
        counter, self._flop_counter = self._flop_counter, None
        if counter is None:
            return None
        try:
            counter.__exit__(None, None, None)
            return float(counter.get_total_flops())
        except Exception as error:
            self.telemetry.event("flops_unavailable", self.step, f"{type(error).__name__}: {error}")
            return None

    # -- opening and closing -------------------------------------------------------------------

    def _open(self) -> bool:
        """Open this rank's telemetry (once); False, with a one-line message, when it cannot."""
        try:
            self._open_telemetry()
            return True
        except Exception as error:
            self.failed = f"{type(error).__name__}: {error}"
            print(f"ranktrace: rank not recorded: {self.failed}", flush=True)
            return False

    def _open_telemetry(self) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        layout, coordinates = job_layout(self.meshes, rank, world, self.pipeline)
        device = _device()
        # a job's own ranks on this host (torchrun says): no collective of ours in its job
        on_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        peak = rank_peak(device, torch.float32, self.settings.run_dir.parent, on_host,
                         self.settings.peak_flops or None)  # fmt: skip
        peak, source = peak.rank_flops, peak.source
        identity = RankIdentity(self.settings.run_id, rank, pp=coordinates["pp"],
                                dp=coordinates["dp"], tp=coordinates["tp"],
                                host=socket.gethostname())  # fmt: skip
        context = StepContext(flops_per_token=0.0, job_peak_flops=peak * world, params_bytes=0,
                              grads_bytes=0, optimizer_bytes=0,
                              epoch_anchor_ns=epoch_anchor_ns())  # fmt: skip
        metadata = {
            "device": str(device),
            "world_size": world,
            "peak_flops": peak,
            "peak_flops_source": source,
            "clock_offset_ns": 0 if rank == 0 else None,
            **({"pipeline_stages": self.pipeline.stages} if self.pipeline.stages else {}),
        }  # a peer's: measured below
        self.telemetry = RankTelemetry.open(
            identity, self.settings.run_dir, context, {}, level=self.settings.level,
            trace_every=self.settings.trace_every, rank_metadata=metadata,
            cuda_memory=device.type == "cuda", timer=timer_for(device),
        )  # fmt: skip
        self.recorder = self.telemetry.recorder
        for note in self.capture_notes:
            self.telemetry.event(names.EVENT_CAPTURE_LIMITED, self.step, note)
        self._clock = clock_sync.start(_default_store(), self.settings.run_id, rank, world,
                                       self._record_clock_offset)  # fmt: skip
        if rank == 0:
            update_run_json(self.settings.run_dir, layout=layout, world_size=world,
                            device=str(device), backend=dist.get_backend()
                            if dist.is_initialized() else None,
                            **self.pipeline.run_record())  # fmt: skip

    def _record_clock_offset(self, offset_ns: int, round_trip_ns: int) -> None:
        """From the clock exchange's thread: this rank's clock against rank 0's (a lock of its
        own: the step thread never waits for this write)."""
        with self._metadata_lock:
            if self.telemetry is not None:
                self.telemetry.update_metadata(clock_offset_ns=offset_ns,
                                               clock_offset_rtt_ns=round_trip_ns)  # fmt: skip

    @_guarded
    def close(self) -> None:
        """At exit: finish a step ended by its optimizer, drop one left half done, flush."""
        if self.telemetry is None:
            return
        try:
            self._finish_pending_step()
            if self.in_step:
                seen = ", ".join(_counted(n, what) for what, n in self.seen.items())
                detail = "the job stopped before this step's optimizer step"
                if seen:
                    detail += f"{names.INCOMPLETE_STEP_SEEN}{seen}"
                self.telemetry.event("incomplete_step", self.step, detail)
            self.telemetry.close()
            if self.settings.owns_record and self.recorder.rank == 0:
                failed = getattr(sys, "last_value", None) is not None  # an uncaught exception
                update_run_json(self.settings.run_dir, finished_at=time.time(),
                                status="failed" if failed else "completed")  # fmt: skip
        finally:
            if self._clock is not None:
                self._clock.finish()
            with self._metadata_lock:  # the clock exchange's thread writes no more
                self.telemetry = None


def _counted(n: int, what: str) -> str:
    """A count in words: "1 forward pass", "12 forward passes", "2 all_reduce calls"."""
    return f"{n} {what}" if n == 1 else f"{n} {what}{'es' if what.endswith('s') else 's'}"


def _default_store():
    """The store of the job's default process group, else None (a private torch function)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _device() -> torch.device:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _number(text: str | None) -> float:
    try:
        return max(0.0, float(text)) if text else 0.0
    except ValueError:
        return 0.0
