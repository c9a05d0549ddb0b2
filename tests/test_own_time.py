"""ranktrace's own time in a step (`steps.ranktrace_s`) counts its own work and nothing else: the
marks' reads of the wait for a core inside the step, not those between steps; a phase's
CPU-clock reads, where the kernel may end the thread's time slice, sit inside the phase, not in
the own time. Cheaper paths record the same data: spans written as rows without OpenTelemetry,
core-wait readings kept as read (telemetry/recorder.py, cpu_clock.py, exporter.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider

from ranktrace.telemetry import cpu_clock, names
from ranktrace.telemetry import recorder as recorder_module
from ranktrace.telemetry.cpu_clock import MARK_CEILING_NS, MIN_READ_SPACING_NS, CoreWaitSeries
from ranktrace.telemetry.exporter import (
    RankIdentity,
    SegmentSpanProcessor,
    StepContext,
    TelemetrySink,
)
from ranktrace.telemetry.recorder import StepRecord, StepTelemetry
from ranktrace.telemetry.timers import WallTimer

SECOND_NS = 1_000_000_000


def _recorder(sink=lambda record: None) -> StepTelemetry:
    recorder = StepTelemetry(0, {"tp": 0}, 1, sink, WallTimer())
    if recorder.core_wait is None:
        pytest.skip("no /proc schedstat here")
    return recorder


def test_marks_inside_a_step_count_in_its_own_time_and_marks_between_steps_do_not():
    recorder = _recorder()
    recorder.begin_step(0)
    recorder.timer.mark()
    recorder.core_wait.own_ns += SECOND_NS  # as if the step's marks had read for a second
    inside = recorder.end_step()
    recorder.core_wait.own_ns += SECOND_NS  # marks between the steps (set-up calls)
    recorder.begin_step(1)
    after = recorder.end_step()
    assert inside.own_ns >= SECOND_NS
    assert after.own_ns < SECOND_NS


def test_a_mark_switched_out_for_long_counts_the_ceiling_and_keeps_its_reading(monkeypatch):
    recorder = _recorder()
    pread = cpu_clock.os.pread

    def switched_out(fd: int, size: int, offset: int) -> bytes:
        data = pread(fd, size, offset)
        time.sleep(0.02)  # as if the scheduler ran another thread on the core here
        return data

    recorder.begin_step(0)
    time.sleep(2 * MIN_READ_SPACING_NS / 1e9)  # the mark is read, not spared by the spacing
    monkeypatch.setattr(cpu_clock.os, "pread", switched_out)
    before = recorder.core_wait.own_ns
    mark = recorder.timer.mark()
    monkeypatch.undo()
    assert recorder.core_wait.own_ns - before == MARK_CEILING_NS
    assert recorder.core_wait.samples[-1][0] == mark


def test_a_phases_cpu_clock_reads_are_inside_the_phase_not_in_the_own_time(monkeypatch):
    """A read of a CPU clock is where the kernel ends an expired time slice: a slow one
    (here: 50 ms) lengthens the phase it bounds, never ranktrace's own time."""
    recorder = _recorder()
    thread_cpu_ns = recorder_module.thread_cpu_ns

    def preempted_read() -> int:
        time.sleep(0.05)
        return thread_cpu_ns()

    recorder.begin_step(0)
    monkeypatch.setattr(recorder_module, "thread_cpu_ns", preempted_read)
    with recorder.phase(names.FORWARD, 0, tokens=16):
        pass
    monkeypatch.undo()
    record = recorder.end_step()
    ((phase, micro_batch, start, end, *_, tokens),) = record.phases
    assert (phase, micro_batch, tokens) == (names.FORWARD, 0, 16)
    assert end - start >= 2 * 50_000_000  # both reads, at entry and at exit
    assert record.own_ns < 50_000_000


def test_core_wait_readings_kept_as_read_resolve_as_parsed_ones_and_garbled_ones_are_dropped():
    series = CoreWaitSeries()
    series.samples = [(100, b"7 1000 3\n"), (300, 3000), (200, b"7 2000 3\n"), (250, b"?")]
    assert series.at([100, 150, 250, 300, 400]) == [1000, 1500, 2500, 3000, 3000]
    assert series.samples == []


def _segment_spans(otel_spans: bool, directory: Path) -> list[dict]:
    processor, provider = SegmentSpanProcessor(), TracerProvider()
    provider.add_span_processor(processor)
    sink = TelemetrySink(RankIdentity("run", 3, 0, 1, 1, "h", attempt=2),
                         StepContext(1.0, 1e12, 0, 0, 0, epoch_anchor_ns=10_000), provider,
                         processor, directory, otel_spans=otel_spans)  # fmt: skip
    record = StepRecord(step=5, start_ns=1_000, end_ns=9_000, traced=True, own_ns=7)
    record.phases = [(names.FORWARD, 0, 1_100, 4_000, 10, 20, 5, 64),
                     (names.BACKWARD, 0, 4_000, 8_000, 10, 20, None, None)]  # fmt: skip
    record.collectives = [("all_reduce", "tp", 2, 2, 0, -1, 4096, torch.bfloat16, 1_500, 2_000,
                           None, 10, 30)]  # fmt: skip
    sink(record)
    sink.flush()
    (path,) = directory.glob("rank=00003/spans-*.parquet")
    return pq.read_table(path).to_pylist()


def test_segments_hold_the_same_spans_with_or_without_opentelemetry_spans(tmp_path):
    made = {otel: _segment_spans(otel, tmp_path / str(otel)) for otel in (False, True)}
    for rows in made.values():
        (step,) = [r for r in rows if r["name"] == names.STEP_SPAN]
        assert step["parent_span_id"] is None
        assert {r["parent_span_id"] for r in rows if r is not step} == {step["span_id"]}
        assert len({r["span_id"] for r in rows}) == len(rows) == 4

    def without_ids(rows: list[dict]) -> list[dict]:
        rows = [{k: v for k, v in r.items() if not k.endswith("span_id")} for r in rows]
        return sorted(rows, key=lambda r: (r["start_ns"], r["name"]))

    assert without_ids(made[False]) == without_ids(made[True])
    (forward,) = [r for r in made[False] if r["phase"] == names.FORWARD]
    assert (forward["start_ns"], forward["micro_batch"], forward["tokens"]) == (11_100, 0, 64)
    assert (forward["run_id"], forward["rank"], forward["attempt"]) == ("run", 3, 2)
