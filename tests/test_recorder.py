"""The recorder's call entries (telemetry/recorder.py), shared by `ranktrace run`'s hooks and the
Instrumentor: async work's waits add up, a call ends once, and work never waited for within its
step ends with the step while a blocking call that never returned keeps its start."""

from __future__ import annotations

from ranktrace.telemetry.recorder import StepRecord, StepTelemetry
from ranktrace.telemetry.timers import WallTimer


def test_calls_end_once_and_async_work_left_open_ends_with_its_step():
    records = []
    recorder = StepTelemetry(0, {}, 1, records.append, WallTimer())
    recorder.begin_step(0, start_ns=1_000)
    waited = recorder.issue("all_reduce", "dp", 0, 2, 8, None, 1_100, is_async=True)
    open_work = recorder.issue("all_gather", "dp", 0, 2, 8, None, 1_200, is_async=True)
    stuck = recorder.issue("barrier", "world", 0, 2, 0, None, 1_300)
    recorder.add_wait(waited, 1_400, 1_500)
    recorder.add_wait(waited, 1_600, 1_650)  # a second wait() on the same work
    recorder.complete(waited, 9_999)  # ended already: kept
    (record,) = [recorder.end_step(end_ns=2_000)]
    ends = {c[0]: (c[8], c[9], c[10]) for c in record.collectives}
    assert ends["all_reduce"] == (1_100, 1_500, 150)
    assert ends["all_gather"] == (1_200, 2_000, 0)  # never waited for: ran on to the step's end
    assert ends["barrier"] == (1_300, 1_300, None)  # never returned: no duration made up
    assert open_work[9] is None and stuck[9] is None and records == [record]


def test_communication_between_phases_is_counted_apart_from_the_phases():
    """A framework's own collective between two phases (Lightning's once-a-step broadcast) is
    communication outside every phase, not host time; a call inside a phase, or the part of one
    inside it, is not; async work counts the time waited for it."""
    record = StepRecord(3, 0, 1_000, traced=True)
    for phase, start, end in (("data", 0, 100), ("forward", 300, 500), ("backward", 450, 700)):
        record.phases.append((phase, -1, start, end, 0, 0, 0, None))
    calls = [  # (start, end, wait): between phases, in one, across an edge, async waited outside
        (150, 250, None), (320, 380, None), (650, 760, None), (700, 900, 30)]  # fmt: skip
    for start, end, wait in calls:
        record.collectives.append(("all_reduce", "dp", 0, 2, 0, -1, 8, "f32", start, end, wait,
                                   None, None))  # fmt: skip
    assert record.comm_ns == 100 + 60 + 110 + 30
    assert record.comm_outside_phases_ns == 100 + 0 + 60 + 30
    assert StepRecord(4, 0, 10, traced=False).comm_outside_phases_ns == 0
