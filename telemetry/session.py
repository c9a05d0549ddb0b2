"""One rank's telemetry, assembled: tracer provider, span processor, sink, recorder, and the
rank's metadata segment (coordinates, clock offset to rank 0, MFU denominator).

    telemetry = RankTelemetry.open(identity, run_dir, context, level="collectives")
    for step in range(n):
        telemetry.recorder.begin_step(step)
        ...                                  # phases and collectives are recorded
        telemetry.recorder.end_step(loss=..., tokens=...)
    telemetry.close()                        # flushes the last segment
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from ranktrace.telemetry import names
from ranktrace.telemetry.cpu_clock import cpu_affinity
from ranktrace.telemetry.exporter import (
    RankIdentity,
    SegmentSpanProcessor,
    StepContext,
    TelemetrySink,
    write_segment,
)
from ranktrace.telemetry.recorder import NullTelemetry, StepTelemetry
from ranktrace.telemetry.schema import RANK_SCHEMA
from ranktrace.telemetry.timers import Timer, WallTimer


def otlp_span_processor(endpoint: str) -> BatchSpanProcessor:
    """Send spans to an OpenTelemetry collector over OTLP/HTTP (e.g. http://host:4318)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces"))


class RankTelemetry:
    """Recorder + sink of one rank; `recorder` is what the training loop and comm observe."""

    def __init__(self, recorder, sink: TelemetrySink | None, provider: TracerProvider | None):
        self.recorder, self.sink, self.provider = recorder, sink, provider
        self._metadata: tuple[Path, int, dict] | None = None  # rank dir, attempt, row

    @classmethod
    def disabled(cls) -> RankTelemetry:
        return cls(NullTelemetry(), None, None)

    @classmethod
    def open(
        cls,
        identity: RankIdentity,
        run_dir: Path,
        context: StepContext,
        group_ids: dict[str, int],
        *,
        level: str = names.LEVEL_COLLECTIVES,
        trace_every: int = 1,
        flush_every_steps: int = 10,
        flush_seconds: float = 5.0,
        timer: Timer | None = None,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        otlp_endpoint: str = "",
        rank_metadata: dict | None = None,
        cuda_memory: bool = False,
    ) -> RankTelemetry:
        """Start recording for one rank; `level` off returns a recorder that records nothing.

        `tracer_provider` / `meter_provider`: the caller's OpenTelemetry providers (spans of
        every collective then also reach the tracer's other processors; step time and tokens
        are recorded as metrics). By default a private tracer provider feeds the segments.
        """
        if level == names.LEVEL_OFF:
            return cls.disabled()
        resource = Resource.create({
            "service.name": "ranktrace", names.ATTR_RUN_ID: identity.run_id,
            names.ATTR_RANK: identity.rank, names.ATTR_PP: identity.pp,
            names.ATTR_DP: identity.dp, names.ATTR_TP: identity.tp,
            names.ATTR_HOST: identity.host,
        })  # fmt: skip
        provider = tracer_provider or TracerProvider(resource=resource)
        processor = SegmentSpanProcessor()
        provider.add_span_processor(processor)
        if otlp_endpoint:
            provider.add_span_processor(otlp_span_processor(otlp_endpoint))
        directory = run_dir / names.TELEMETRY_DIR
        other_exporters = bool(otlp_endpoint) or tracer_provider is not None
        sink = TelemetrySink(identity, context, provider, processor, directory,
                             flush_every_steps, flush_seconds, cuda_memory,
                             otel_spans=other_exporters,
                             meter_provider=meter_provider)  # fmt: skip
        every = trace_every if level == names.LEVEL_COLLECTIVES else 0
        recorder = StepTelemetry(identity.rank, group_ids, every, sink, timer or WallTimer())
        meta = {**asdict(identity), **asdict(context), "pid": os.getpid(), "level": level,
                "cpu_affinity": ",".join(map(str, cpu_affinity())), "host_cpus": os.cpu_count(),
                "trace_every": every, **(rank_metadata or {})}  # fmt: skip
        telemetry = cls(recorder, sink, provider)
        telemetry._metadata = (directory / names.rank_dir_name(identity.rank), identity.attempt,
                               meta)  # fmt: skip
        telemetry.update_metadata()
        return telemetry

    def update_metadata(self, **values) -> None:
        """(Re)write this rank's metadata row with `values` changed: one row per attempt
        (`rank-AAAAAA.parquet`, a resumed rank may have moved), replaced atomically."""
        if self._metadata is None:
            return
        rank_dir, attempt, meta = self._metadata
        meta.update(values)
        write_segment(rank_dir, "rank", attempt, pa.Table.from_pylist([meta], schema=RANK_SCHEMA))

    def event(self, kind: str, step: int, detail: str = "") -> None:
        if self.sink is not None:
            self.sink.event(kind, step, detail)

    def flush(self) -> None:
        """Write what is buffered now (a process about to die keeps its records)."""
        if self.sink is not None:
            self.sink.flush()

    def close(self) -> None:
        """Write what is buffered; shut the provider down (flushing an OTLP exporter)."""
        if self.sink is not None:
            self.sink.flush()
        if self.provider is not None:
            self.provider.shutdown()
