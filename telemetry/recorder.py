"""The hot path: per-rank phase and collective timings of the current step, as tuple appends.

Nothing here builds spans or touches files; `StepTelemetry.end_step` hands one `StepRecord` to
the sink at step end. A communication call costs a counter update and one tuple append.

Every collective gets a sequence number on its axis (point-to-point transfers: with their peer).
All members of a group issue their collectives in the same order, so (axis, group_id, seq) names
one collective instance across ranks: that is what lets analysis compare the members' start
times and split each duration into transfer and blocking.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ranktrace.telemetry.cpu_clock import process_cpu_ns, thread_cpu_ns
from ranktrace.telemetry.timers import Timer


@dataclass
class StepRecord:
    """What one rank measured in one step (host monotonic ns, see telemetry.timers)."""

    step: int
    start_ns: int
    end_ns: int
    traced: bool
    """Whether this step's collectives are exported one by one (see --trace-every)."""
    phases: list[tuple[str, int, int, int, int, int]] = field(default_factory=list)
    """(phase, micro_batch or -1, start_ns, end_ns, thread_cpu_ns, process_cpu_ns): the CPU
    times are what the main thread and the whole process spent on a core during the phase
    (telemetry.cpu_clock)."""
    collectives: list[tuple] = field(default_factory=list)
    """(op, axis, group_id, group_size, seq, peer, nbytes, dtype, start_ns, end_ns)"""
    values: dict = field(default_factory=dict)
    """loss, grad_norm, tokens, lr, ... as given by the trainer."""

    @property
    def comm_ns(self) -> int:
        return sum(c[9] - c[8] for c in self.collectives)


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
        self._pending: list[tuple] = []  # collectives of this step, marks unresolved
        self._record: StepRecord | None = None

    def begin_step(self, step: int) -> None:
        self.timer.begin_step()
        traced = self.trace_every > 0 and step % self.trace_every == 0
        self._record = StepRecord(step, time.perf_counter_ns(), 0, traced)

    @contextmanager
    def phase(self, name: str, micro_batch: int = -1) -> Iterator[None]:
        """Time a host-side phase of the current step (monotonic host clock, like every ns here)
        and the CPU time spent in it."""
        start, thread_cpu, process_cpu = time.perf_counter_ns(), thread_cpu_ns(), process_cpu_ns()
        try:
            yield
        finally:
            self._record.phases.append((name, micro_batch, start, time.perf_counter_ns(),
                                        thread_cpu_ns() - thread_cpu,
                                        process_cpu_ns() - process_cpu))  # fmt: skip

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
        """Comm observer: called once per finished communication call."""
        if peer >= 0:  # point-to-point: instances are numbered per pair of ranks
            seq = self._peer_seq.get(peer, 0)
            self._peer_seq[peer] = seq + 1
            group_id = min(self.rank, peer)
        else:
            seq = self._axis_seq.get(axis, 0)
            self._axis_seq[axis] = seq + 1
            group_id = self.group_ids.get(axis, -1)
        if self._record is not None:  # calls outside a step (set-up, export) are not recorded
            self._pending.append(
                (op, axis, group_id, group_size, seq, peer, nbytes, dtype, start_mark, end_mark)
            )

    def end_step(self, **values) -> StepRecord:
        """Close the step: resolve marks, attach `values`, hand the record to the sink."""
        record, timer = self._record, self.timer
        timer.end_step()
        to_ns = timer.to_ns
        record.collectives = [(*c[:8], to_ns(c[8]), to_ns(c[9])) for c in self._pending]
        record.end_ns = time.perf_counter_ns()
        record.values = values
        self._pending, self._record = [], None
        self.sink(record)
        return record


class NullTelemetry:
    """`--telemetry off`: the same interface, recording nothing."""

    @contextmanager
    def phase(self, name: str, micro_batch: int = -1) -> Iterator[None]:
        yield

    def begin_step(self, step: int) -> None:
        pass

    def end_step(self, **values) -> None:
        return None
