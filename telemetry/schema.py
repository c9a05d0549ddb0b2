"""Arrow schemas of the Parquet segments (`steps`, `spans`, `events`): the columns that
analysis/ ingests into DuckDB. docs/schema.md documents them.

`attempt` numbers the launches of a run: 0 for the first, +1 for each restart or resume. Steps
redone after a resume appear once per attempt in the segments; analysis keeps the latest."""

from __future__ import annotations

import pyarrow as pa

from ranktrace.telemetry import names

SPAN_COLUMNS = {
    "run_id": pa.string(), "rank": pa.int32(), "step": pa.int64(), "span_id": pa.uint64(),
    "parent_span_id": pa.uint64(), "name": pa.string(), "phase": pa.string(),
    "micro_batch": pa.int32(), "op": pa.string(), "axis": pa.string(), "group_id": pa.int32(),
    "group_size": pa.int32(), "seq": pa.int64(), "peer": pa.int32(), "bytes": pa.int64(),
    "dtype": pa.string(), "start_ns": pa.int64(), "end_ns": pa.int64(), "attempt": pa.int32(),
    "wait_ns": pa.int64(), "core_wait_start_ns": pa.int64(), "core_wait_end_ns": pa.int64(),
    "tokens": pa.int64(),
}  # fmt: skip

SPAN_SCHEMA = pa.schema(list(SPAN_COLUMNS.items()))

STEP_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("rank", pa.int32()), ("pp", pa.int32()), ("dp", pa.int32()),
    ("tp", pa.int32()), ("host", pa.string()), ("step", pa.int64()), ("start_ns", pa.int64()),
    ("end_ns", pa.int64()), ("step_time_s", pa.float64()),
    *[(f"{phase}_s", pa.float64()) for phase in names.PHASES],
    *[(f"{phase}_cpu_s", pa.float64()) for phase in names.PHASES],
    *[(f"{phase}_process_cpu_s", pa.float64()) for phase in names.PHASES],
    *[(f"{phase}_core_wait_s", pa.float64()) for phase in names.PHASES],
    ("comm_s", pa.float64()), ("n_collectives", pa.int32()), ("traced", pa.bool_()),
    ("tokens", pa.int64()), ("loss", pa.float64()), ("grad_norm", pa.float64()),
    ("lr", pa.float64()), ("flops", pa.float64()), ("mfu", pa.float64()),
    ("mem_rss_peak_bytes", pa.int64()), ("mem_uss_bytes", pa.int64()),
    ("mem_params_bytes", pa.int64()), ("mem_grads_bytes", pa.int64()),
    ("mem_optimizer_bytes", pa.int64()), ("gpu_max_allocated_bytes", pa.int64()),
    ("gpu_max_reserved_bytes", pa.int64()), ("attempt", pa.int32()), ("ranktrace_s", pa.float64()),
    ("core_wait_s", pa.float64()), ("comm_outside_phases_s", pa.float64()),
])  # fmt: skip

EVENT_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("rank", pa.int32()), ("step", pa.int64()), ("time_ns", pa.int64()),
    ("kind", pa.string()), ("detail", pa.string()), ("attempt", pa.int32()),
])  # fmt: skip

# One row per rank and attempt, written when its telemetry starts (`rank-000000.parquet`) and
# rewritten when a `ranktrace run` rank's clock offset is measured.
RANK_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("rank", pa.int32()), ("pp", pa.int32()), ("dp", pa.int32()),
    ("tp", pa.int32()), ("host", pa.string()), ("pid", pa.int64()), ("device", pa.string()),
    ("cpu_affinity", pa.string()), ("host_cpus", pa.int32()),
    ("world_size", pa.int32()), ("level", pa.string()), ("trace_every", pa.int32()),
    ("flops_per_token", pa.float64()), ("peak_flops", pa.float64()),
    ("peak_flops_source", pa.string()), ("job_peak_flops", pa.float64()),
    ("clock_offset_ns", pa.int64()), ("clock_offset_rtt_ns", pa.int64()),
    ("epoch_anchor_ns", pa.int64()),
    ("params_bytes", pa.int64()), ("grads_bytes", pa.int64()), ("optimizer_bytes", pa.int64()),
    ("attempt", pa.int32()),
])  # fmt: skip

SCHEMAS = {"spans": SPAN_SCHEMA, "steps": STEP_SCHEMA, "events": EVENT_SCHEMA, "rank": RANK_SCHEMA}
