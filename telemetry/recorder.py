"""The hot path: per-rank phase and collective timings of the current step, as tuple appends.

Nothing here builds spans or touches files; `StepTelemetry.end_step` hands one `StepRecord` to
the sink at step end. A communication call costs a counter update and one list append; on CPU
ranks also a read of the step thread's wait for a core at each of its marks (5-15 µs each on a
rank, telemetry.cpu_clock `CoreWaitSeries`), so that each compute gap's own wait is known.

ranktrace's own time in a step (`StepRecord.own_ns`, `steps.ranktrace_s`) is the step thread's
time in this code: the hot path per call, the marks' reads, the phases' bookkeeping and the
previous step's hand-over to the sink. A phase's four CPU-clock reads (2-3 µs each on a rank)
are inside the phase instead: reading a CPU clock is where the kernel ends a thread's expired
time slice (it updates the thread's runtime; with a busy process on the core, 8% of such reads
took > 100 µs, against 0.1% of /proc reads), and that wait for a core belongs with the phase
whose wall, CPU time and core wait bracket it, not with ranktrace's work.

Every collective gets a sequence number on its axis (point-to-point transfers: with their peer).
All members of a group issue their collectives in the same order, so (axis, group_id, seq) names
one collective instance across ranks: that is what lets analysis compare the members' start
times and split each duration into transfer and blocking.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ranktrace.telemetry.cpu_clock import (
    CoreWaitSeries,
    process_cpu_ns,
    thread_core_wait_ns,
    thread_cpu_ns,
)
from ranktrace.telemetry.timers import Timer, WallTimer


@dataclass
class StepRecord:
    """What one rank measured in one step (host monotonic ns, see telemetry.timers)."""

    step: int
    start_ns: int
    end_ns: int
    traced: bool
    """Whether this step's collectives are exported one by one (see --trace-every)."""
    phases: list[tuple] = field(default_factory=list)
    """(phase, micro_batch or -1, start_ns, end_ns, thread_cpu_ns, process_cpu_ns,
    core_wait_ns, tokens): the CPU times are what the main thread and the whole process spent
    on a core during the phase, `core_wait_ns` how long the main thread waited for one (None:
    unknown; telemetry.cpu_clock); `tokens` the micro-batch's, where the caller gave them."""
    collectives: list[tuple] = field(default_factory=list)
    """(op, axis, group_id, group_size, seq, peer, nbytes, dtype, start_ns, end_ns, wait_ns,
    core_wait_start_ns, core_wait_end_ns): `wait_ns` is None for a blocking call; for async work
    (issue to completion) the time the rank was blocked waiting for it. The last two: the step
    thread's wait for a core since the step began, when the rank began to wait for the call (a
    blocking call's start; async work: `end_ns - wait_ns`) and at its end (None: unknown)."""
    core_wait_ns: int | None = None
    """The step thread's wait for a core over the whole step (None: unknown)."""
    values: dict = field(default_factory=dict)
    """loss, grad_norm, tokens, lr, ... as given by the trainer."""
    own_ns: int = 0
    """ranktrace's own time in this step: its hot path, and the previous step's hand-over to the
    sink (span building, segment flushes)."""

    @property
    def comm_ns(self) -> int:
        """The time the rank spent in communication (an async call: only its waits)."""
        return sum(c[9] - c[8] if c[10] is None else c[10] for c in self.collectives)

    @property
    def comm_outside_phases_ns(self) -> int:
        """The part of `comm_ns` spent outside every phase: a framework's own collectives between
        its phases (Lightning broadcasts once a step between loading the batch and its optimizer
        step). Without it, that time read as a host pause on the waiting rank."""
        if not self.collectives:
            return 0
        merged: list[list[int]] = []  # the phases' union, [start_ns, end_ns] sorted
        for start, end in sorted((p[2], p[3]) for p in self.phases):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        starts = [start for start, _ in merged]
        outside = 0
        for call in self.collectives:  # the time waited: a blocking call's span, async: its wait
            end = call[9]
            begin = call[8] if call[10] is None else end - call[10]
            inside = 0
            index = max(0, bisect_right(starts, begin) - 1)
            while index < len(merged) and merged[index][0] < end:
                inside += max(0, min(end, merged[index][1]) - max(begin, merged[index][0]))
                index += 1
            outside += end - begin - inside
        return outside


