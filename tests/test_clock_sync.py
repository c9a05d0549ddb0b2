"""The clock exchange of `ranktrace run` ranks (telemetry/clock_sync.py) over a real TCPStore,
rank 0 and its peers as threads with clocks of their own: a skew of rank 0's clock is measured
within half the round trip, peers are served in the order they come, one that never comes
holds nobody up, and one that leaves mid-exchange only for rank 0's patience."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ranktrace.telemetry.clock_sync import ClockKeys, measure_offset, serve_peers, start

SKEW_NS = 5_000_000_000  # rank 0's clock runs 5 s ahead of its peers'


def tcp_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))  # fmt: skip


def rank0_clock() -> int:
    return time.time_ns() + SKEW_NS


def test_a_peer_measures_rank0s_skew_within_half_its_round_trip():
    store, keys = tcp_store(), ClockKeys("run-a")
    stop = threading.Event()
    server = threading.Thread(target=serve_peers, args=(store.clone(), keys, 1, stop),
                              kwargs={"clock": rank0_clock})  # fmt: skip
    server.start()
    offset, round_trip = measure_offset(store, keys, 1, stop)
    server.join()
    assert round_trip > 0
    assert abs(offset - -SKEW_NS) <= round_trip // 2 + 1


def test_peers_are_served_as_they_come_and_one_that_never_comes_holds_none_up():
    """Rank 0 expects 3 peers; rank 3 comes first, then rank 1; rank 2 never comes."""
    store, keys = tcp_store(), ClockKeys("run-b")
    measured: dict[int, tuple[int, int]] = {}
    server = start(store, "run-b", 0, 4, lambda *_: None)
    assert server is not None and server.thread.daemon  # never keeps the job's process alive
    for rank in (3, 1):
        peer = start(store, "run-b", rank, 4,
                     lambda o, r, rank=rank: measured.update({rank: (o, r)}))  # fmt: skip
        peer.thread.join(timeout=30)
    server.finish(grace_s=0.1)  # as the rank's telemetry closes: the wait for rank 2 ends
    server.thread.join(timeout=30)
    assert not server.thread.is_alive()
    assert sorted(measured) == [1, 3]
    for offset, round_trip in measured.values():  # one host, one clock
        assert abs(offset) <= round_trip // 2 + 1
    assert int(store.get(keys.ticket(1))) == 3
    assert start(store, "run-c", 0, 1, lambda *_: None) is None  # one rank: nothing to measure
    assert start(None, "run-c", 1, 4, lambda *_: None) is None  # no store: the offset unknown


def test_a_peer_that_stops_mid_exchange_holds_the_next_one_up_only_for_rank0s_patience():
    store, keys = tcp_store(), ClockKeys("run-d")
    stop = threading.Event()
    server = threading.Thread(target=serve_peers, args=(store.clone(), keys, 2, stop),
                              kwargs={"patience_s": 0.2})  # fmt: skip
    server.start()
    store.set(keys.ticket(store.add(keys.tickets, 1)), "2")  # rank 2 took a ticket, then left
    offset, round_trip = measure_offset(store, keys, 1, stop)
    server.join(timeout=30)
    assert not server.is_alive() and abs(offset) <= round_trip // 2 + 1
