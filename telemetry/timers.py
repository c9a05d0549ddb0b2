"""Clocks for the hot path: wall-clock marks on CPU, CUDA events on GPU.

A *mark* is taken at the start and end of each communication call. On CPU (gloo blocks until the
operation is done) a mark is simply `perf_counter_ns()`. On GPU a mark is a CUDA event recorded
on the current stream; events are resolved to nanoseconds once per step, at step end, against
an anchor taken at step start: no synchronisation per collective.

All ns values are CLOCK_MONOTONIC, which every process on one host shares; `epoch_anchor_ns`
turns them into Unix-epoch ns for export.
"""

from __future__ import annotations

import time

import torch


def epoch_anchor_ns() -> int:
    """Add this to a perf_counter_ns() value to get Unix-epoch ns (±1 µs)."""
    return time.time_ns() - time.perf_counter_ns()


class WallTimer:
    """CPU: a mark is the monotonic clock in ns; with a `series` attached (telemetry.cpu_clock
    CoreWaitSeries), each mark also samples the step thread's wait for a core."""

    series = None

    def mark(self, sample: bool = True) -> int:
        """Now; `sample=False` where the moment bounds no compute gap (async work's issue:
        its gaps end where the rank waits for it), sparing a read of the wait for a core."""
        return time.perf_counter_ns()

    def attach(self, series) -> None:
        """Sample `series` at every mark: `mark` becomes the series' own, one Python call a
        mark instead of two (1.1 µs less a mark after a matmul, median of 3000; a tp2 dp2
        step has 86 marks)."""
        self.series = series
        self.mark = series.mark

    def begin_step(self) -> None:
        pass

    def to_ns(self, mark) -> int:
        return mark

    def end_step(self) -> None:
        pass


class CudaEventTimer:
    """GPU: a mark is a CUDA event; `to_ns` is valid after `end_step` synchronised once."""

    def __init__(self) -> None:
        self._anchor_event: torch.cuda.Event | None = None
        self._anchor_ns = 0

    def mark(self, sample: bool = True) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin_step(self) -> None:
        torch.cuda.synchronize()  # once per step: the anchor's host time is its device time
        self._anchor_ns = time.perf_counter_ns()
        self._anchor_event = self.mark()

    def to_ns(self, mark) -> int:
        if isinstance(mark, int):  # a host time (async work completed in a future's callback)
            return mark
        elapsed_ms = self._anchor_event.elapsed_time(mark)
        return self._anchor_ns + int(elapsed_ms * 1e6)

    def end_step(self) -> None:
        torch.cuda.synchronize()


Timer = WallTimer | CudaEventTimer


def timer_for(device: torch.device) -> Timer:
    return CudaEventTimer() if device.type == "cuda" else WallTimer()