class StepTelemetry:
    """Collects one rank's timings step by step and passes each finished step to `sink`.

    Args:
        rank: this rank's global rank.
        group_ids: for each axis, an id shared by the members of this rank's group on it
            (the lowest global rank in the group).
        trace_every: export collectives one by one on every Nth step (0: never).
        sink: callable receiving each finished `StepRecord`.
        timer: where marks come from (wall clock on CPU, CUDA events on GPU).
    """

    def __init__(self, rank: int, group_ids: dict[str, int], trace_every: int, sink, timer: Timer):
        self.rank, self.group_ids = rank, group_ids
        self.trace_every = trace_every
        self.sink, self.timer = sink, timer
        self._axis_seq = dict.fromkeys(group_ids, 0)
        self._peer_seq: dict[int, int] = {}
        self._pending: list[list] = []  # calls of this step, marks unresolved
        self._record: StepRecord | None = None
        self.own_ns = 0  # ranktrace's own time in the current step (StepRecord.own_ns)
        self._sink_ns = 0  # the previous step's hand-over to the sink
        self._marks_ns = 0  # the core-wait series' own time when the step began
        self.core_wait: CoreWaitSeries | None = None  # CPU ranks: sampled at every mark
        if isinstance(timer, WallTimer):
            series = CoreWaitSeries()
            if series.readable:
                self.core_wait = series
                timer.attach(series)

    def begin_step(self, step: int, start_ns: int | None = None,
                   start_core_wait_ns: int | None = None) -> None:  # fmt: skip
        """Open `step`, starting now or at `start_ns` (perf_counter ns; the step thread's wait
        for a core read then, when the caller has it)."""
        began = time.perf_counter_ns()
        self.timer.begin_step()  # on GPU: a synchronize
        traced = self.trace_every > 0 and step % self.trace_every == 0
        start = time.perf_counter_ns() if start_ns is None else start_ns
        if self.core_wait is not None:
            self._marks_ns = self.core_wait.own_ns  # marks between steps are no step's
            if start_ns is None or start_core_wait_ns is not None:
                self.core_wait.sample(start, start_core_wait_ns)
        self._record = StepRecord(step, start, 0, traced)
        self.own_ns = self._sink_ns + time.perf_counter_ns() - began

    def host_mark(self) -> int:
        """perf_counter ns now, sampling the wait for a core on CPU ranks (a moment the
        recorder times on the host: a wait() of async work, its completion)."""
        if self.core_wait is not None:
            return self.core_wait.mark()
        return time.perf_counter_ns()

    def phase(self, name: str, micro_batch: int = -1, tokens: int | None = None) -> _Phase:
        """Time a host-side phase of the current step (monotonic host clock, like every ns here)
        and the CPU time spent in it; `tokens`: the micro-batch's (a forward phase's). A
        context manager."""
        return _Phase(self, name, micro_batch, tokens)

    def add_phase(self, name: str, micro_batch: int, start_ns: int, end_ns: int,
                  thread_cpu_ns: int, process_cpu_ns: int, core_wait_ns: int | None = None,
                  tokens: int | None = None) -> None:  # fmt: skip
        """A phase of the current step measured by the caller (telemetry/job.py's hooks)."""
        self._record.phases.append((name, micro_batch, start_ns, end_ns, thread_cpu_ns,
                                    process_cpu_ns, core_wait_ns, tokens))  # fmt: skip

    def on_comm(
        self,
        op: str,
        axis: str,
        group_size: int,
        nbytes: int,
        dtype: torch.dtype,
        start_mark,
        end_mark,
        peer: int = -1,
    ) -> None:
        """Comm observer: called once per finished communication call (`issue` and `complete`
        in one, for a blocking call: 6 -> 4 µs a call on a tp2 dp2 rank)."""
        now = time.perf_counter_ns()
        group_id, seq = self._number(axis, self.group_ids.get(axis, -1), peer)
        if self._record is not None:
            self._pending.append([op, axis, group_id, group_size, seq, peer, nbytes, dtype,
                                  start_mark, end_mark, None])  # fmt: skip
        self.own_ns += time.perf_counter_ns() - now

    def _number(self, axis: str, group_id: int, peer: int) -> tuple[int, int]:
        """(group id, sequence number) of the next call on `axis`, or with `peer`."""
        if peer >= 0:  # point-to-point: instances are numbered per pair of ranks
            seq = self._peer_seq.get(peer, 0)
            self._peer_seq[peer] = seq + 1
            return min(self.rank, peer), seq
        seq = self._axis_seq.get(axis, 0)
        self._axis_seq[axis] = seq + 1
        return group_id, seq

    def issue(self, op: str, axis: str, group_id: int, group_size: int, nbytes: int, dtype,
              start_mark, peer: int = -1, is_async: bool = False) -> list | None:  # fmt: skip
        """Number a call being issued (every member numbers it alike) and, inside a step,
        return its entry: [op, axis, group_id, group_size, seq, peer, nbytes, dtype, start_mark,
        end_mark (None until it completes), wait_ns (None: a blocking call; async work: 0
        until the rank waits for it, `add_wait`)]."""
        group_id, seq = self._number(axis, group_id, peer)
        if self._record is None:  # calls outside a step (set-up, export) are not recorded
            return None
        call = [op, axis, group_id, group_size, seq, peer, nbytes, dtype, start_mark, None,
                0 if is_async else None]  # fmt: skip
        self._pending.append(call)
        return call

    @staticmethod
    def complete(call: list, end_mark) -> None:
        """`call` (an entry of `issue`) ended at `end_mark`, unless its end is known already."""
        if call[9] is None:
            call[9] = end_mark

    @staticmethod
    def add_wait(call: list, start_ns: int, end_ns: int) -> None:
        """The rank blocked in a wait for async `call` from `start_ns` to `end_ns` (host time);
        the call has ended by then."""
        call[10] = (call[10] or 0) + end_ns - start_ns
        StepTelemetry.complete(call, end_ns)

    def end_step(self, end_ns: int | None = None, end_core_wait_ns: int | None = None,
                 **values) -> StepRecord:  # fmt: skip
        """Close the step (now, or at `end_ns`, with the wait for a core read then): resolve
        marks, attach `values`, hand the record to the sink."""
        start = time.perf_counter_ns()
        record, timer = self._record, self.timer
        timer.end_step()  # on GPU: a synchronize, then the events resolve
        record.end_ns = time.perf_counter_ns() if end_ns is None else end_ns
        pending, to_ns = self._pending, timer.to_ns
        # a mark that is an int is host ns already (every mark on CPU): no call to resolve it
        starts = [c[8] if type(c[8]) is int else to_ns(c[8]) for c in pending]
        ends = [c[9] if type(c[9]) is int else _end_ns(c, timer, record.end_ns) for c in pending]
        waits = None  # the core wait since the step's start at each call's busy start and end
        if self.core_wait is not None:
            if end_ns is None or end_core_wait_ns is not None:
                self.core_wait.sample(record.end_ns, end_core_wait_ns)
            waits, record.core_wait_ns = _core_waits(pending, starts, ends, record,
                                                     self.core_wait)  # fmt: skip
        if waits is None:
            record.collectives = [
                (*c[:8], start, end, c[10], None, None)
                for c, start, end in zip(pending, starts, ends, strict=True)
            ]
        else:
            n = len(pending)
            record.collectives = [(*c[:8], starts[i], ends[i], c[10], waits[i], waits[n + i])
                                  for i, c in enumerate(pending)]  # fmt: skip
        record.values = values
        record.own_ns = self.own_ns
        if self.core_wait is not None:  # the marks' reads of the wait for a core
            record.own_ns += self.core_wait.own_ns - self._marks_ns
        self._pending, self._record = [], None
        self.sink(record)
        self._sink_ns = time.perf_counter_ns() - start  # counted in the next step
        return record


