"""CPU time beside wall time: what a rank's main thread (and its whole process) spent on a core.

A phase whose wall time grows while its CPU time does not was waiting for a core (another
process or rank on it): host contention, not slower compute. Simulated device time counts as
CPU time: the CPU fault injector sleeps most of a slowed device's extra time to spare the shared
cores (trainer/fault_injection.py), and that sleep stands for device work.
"""

from __future__ import annotations

import os
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
