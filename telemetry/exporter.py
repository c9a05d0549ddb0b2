"""From finished steps to OpenTelemetry spans and immutable per-rank Parquet segments.

At step end `TelemetrySink` turns a `StepRecord` into spans with explicit start and end times
(the step, its phases and, on traced steps, one span per collective) and one row of the `steps`
table. Spans are rows of the `spans` segments; where other exporters listen (an OTLP endpoint,
the caller's tracer provider) they are also OpenTelemetry spans, and a `SegmentSpanProcessor`
keeps the step and phase ones in memory for the segment. Every N steps or T seconds the sink
writes the rows as zstd Parquet segments under `runs/<run>/telemetry/rank=RRRRR/`, each to a
temporary name and then renamed, so a reader (or a crash) never sees half a file.
"""

from __future__ import annotations

import os
import queue
import resource
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from random import getrandbits

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import set_span_in_context

from ranktrace.telemetry import names
from ranktrace.telemetry.recorder import StepRecord
from ranktrace.telemetry.schema import EVENT_SCHEMA, SPAN_COLUMNS, STEP_SCHEMA


@dataclass(frozen=True)
class RankIdentity:
    """Carried by every record of a rank."""

    run_id: str
    rank: int
    pp: int
    dp: int
    tp: int
    host: str
    attempt: int = 0
    """Launches of this run before this one (restarts and resumes)."""


# Rows as the sink buffers them, in these column orders (spans schema names; the others null).
COLLECTIVE_ROW = ("step", "span_id", "parent_span_id", "op", "axis", "group_id", "group_size",
                  "seq", "peer", "bytes", "dtype", "start_ns", "end_ns", "wait_ns",
                  "core_wait_start_ns", "core_wait_end_ns")  # fmt: skip
STEP_PHASE_ROW = ("step", "span_id", "parent_span_id", "name", "phase", "micro_batch",
                  "start_ns", "end_ns", "tokens")  # fmt: skip


def next_segment_index(rank_dir: Path) -> int:
    """The first segment number not yet used in `rank_dir` (0 for a new rank; after a resume,
    the next one, so that the new attempt's segments never replace the earlier ones)."""
    parsed = [names.parse_segment_name(p.name) for p in rank_dir.glob("*-*.parquet")]
    used = [index for kind, index, _ in filter(None, parsed) if kind != "rank"]
    return max(used) + 1 if used else 0


class SegmentWriter:
    """Writes a rank's segments on a thread of its own, one after the other, so that the
    training step does not wait for Parquet encoding and the disk (it was ~65% of ranktrace's
    own time per step with 50 calls a step). `drain()` waits until everything handed over so
    far is written; a writing error is printed once and the rank trains on."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._failed = False

    def submit(self, job) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="ranktrace-segments",
                                            daemon=True)  # fmt: skip
            self._thread.start()
        self._jobs.put(job)

    def drain(self) -> None:
        if self._thread is not None:
            self._jobs.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception as error:  # telemetry never stops the training
                if not self._failed:
                    print(f"ranktrace: a telemetry segment was not written: "
                          f"{type(error).__name__}: {error}", file=sys.stderr,
                          flush=True)  # fmt: skip
                self._failed = True
            finally:
                self._jobs.task_done()


class SegmentSpanProcessor(SpanProcessor):
    """Keeps finished step and phase spans in memory until the sink drains them into a segment.
    (Collective spans, made only for other exporters, are written by the sink as rows.)"""

    def __init__(self) -> None:
        self.finished: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        if span.name != names.COLLECTIVE_SPAN:
            self.finished.append(span)

    def drain(self) -> list[ReadableSpan]:
        spans, self.finished = self.finished, []
        return spans


def write_segment(directory: Path, kind: str, index: int, table: pa.Table) -> Path:
    """Write `table` as a segment atomically (temporary name, then rename), named with the
    steps it holds when it has a `step` column (names.segment_name)."""
    directory.mkdir(parents=True, exist_ok=True)
    steps = None
    if "step" in table.column_names:  # a flush's rows: hundreds at most
        held = [step for step in table.column("step").to_pylist() if step is not None]
        steps = (min(held), max(held)) if held else None
    final = directory / names.segment_name(kind, index, steps)
    tmp = directory / f".{final.name}.tmp"
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, final)
    return final


_SPAN_ATTRS = {
    "phase": names.ATTR_PHASE, "micro_batch": names.ATTR_MICRO_BATCH, "op": names.ATTR_OP,
    "axis": names.ATTR_AXIS, "group_id": names.ATTR_GROUP_ID, "group_size": names.ATTR_GROUP_SIZE,
    "seq": names.ATTR_SEQ, "peer": names.ATTR_PEER, "bytes": names.ATTR_BYTES,
    "dtype": names.ATTR_DTYPE, "tokens": names.ATTR_TOKENS,
}  # fmt: skip


def spans_to_table(spans: list[ReadableSpan], identity: RankIdentity) -> pa.Table:
    """One row per span; attributes a span lacks are null."""
    columns: dict[str, list] = {name: [] for name in SPAN_COLUMNS}
    for span in spans:
        attrs = span.attributes
        columns["run_id"].append(identity.run_id)
        columns["rank"].append(identity.rank)
        columns["step"].append(attrs.get(names.ATTR_STEP))
        columns["span_id"].append(span.context.span_id)
        columns["parent_span_id"].append(span.parent.span_id if span.parent else None)
        columns["name"].append(span.name)
        columns["start_ns"].append(span.start_time)
        columns["end_ns"].append(span.end_time)
        columns["attempt"].append(identity.attempt)
        for column in ("wait_ns", "core_wait_start_ns", "core_wait_end_ns"):
            columns[column].append(None)  # step and phase spans: collectives' columns
        for column, key in _SPAN_ATTRS.items():
            columns[column].append(attrs.get(key))
    return pa.table({k: pa.array(v, type=SPAN_COLUMNS[k]) for k, v in columns.items()})


def _peak_rss_bytes() -> int:
    """The process's peak resident memory. RUSAGE_THREAD's maxrss is the process's (the memory
    is shared) and, unlike RUSAGE_SELF, it sums no CPU clocks: that sum is where the kernel ends
    an expired time slice, which made this read of the step hand-over wait for a core (7% of
    RUSAGE_SELF reads took > 100 µs with a busy process on the core, 0.2% of RUSAGE_THREAD)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_maxrss * 1024