class _Phase:
    """One `StepTelemetry.phase`: its clocks read at entry and exit (a class: contextlib's
    generator wrapper cost ~2 µs more a phase). The CPU clocks are read inside the phase's wall
    time, the wait for a core just outside it: see the module docstring."""

    __slots__ = ("core_wait", "micro_batch", "name", "process_cpu", "recorder", "start",
                 "thread_cpu", "tokens")  # fmt: skip

    def __init__(self, recorder: StepTelemetry, name: str, micro_batch: int,
                 tokens: int | None) -> None:  # fmt: skip
        self.recorder, self.name = recorder, name
        self.micro_batch, self.tokens = micro_batch, tokens

    def __enter__(self) -> None:
        entered = time.perf_counter_ns()
        self.core_wait = thread_core_wait_ns()
        self.start = time.perf_counter_ns()
        self.thread_cpu, self.process_cpu = thread_cpu_ns(), process_cpu_ns()
        self.recorder.own_ns += self.start - entered

    def __exit__(self, *exc) -> None:
        thread_cpu, process_cpu = thread_cpu_ns(), process_cpu_ns()
        end = time.perf_counter_ns()
        waited = thread_core_wait_ns()
        recorder, before = self.recorder, self.core_wait
        recorder.add_phase(self.name, self.micro_batch, self.start, end,
                           thread_cpu - self.thread_cpu, process_cpu - self.process_cpu,
                           None if before is None or waited is None else waited - before,
                           self.tokens)  # fmt: skip
        recorder.own_ns += time.perf_counter_ns() - end


def _core_waits(pending: list[list], starts: list[int], ends: list[int], record: StepRecord,
                series: CoreWaitSeries) -> tuple[list[int] | None, int | None]:  # fmt: skip
    """(the step thread's core wait since the step's start at each call's busy start, then at
    each call's end; the step's whole core wait), None where unknown: see
    StepRecord.collectives. A call's busy start is its start (blocking), or async work's end
    less its wait."""
    busy = [end - c[10] if c[10] is not None else start
            for c, start, end in zip(pending, starts, ends, strict=True)]  # fmt: skip
    waits = series.at([record.start_ns, record.end_ns, *busy, *ends])
    if waits is None:
        return None, None
    base = waits[0]
    return [w - base for w in waits[2:]], waits[1] - base


def _end_ns(call: list, timer, step_end_ns: int) -> int:
    """A call's end in ns: its end mark, or its start plus a measured duration (`("after",
    ns)`: async GPU work timed on its own stream); when it never ended, the step's end for
    async work (it ran on until then at least), its start for a blocking call."""
    end = call[9]
    if end is None:
        return step_end_ns if call[10] is not None else timer.to_ns(call[8])
    if isinstance(end, tuple):
        return timer.to_ns(call[8]) + end[1]
    return timer.to_ns(end)


class NullTelemetry:
    """`--telemetry off`: the same interface, recording nothing."""

    @contextmanager
    def phase(self, name: str, micro_batch: int = -1,
              tokens: int | None = None) -> Iterator[None]:  # fmt: skip
        yield

    def begin_step(self, step: int) -> None:
        pass

    def end_step(self, **values) -> None:
        return None
