"""How a rank stops when the launcher ends the job: the launcher SIGTERMs the surviving ranks when
one dies, and waits 30 s before SIGKILLing them.

The signal becomes SystemExit in the main thread, so the rank leaves through Python and writes
what it recorded; inside `deferred()` (a telemetry flush) it waits for the block's end, so a
segment is never cut in half. A rank blocked in a collective cannot run a Python handler until
the collective returns, and a survivor waiting for a peer that waits elsewhere never returns
(seen here: 2 of 3 crashed 8-rank jobs took 32-35 s to end, the 30 s of the launcher's grace).
So a watcher thread, woken by the signal itself (Python's wakeup descriptor is written by the C
handler, whatever the main thread is doing), ends the process STUCK_GRACE_S later if the main
thread has not: its records are those of its last flush, as after a SIGKILL, only 27 s sooner.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

STUCK_GRACE_S = 3.0
"""Seconds a rank has, after SIGTERM, to leave through Python before it is ended."""


class Termination:
    """SIGTERM as SystemExit, deferred during flushes, and never later than STUCK_GRACE_S."""

    def __init__(self) -> None:
        self.depth, self.pending = 0, 0

    def install(self) -> None:
        """Handle SIGTERM in this process (call from the main thread)."""
        signal.signal(signal.SIGTERM, self._handle)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        watcher = threading.Thread(target=self._end_if_stuck, args=(read_fd,), daemon=True)
        watcher.start()

    def _handle(self, signum: int, frame) -> None:
        if self.depth:
            self.pending = signum
            return
        sys.exit(128 + signum)

    def _end_if_stuck(self, read_fd: int) -> None:
        """Wait for SIGTERM; give the main thread STUCK_GRACE_S (and any flush under way) to
        leave, then end the process."""
        while signal.SIGTERM not in os.read(read_fd, 64):
            pass
        deadline = time.monotonic() + STUCK_GRACE_S
        while time.monotonic() < deadline or self.depth:
            time.sleep(0.05)
        os._exit(128 + signal.SIGTERM)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A block SIGTERM does not cut: the exit waits for its end."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending:
                sys.exit(128 + self.pending)


TERMINATION = Termination()
"""The rank process's one handler (signals are per process)."""
