"""The step thread's wait for a core, sampled at the recorder's marks (telemetry/cpu_clock.py):
marks closer than the read spacing share one read, and every step's first mark is read even
right after the previous step's last one."""

from __future__ import annotations

import time

import pytest

from ranktrace.telemetry.cpu_clock import MIN_READ_SPACING_NS, CoreWaitSeries


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