@dataclass
class StepContext:
    """Per-rank constants the sink needs to derive a step row."""

    flops_per_token: float
    job_peak_flops: float
    """Sum of every rank's peak FLOP/s (the MFU denominator)."""
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    epoch_anchor_ns: int
    """Added to monotonic ns to get Unix-epoch ns."""


class TelemetrySink:
    """Receives each finished `StepRecord`; makes spans and step rows; writes segments."""

    def __init__(
        self,
        identity: RankIdentity,
        context: StepContext,
        tracer_provider: TracerProvider,
        processor: SegmentSpanProcessor,
        directory: Path,
        flush_every_steps: int = 10,
        flush_seconds: float = 5.0,
        cuda_memory: bool = False,
        otel_spans: bool = False,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        """`otel_spans`: also make every span an OpenTelemetry span, for other exporters (an
        OTLP endpoint, the caller's tracer provider). Segments get rows either way: ~2 µs a
        span instead of ~35 (a tp2 dp2 rank's step, its 8 phases and 43 collective rows: 0.39
        -> 0.04 ms)."""
        self.identity, self.context = identity, context
        self.tracer = tracer_provider.get_tracer(names.INSTRUMENTATION_SCOPE)
        self.processor = processor
        self.directory = directory
        self.flush_every_steps, self.flush_seconds = flush_every_steps, flush_seconds
        self.cuda_memory, self.otel_spans = cuda_memory, otel_spans
        self._step_duration = self._tokens = None
        if meter_provider is not None:  # one histogram record and one counter add per step
            meter = meter_provider.get_meter(names.INSTRUMENTATION_SCOPE)
            self._step_duration = meter.create_histogram(
                names.METRIC_STEP_TIME, unit="s", description="training step time per rank"
            )
            self._tokens = meter.create_counter(
                names.METRIC_TOKENS, unit="{token}", description="tokens trained"
            )
        self._rows: list[dict] = []
        self._events: list[dict] = []
        self._collective_rows: list[tuple] = []
        self._step_phase_rows: list[tuple] = []  # without otel_spans
        self._segment = next_segment_index(directory / names.rank_dir_name(identity.rank))
        self._flush_lock = threading.Lock()  # the training loop and a watchdog thread flush
        self._writer = SegmentWriter()
        self._last_flush = time.monotonic()
        self._base_attrs = {
            names.ATTR_RUN_ID: identity.run_id, names.ATTR_RANK: identity.rank,
            names.ATTR_PP: identity.pp, names.ATTR_DP: identity.dp, names.ATTR_TP: identity.tp,
        }  # fmt: skip

    def __call__(self, record: StepRecord) -> None:
        self._emit_spans(record)
        row = self._step_row(record)
        self._rows.append(row)
        if self._step_duration is not None:
            self._step_duration.record(row["step_time_s"], self._base_attrs)
            self._tokens.add(row["tokens"], self._base_attrs)
        due_by_steps = len(self._rows) >= self.flush_every_steps
        if due_by_steps or time.monotonic() - self._last_flush >= self.flush_seconds:
            with self._flush_lock:  # handed to the writer thread: the step goes on
                self._flush()

    def _emit_spans(self, record: StepRecord) -> None:
        anchor, step = self.context.epoch_anchor_ns, record.step
        if self.otel_spans:
            step_span, parent = self._otel_step_and_phases(record)
            step_id = step_span.get_span_context().span_id
        else:
            step_id, rows = getrandbits(64), self._step_phase_rows
            rows.append((step, step_id, None, names.STEP_SPAN, None, None,
                         record.start_ns + anchor, record.end_ns + anchor, None))  # fmt: skip
            for phase, micro_batch, start, end, *_, tokens in record.phases:
                rows.append((step, getrandbits(64), step_id, names.PHASE_SPAN, phase, micro_batch,
                             start + anchor, end + anchor, tokens))  # fmt: skip
        if record.traced:
            for (
                op,
                axis,
                group_id,
                size,
                seq,
                peer,
                nbytes,
                dtype,
                start,
                end,
                wait,
                core_wait_start,
                core_wait_end,
            ) in record.collectives:
                dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else None
                self._collective_rows.append(
                    (step, getrandbits(64), step_id, op, axis, group_id, size, seq, peer,
                     nbytes, dtype_name, start + anchor, end + anchor, wait, core_wait_start,
                     core_wait_end)
                )  # fmt: skip
                if self.otel_spans:
                    self._collective_span(parent, step, self._collective_rows[-1])
        if self.otel_spans:
            step_span.end(end_time=record.end_ns + anchor)

    def _otel_step_and_phases(self, record: StepRecord):
        """The step's OpenTelemetry span (open: it ends after its collectives' spans) and the
        context of its children; its phases' spans, ended."""
        anchor = self.context.epoch_anchor_ns
        step_attrs = {**self._base_attrs, names.ATTR_STEP: record.step}
        step_span = self.tracer.start_span(
            names.STEP_SPAN, start_time=record.start_ns + anchor, attributes=step_attrs
        )
        parent = set_span_in_context(step_span)
        for phase, micro_batch, start, end, *_, tokens in record.phases:
            attrs = {names.ATTR_STEP: record.step, names.ATTR_PHASE: phase,
                     names.ATTR_MICRO_BATCH: micro_batch}  # fmt: skip
            if tokens is not None:
                attrs[names.ATTR_TOKENS] = tokens
            span = self.tracer.start_span(
                names.PHASE_SPAN, context=parent, start_time=start + anchor, attributes=attrs
            )
            span.end(end_time=end + anchor)
        return step_span, parent

    def _collective_span(self, parent, step: int, row: tuple) -> None:
        """The OpenTelemetry span of one collective, for exporters other than our segments."""
        _, _, _, op, axis, group_id, size, seq, peer, nbytes, dtype, start, end, *_ = row
        attrs = {
            names.ATTR_STEP: step, names.ATTR_OP: op, names.ATTR_AXIS: axis,
            names.ATTR_GROUP_ID: group_id, names.ATTR_GROUP_SIZE: size, names.ATTR_SEQ: seq,
            names.ATTR_PEER: peer, names.ATTR_BYTES: nbytes, names.ATTR_DTYPE: dtype,
        }  # fmt: skip
        span = self.tracer.start_span(
            names.COLLECTIVE_SPAN, context=parent, start_time=start, attributes=attrs
        )
        span.end(end_time=end)

    def _rows_table(self, layout: tuple[str, ...], rows: list[tuple], **constant) -> pa.Table:
        """Rows laid out as `layout` in the spans schema, built column by column; the columns
        `layout` lacks hold `constant`'s value, else null."""
        n = len(rows)
        columns = dict.fromkeys(layout, ())
        if rows:
            columns = dict(zip(layout, zip(*rows, strict=True), strict=True))
        constant.update(run_id=self.identity.run_id, rank=self.identity.rank,
                        attempt=self.identity.attempt)  # fmt: skip
        return pa.table({
            name: pa.array(columns[name] if name in columns else [constant.get(name)] * n,
                           type=kind)
            for name, kind in SPAN_COLUMNS.items()
        })  # fmt: skip

    def _step_row(self, record: StepRecord) -> dict:
        ctx, ident = self.context, self.identity
        step_time_s = (record.end_ns - record.start_ns) / 1e9
        phase_s = dict.fromkeys(names.PHASES, 0.0)
        cpu_s = dict.fromkeys(names.PHASES, 0.0)
        process_cpu_s = dict.fromkeys(names.PHASES, 0.0)
        core_wait_s: dict[str, float | None] = dict.fromkeys(names.PHASES, 0.0)
        for phase, _, start, end, thread_cpu, process_cpu, core_wait, _ in record.phases:
            phase_s[phase] += (end - start) / 1e9
            cpu_s[phase] += thread_cpu / 1e9
            process_cpu_s[phase] += process_cpu / 1e9
            if core_wait is None or core_wait_s[phase] is None:
                core_wait_s[phase] = None  # unknown for one of its pieces: unknown
            else:
                core_wait_s[phase] += core_wait / 1e9
        values = record.values
        tokens = values.get("tokens", 0)
        flops = values.get("flops", tokens * ctx.flops_per_token)
        row = {
            "run_id": ident.run_id, "rank": ident.rank, "pp": ident.pp, "dp": ident.dp,
            "tp": ident.tp, "host": ident.host, "step": record.step,
            "start_ns": record.start_ns + ctx.epoch_anchor_ns,
            "end_ns": record.end_ns + ctx.epoch_anchor_ns, "step_time_s": step_time_s,
            **{f"{phase}_s": seconds for phase, seconds in phase_s.items()},
            **{f"{phase}_cpu_s": seconds for phase, seconds in cpu_s.items()},
            **{f"{phase}_process_cpu_s": seconds for phase, seconds in process_cpu_s.items()},
            **{f"{phase}_core_wait_s": seconds for phase, seconds in core_wait_s.items()},
            "comm_s": record.comm_ns / 1e9, "n_collectives": len(record.collectives),
            "comm_outside_phases_s": record.comm_outside_phases_ns / 1e9,
            "traced": record.traced, "tokens": tokens, "loss": values.get("loss"),
            "grad_norm": values.get("grad_norm"), "lr": values.get("lr"), "flops": flops,
            "mfu": flops / (step_time_s * ctx.job_peak_flops) if ctx.job_peak_flops else None,
            "mem_rss_peak_bytes": _peak_rss_bytes(),
            "mem_uss_bytes": None, "mem_params_bytes": ctx.params_bytes,
            "mem_grads_bytes": ctx.grads_bytes, "mem_optimizer_bytes": ctx.optimizer_bytes,
            "gpu_max_allocated_bytes": None, "gpu_max_reserved_bytes": None,
            "ranktrace_s": record.own_ns / 1e9, "attempt": ident.attempt,
            "core_wait_s": None if record.core_wait_ns is None else record.core_wait_ns / 1e9,
        }  # fmt: skip
        if self.cuda_memory:
            import torch

            row["gpu_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
            row["gpu_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        return row

    def event(self, kind: str, step: int, detail: str = "") -> None:
        """Record an event (fault, restart, checkpoint, timeout...); written with the next flush."""
        self._events.append({"run_id": self.identity.run_id, "rank": self.identity.rank,
                             "step": step, "time_ns": time.time_ns(), "kind": kind,
                             "detail": detail,
                             "attempt": self.identity.attempt})  # fmt: skip

    def flush(self) -> None:
        """Write the buffered step rows, spans and events as new segments, and return once every
        segment handed to the writer thread so far is on disk (a process about to die keeps its
        records)."""
        with self._flush_lock:
            self._flush()
        self._writer.drain()

    def _flush(self) -> None:
        """Hand the buffered rows to the writer thread as the next segment (caller holds the
        lock)."""
        if not self._rows and not self._events:
            return
        rank_dir = self.directory / names.rank_dir_name(self.identity.rank)
        rows, events, index = self._rows, self._events, self._segment
        spans, collective_rows = self.processor.drain(), self._collective_rows
        step_phase_rows = self._step_phase_rows
        self._rows, self._events, self._collective_rows = [], [], []
        self._step_phase_rows = []
        self._segment += 1
        self._last_flush = time.monotonic()
        identity = self.identity

        def write() -> None:
            if events:
                table = pa.Table.from_pylist(events, schema=EVENT_SCHEMA)
                write_segment(rank_dir, "events", index, table)
            if rows:
                # USS (private memory, excludes torch's shared library pages) costs a read of
                # smaps: sampled once per segment, on its last row
                rows[-1]["mem_uss_bytes"] = psutil.Process().memory_full_info().uss
                table = pa.concat_tables([
                    spans_to_table(spans, identity),
                    self._rows_table(STEP_PHASE_ROW, step_phase_rows),
                    self._rows_table(COLLECTIVE_ROW, collective_rows, name=names.COLLECTIVE_SPAN),
                ])  # fmt: skip
                write_segment(rank_dir, "spans", index, table)
                table = pa.Table.from_pylist(rows, schema=STEP_SCHEMA)
                write_segment(rank_dir, "steps", index, table)  # last: a step row is complete

        self._writer.submit(write)
