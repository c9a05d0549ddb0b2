"""The collective-timeout watchdog (`--collective-timeout SECONDS`): a hung job becomes a
diagnosis and a non-zero exit instead of an endless wait.

A thread on every rank looks at the rank's communication twice a second. When the call in
flight has waited longer than the timeout, or no call has finished for that long, the rank
records what it is doing (`in_flight`: op, axis, group members, sequence number, step, seconds
waited; op null when it is in no collective) and, if it was waiting in a collective, a
`collective_timeout` alert. It writes them out at once, prints one line, lets its peers do the
same for a short grace period, and exits with HANG_EXIT_CODE. A rank that everyone else waits
for is then the one missing from their collective (analysis/resilience.py, MegaScale-style).

A rank in no collective (the hung one, typically) starts counting when its step began, earlier
than its peers, who start when they block: it records, then waits a whole timeout more before
exiting, so that its peers record first (their exit ends the job). Checkpoint saves are not
watched: a slow file system is not a hang (the save is timed in telemetry instead).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ranktrace.telemetry.names import EVENT_COLLECTIVE_TIMEOUT, EVENT_IN_FLIGHT
from ranktrace.trainer.comm import Comm

HANG_EXIT_CODE = 3
SAVE_OP = "checkpoint_save"
"""The in-flight operation a checkpoint save shows as (not subject to the timeout)."""
GRACE_S = 2.0
"""Time between a rank recording its state and exiting: every peer reaches its own timeout
within it (they started waiting within a step of each other), so none is killed before it
recorded (the launcher stops the whole job as soon as one rank exits)."""


class CollectiveWatchdog:
    """Watches one rank's `Comm`; `record(kind, step, detail)` stores an event durably."""

    def __init__(
        self,
        comm: Comm,
        timeout_s: float,
        record: Callable[[str, int, str], None],
        flush: Callable[[], None],
    ) -> None:
        self.comm, self.timeout_s = comm, timeout_s
        self.record, self.flush = record, flush
        self.step = -1
        self._groups: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="collective-watchdog", daemon=True)

    def start(self) -> CollectiveWatchdog:
        for axis in ("tp", "pp", "dp", "world"):  # read once, here: not from the thread later
            group = self.comm.dims.group(axis)
            self._groups[axis] = sorted(dist.get_process_group_ranks(group))
        self._thread.start()
        return self

    def begin_step(self, step: int) -> None:
        """The training loop's progress: a new step counts as activity."""
        self.step = step
        self.comm.last_done = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def state(self) -> dict:
        """What this rank is doing now: the call in flight (if any) and how long it waited."""
        now = time.monotonic()
        in_flight = self.comm.in_flight
        rank = self.comm.dims.rank
        if in_flight is None:
            return {"op": None, "axis": None, "group": [rank], "seq": None, "step": self.step,
                    "waited_s": round(now - self.comm.last_done, 3)}  # fmt: skip
        op, axis, peers, seq, started = in_flight
        group = sorted({rank, *peers}) if peers else self._groups[axis]
        return {"op": op, "axis": axis, "group": group, "seq": seq, "step": self.step,
                "waited_s": round(now - started, 3)}  # fmt: skip

    def _watch(self) -> None:
        interval = min(0.5, self.timeout_s / 4)
        while not self._stop.wait(interval):
            in_flight = self.comm.in_flight
            if in_flight is not None and in_flight[0] == SAVE_OP:
                continue
            state = self.state()
            if state["waited_s"] > self.timeout_s:
                self._timed_out(state)

    def _timed_out(self, state: dict) -> None:
        rank = self.comm.dims.rank
        detail = json.dumps({**state, "timeout_s": self.timeout_s})
        if state["op"] is not None:
            self.record(EVENT_COLLECTIVE_TIMEOUT, state["step"], detail)
            where = (f"{state['op']} on {state['axis']} (group {state['group']}, "
                     f"call #{state['seq']})")  # fmt: skip
        else:
            where = "no collective (no progress)"
        self.record(EVENT_IN_FLIGHT, state["step"], detail)
        self.flush()
        print(
            f"ranktrace: rank {rank}: collective timeout at step {state['step']}: waited "
            f"{state['waited_s']:.1f} s > {self.timeout_s:g} s in {where}",
            file=sys.stderr,
            flush=True,
        )
        # A waiting rank exits after the grace period; a rank in no collective lets its peers
        # reach their own timeout first (they started waiting later than it stopped).
        time.sleep(GRACE_S if state["op"] is not None else self.timeout_s + GRACE_S)
        os._exit(HANG_EXIT_CODE)
