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

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

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


class CoreWaitSeries:
    """The step thread's wait for a core sampled at the moments the recorder marks (calls
    issued, waited for and completed, the step's bounds), so that the wait inside each compute
    gap between two calls is known (analysis/contention.py prices gaps without it). Samples
    may come from any thread: they read the step thread's counter, through a file kept open
    on that thread's schedstat. Appends only; `at()` resolves once per step."""

    def __init__(self) -> None:
        tid = threading.get_native_id()
        try:
            self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = -1
        self.samples: list[tuple[int, int]] = []  # (perf_counter ns, core wait ns)
        self._last_read_ns = -MIN_READ_SPACING_NS

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
        3-10 µs): the counter there, interpolated, is off by at most twice that spacing."""
        if ns is None:
            ns = time.perf_counter_ns()
        if core_wait_ns is None:
            if self.samples and 0 <= ns - self._last_read_ns < MIN_READ_SPACING_NS:
                return
            core_wait_ns = self.read()
            self._last_read_ns = ns
        if core_wait_ns is not None:
            self.samples.append((ns, core_wait_ns))

    def at(self, ns: list[int]) -> list[int] | None:
        """The counter at each of `ns`, interpolated between the samples around it (held at the
        ends), then forget the samples; None without two samples."""
        samples, self.samples = sorted(self.samples), []
        self._last_read_ns = -MIN_READ_SPACING_NS  # the next step's first moment is read
        if len(samples) < 2:
            return None
        times = np.fromiter((t for t, _ in samples), np.float64, len(samples))
        waits = np.fromiter((w for _, w in samples), np.float64, len(samples))
        return np.interp(np.asarray(ns, np.float64), times, waits).astype(np.int64).tolist()


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
