"""The step thread's wait for a core, sampled at the recorder's marks (telemetry/cpu_clock.py):
marks closer than the read spacing share one read, and every step's first mark is read even
right after the previous step's last one. The wait of the threads that carry a rank's
collectives: found by the names gloo gives them, and found again when a group brings more."""

from __future__ import annotations

import time

import pytest

from ranktrace.telemetry.cpu_clock import MIN_READ_SPACING_NS, CommThreadWaits, CoreWaitSeries
from tests.distributed import run_on_ranks


@pytest.fixture
def series() -> CoreWaitSeries:
    series = CoreWaitSeries()
    if not series.readable:
        pytest.skip("no /proc schedstat here")
    return series


def test_marks_closer_than_the_spacing_share_one_read(series):
    now = time.perf_counter_ns()
    series.sample(now)
    series.sample(now + MIN_READ_SPACING_NS // 2)  # not read: interpolated
    series.sample(now + MIN_READ_SPACING_NS)  # read
    assert [t for t, _ in series.samples] == [now, now + MIN_READ_SPACING_NS]


def test_a_steps_first_mark_is_read_right_after_the_last_steps_end(series):
    now = time.perf_counter_ns()
    series.sample(now)
    series.sample(now + 2 * MIN_READ_SPACING_NS)
    assert series.at([now + MIN_READ_SPACING_NS]) is not None  # the step resolved
    series.sample(now + 2 * MIN_READ_SPACING_NS + 1)  # next step, 1 ns later: still read
    assert len(series.samples) == 1


def _comm_thread_readings(rank: int, world_size: int) -> list[tuple]:
    """(wait ns, threads read, generation) before and after collectives on the world group,
    then after a new group's first collective."""
    import torch
    import torch.distributed as dist

    waits = CommThreadWaits()
    readings = [(waits.read(), len(waits._fds), waits.generation)]
    for _ in range(50):
        dist.all_reduce(torch.ones(4096))
    readings.append((waits.read(), len(waits._fds), waits.generation))
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(4096), group=group)
    readings.append((waits.read(), len(waits._fds), waits.generation))
    return readings


@pytest.mark.multiprocess
def test_the_collectives_threads_are_found_by_name_and_again_when_a_group_adds_some():
    """On 2 gloo ranks: the threads gloo runs a group's collectives on are found (were they
    renamed, the wait would silently go unrecorded), read alike while they stay the same, and
    found again, more of them, once a new group brings its own."""
    for before, after, regrouped in run_on_ranks(_comm_thread_readings, 2):
        assert before[0] is not None and before[1] >= 1, before
        assert after[1:] == before[1:] and after[0] >= before[0], (before, after)
        assert regrouped[1] > after[1] and regrouped[2] > after[2], (after, regrouped)
