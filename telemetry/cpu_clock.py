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
