"""A job rank's epoch clock against rank 0's, measured over the job's own c10d store (`ranktrace
run` and `ranktrace.init()` jobs): no collective is issued, so the job's own order of
collectives is never disturbed, and no rank waits for another.

NTP style, in a background thread on each rank once its telemetry opens:
- a peer takes a ticket (`store.add`), so rank 0 serves peers in the order they arrive: one
  that never records holds nobody up, one that stops mid-exchange at most `PEER_PATIENCE_S`;
- for each round the peer writes a ping, rank 0 (looking for that key) answers with its clock
  `t_ref`, and the peer, having sent at `t0` and read the answer at `t1`, estimates
  `offset = (t0 + t1) / 2 - t_ref`, off by at most half the round trip `t1 - t0`;
- the round with the shortest round trip is kept.
On one host both clocks are one and the offset comes out near 0; across nodes it puts the ranks
on one time base (`ranks.clock_offset_ns`: the transfer / blocking split of the store's
`collectives` view and `ranktrace export-trace` apply it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

ROUNDS = 5
"""Ping rounds per peer: the shortest round trip of five is rarely one a descheduled thread
stretched."""
TICKET_POLL_S = 0.05
"""How often rank 0 looks for the next peer's ticket (a look is one store round trip)."""
ROUND_POLL_S = 0.0002
"""How often a ping or its answer is looked for within a peer's rounds: the wait adds to the
round trip, so to the bound on the offset's error, half of it."""
PEER_PATIENCE_S = 10.0
"""How long rank 0 waits for a ping of a peer it is serving before it moves on to the next
peer (one whose telemetry closed mid-exchange holds the others up no longer than this)."""


class Stopped(Exception):
    """The exchange was stopped (the rank's telemetry closed) before it finished."""


class PeerGone(Exception):
    """A peer stopped answering within `PEER_PATIENCE_S`."""


def _wait(store, key: str, stop: threading.Event, every_s: float,
          patience_s: float | None = None) -> None:  # fmt: skip
    """Look for `key` every `every_s` until it is set; raise Stopped once `stop` is set,
    PeerGone after `patience_s`. Looked for, not waited on: a store's timed-out wait logs a
    warning into the job's output, and an untimed one could not be stopped."""
    deadline = None if patience_s is None else time.monotonic() + patience_s
    while not store.check([key]):
        if stop.wait(every_s):
            raise Stopped
        if deadline is not None and time.monotonic() > deadline:
            raise PeerGone


class ClockKeys:
    """The store keys of one run's clock exchange (a run id keeps reruns on one store apart)."""

    def __init__(self, run_id: str) -> None:
        self.prefix = f"ranktrace/clock/{run_id}"

    @property
    def tickets(self) -> str:
        return f"{self.prefix}/tickets"

    def ticket(self, number: int) -> str:
        return f"{self.prefix}/ticket/{number}"

    def ping(self, peer: int, round_: int) -> str:
        return f"{self.prefix}/{peer}/{round_}/ping"

    def pong(self, peer: int, round_: int) -> str:
        return f"{self.prefix}/{peer}/{round_}/pong"


def serve_peers(store, keys: ClockKeys, peers: int, stop: threading.Event,
                rounds: int = ROUNDS, clock: Callable[[], int] = time.time_ns,
                patience_s: float = PEER_PATIENCE_S) -> None:  # fmt: skip
    """Rank 0: answer every peer's pings with this rank's `clock`, peers in arrival order."""
    for number in range(1, peers + 1):
        _wait(store, keys.ticket(number), stop, TICKET_POLL_S)
        peer = int(store.get(keys.ticket(number)))
        try:
            for round_ in range(rounds):
                _wait(store, keys.ping(peer, round_), stop, ROUND_POLL_S, patience_s)
                store.set(keys.pong(peer, round_), str(clock()))
        except PeerGone:
            continue


def measure_offset(store, keys: ClockKeys, rank: int, stop: threading.Event,
                   rounds: int = ROUNDS,
                   clock: Callable[[], int] = time.time_ns) -> tuple[int, int]:  # fmt: skip
    """A peer: (its `clock` minus rank 0's, the round trip it was measured in), ns."""
    number = store.add(keys.tickets, 1)
    store.set(keys.ticket(number), str(rank))
    best: tuple[int, int] | None = None
    for round_ in range(rounds):
        t0 = clock()
        store.set(keys.ping(rank, round_), "")
        _wait(store, keys.pong(rank, round_), stop, ROUND_POLL_S)
        reference = int(store.get(keys.pong(rank, round_)))
        t1 = clock()
        if best is None or t1 - t0 < best[1]:
            best = ((t0 + t1) // 2 - reference, t1 - t0)
    assert best is not None
    return best


class ClockExchange:
    """This rank's side of the exchange, in a daemon thread (`start`); `finish()` ends it when
    the rank's telemetry closes."""

    def __init__(self, target: Callable[[threading.Event], None]) -> None:
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(target,), name="ranktrace-clock",
                                       daemon=True)  # fmt: skip
        self.thread.start()

    def _run(self, target: Callable[[threading.Event], None]) -> None:
        try:
            target(self.stopped)
        except Exception:  # stopped, the store went away, the offset could not be written
            return

    def finish(self, grace_s: float = 1.0) -> None:
        """Give a running exchange `grace_s` to finish (a short job's last peers), then stop
        it: it ends at its next look at the store."""
        self.thread.join(timeout=grace_s)
        self.stopped.set()


def start(store, run_id: str, rank: int, world_size: int,
          on_offset: Callable[[int, int], None]) -> ClockExchange | None:  # fmt: skip
    """Start this rank's side of the exchange; a peer calls `on_offset(offset_ns,
    round_trip_ns)` when measured. None (the offset stays unknown) for a job of one rank, or
    without a store that can be cloned.

    `store` is cloned first: a store client serves one operation at a time, so the exchange
    keeps off the job's own client (process group creation, NCCL's communicator set-up)."""
    if world_size < 2 or store is None:
        return None
    try:
        store = store.clone()
    except (RuntimeError, NotImplementedError, AttributeError):  # a store that cannot: unknown
        return None
    keys = ClockKeys(run_id)
    if rank == 0:
        return ClockExchange(lambda stop: serve_peers(store, keys, world_size - 1, stop))
    return ClockExchange(lambda stop: on_offset(*measure_offset(store, keys, rank, stop)))
