"""Applying parsed `--inject` faults inside one rank (the specs: trainer/faults.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator

import torch

from ranktrace.telemetry.cpu_clock import simulated_device_time
from ranktrace.trainer.faults import LINK_AXES, ONE_OFF_KINDS, FaultSpec

CPU_BURN_SHARE = 0.25
"""On CPU, the share of a compute slowdown spent in real work; the rest sleeps. Ranks share the
machine's cores, and busy work also slows the ranks it shares them with (measured: at 0.5 with 8
ranks on 2 cores, a 1.3x rank made a rank of another stage look 1.2x slow), which a throttled
GPU does not do; on GPU all of it is work."""


def burn(seconds: float, device: torch.device) -> None:
    """Spend `seconds` doing real matrix multiplications on `device` (a throttled device does
    the same work slower); on CPU partly sleeping (see CPU_BURN_SHARE)."""
    if device.type == "cpu":
        with simulated_device_time():  # the sleep stands for the slowed device's work
            time.sleep(seconds * (1.0 - CPU_BURN_SHARE))
        seconds *= CPU_BURN_SHARE
    a = torch.full((64, 64), 0.5, device=device)
    out = torch.empty_like(a)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        torch.mm(a, a, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class RankFaults:
    """The faults that hit one rank, applied by the trainer at the right places."""

    def __init__(
        self, faults: list[FaultSpec], rank: int, device: torch.device, first_attempt: bool = True
    ) -> None:
        """`first_attempt`: whether this is the launch's first attempt (one-off faults fire)."""
        self.faults = [
            f for f in faults if f.rank == rank and (first_attempt or f.kind not in ONE_OFF_KINDS)
        ]
        self.device = device
        self.step = 0

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _active(self, kind: str) -> list[FaultSpec]:
        return [f for f in self.faults if f.kind == kind and f.active(self.step)]

    def begin_step(self, step: int, link_delays: dict[str, float]) -> None:
        """Enter `step`: fill `link_delays` (the comm module's per-axis delay table)."""
        self.step = step
        link_delays.clear()
        for fault in self._active("link"):
            for axis in (fault.axis,) if fault.axis else LINK_AXES:
                link_delays[axis] = link_delays.get(axis, 0.0) + fault.delay_s

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Wrap forward or backward work: afterwards spend (factor - 1) × its time again."""
        factors = [f.factor for f in self._active("compute")]
        if not factors:
            yield
            return
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        burn(elapsed * (max(factors) - 1.0), self.device)

    def slow_data(self) -> None:
        """Inside the data phase: the loader is slow."""
        for fault in self._active("data"):
            time.sleep(fault.delay_s)

    def host_pause(self) -> None:
        """Between phases: a pause of the whole process every `every` steps (from `from`)."""
        for fault in self._active("pause"):
            if (self.step - fault.first_step) % fault.every == 0:
                time.sleep(fault.duration_s)

    def crash_if_due(self, before_death: Callable[[], None]) -> None:
        """At the start of a step: die (SIGKILL, no clean-up) if a crash is due now."""
        if self._active("crash"):
            before_death()
            os.kill(os.getpid(), signal.SIGKILL)

    def hang_if_due(self, before_hang: Callable[[], None]) -> None:
        """At the start of a step: stop for good (a deadlock, a stuck driver call) if a hang is
        due now; the process stays alive until the collective-timeout watchdog or the
        launcher ends it."""
        if self._active("hang"):
            before_hang()
            while True:
                time.sleep(1.0)

    def io_delay_s(self) -> float:
        """Extra seconds this rank's checkpoint write takes now (a slow disk or file system)."""
        return sum(f.delay_s for f in self._active("io"))
