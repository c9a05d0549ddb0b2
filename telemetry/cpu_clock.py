"""CPU time beside wall time: what a rank's main thread (and its whole process) spent on a core,
and how long the main thread waited for one.

The wait for a core is the kernel's own count: the time the thread was runnable but not running
(the second field of /proc/thread-self/schedstat). A phase that grows by that much was waiting
for a core (another process or rank on it): host contention, not slower compute. Time the thread
slept or was blocked (I/O, a device, a sleep standing for device work) is no wait for a core.
Where the kernel does not say, wall minus CPU time is read as the wait (analysis/peers.py);
simulated device time then counts as CPU time: the CPU fault injector sleeps most of a slowed
device's extra time to spare the shared cores (trainer/fault_injection.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from operator import itemgetter

import numpy as np

_simulated_ns = 0
"""Simulated device time of this process so far (one writer: the rank's main thread)."""


def thread_cpu_ns() -> int:
    """CPU time of the calling thread plus the simulated device time, in ns."""
    return time.thread_time_ns() + _simulated_ns


def process_cpu_ns() -> int:
    """CPU time of the whole process (every thread) plus the simulated device time, in ns."""
    return time.process_time_ns() + _simulated_ns


_schedstat = threading.local()


def thread_core_wait_ns() -> int | None:
    """Time the calling thread has spent runnable but waiting for a core, in ns (None where
    /proc/thread-self/schedstat cannot be read). One pread of a file kept open per thread."""
    fd = getattr(_schedstat, "fd", None)
    if fd is None:
        try:
            fd = _schedstat.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            _schedstat.fd = -1
            return None
    if fd < 0:
        return None
    try:
        return int(os.pread(fd, 64, 0).split()[1])
    except (OSError, IndexError, ValueError):
        return None


MIN_READ_SPACING_NS = 20_000
"""Reads of the wait for a core closer together than 20 µs are one read (see `sample`): a
compute gap is priced in milliseconds."""

MARK_CEILING_NS = 50_000
"""A mark counts at most 50 µs of ranktrace's own time. On the ranks of `ranktrace train --tp 2
--dp 2 --model small` (4 ranks on 2 cores, 2,064 marks a rank) a mark took 12 µs (median),
26-43 µs (99th percentile per rank) where the thread was not switched out after its read; ~1
mark a step was, mostly for 0.1-2.3 ms (a collective just ended: its members' threads wake at
once). That time is a wait for a core, which the step's core wait counts; counted as own time
too it was 0.4-0.6 ms a step."""


class CoreWaitSeries:
    """The step thread's wait for a core sampled at the moments the recorder marks (calls
    issued, waited for and completed, the step's bounds), so that the wait inside each compute
    gap between two calls is known (analysis/contention.py prices gaps without it). Samples
    may come from any thread: they read the step thread's counter, through a file kept open
    on that thread's schedstat. Appends only; `at()` resolves once per step.

    A read costs 5-15 µs on a rank (the kernel's /proc path, cold after compute: ~2 µs in a
    tight loop) and a tp2 dp2 step makes 86: the largest part of ranktrace's own time there.
    `mark()` keeps the bytes as read (parsing them right after compute cost 0.5-2 µs more than
    in `at()`'s loop) and counts the time of its reads in `own_ns`, which the recorder adds to
    the step's own time."""

    def __init__(self) -> None:
        tid = threading.get_native_id()
        try:
            self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = -1
        self.samples: list[tuple[int, int | bytes]] = []
        """(perf_counter ns, core wait ns, or the schedstat bytes read then)."""
        self._last_read_ns = -MIN_READ_SPACING_NS
        self.own_ns = 0
        """Time spent in `mark()`'s reads so far (the recorder counts each step's share)."""

    @property
    def readable(self) -> bool:
        return self._fd >= 0

    def read(self) -> int | None:
        """The step thread's core wait so far, ns (None where the kernel does not say)."""
        try:
            return int(os.pread(self._fd, 64, 0).split()[1])
        except (OSError, IndexError, ValueError):
            return None

    def sample(self, ns: int | None = None, core_wait_ns: int | None = None) -> None:
        """Record the counter now (or a reading the caller took at `ns`). A moment within
        `MIN_READ_SPACING_NS` of the last read of this step is not read again (a read costs
        5-15 µs): the counter there, interpolated, is off by at most twice that spacing."""
        if ns is None:
            ns = time.perf_counter_ns()
        if core_wait_ns is None:
            if self.samples and 0 <= ns - self._last_read_ns < MIN_READ_SPACING_NS:
                return
            core_wait_ns = self.read()
            self._last_read_ns = ns
        if core_wait_ns is not None:
            self.samples.append((ns, core_wait_ns))

    def mark(self, sample: bool = True) -> int:
        """perf_counter ns now, sampled like `sample()` unless `sample` is False (the hot path
        of every mark, telemetry.timers `WallTimer.attach`: the bytes kept as read, the read's
        time added to `own_ns`)."""
        now = time.perf_counter_ns()
        if not sample or (self.samples and now - self._last_read_ns < MIN_READ_SPACING_NS):
            return now
        try:
            data = os.pread(self._fd, 64, 0)
        except OSError:
            return now
        self._last_read_ns = now
        self.samples.append((now, data))
        self.own_ns += min(time.perf_counter_ns() - now, MARK_CEILING_NS)
        return now

    def at(self, ns: list[int]) -> list[int] | None:
        """The counter at each of `ns`, interpolated between the samples around it (held at the
        ends), then forget the samples; None without two samples."""
        samples, self.samples = self.samples, []
        self._last_read_ns = -MIN_READ_SPACING_NS  # the next step's first moment is read
        samples.sort(key=itemgetter(0))  # in order already, but for a caller's reading
        try:
            waits = [w if type(w) is int else int(w.split()[1]) for _, w in samples]
            times = [t for t, _ in samples]
        except (IndexError, ValueError):  # a read the kernel garbled: the others stand
            times, waits = [], []
            for t, w in samples:
                with contextlib.suppress(IndexError, ValueError):
                    waits.append(w if type(w) is int else int(w.split()[1]))
                    times.append(t)
        if len(times) < 2:
            return None
        return np.interp(np.asarray(ns, np.float64), np.asarray(times, np.float64),
                         np.asarray(waits, np.float64)).astype(np.int64).tolist()  # fmt: skip


@contextmanager
def simulated_device_time() -> Iterator[None]:
    """Count the wall time of the block (e.g. a sleep standing for device work) as CPU time."""
    global _simulated_ns
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        _simulated_ns += time.perf_counter_ns() - start


def cpu_affinity() -> list[int]:
    """The cores this process may run on (all of them where the platform cannot say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))
