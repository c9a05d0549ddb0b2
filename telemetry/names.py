"""Every name telemetry writes: span names, attribute keys, phases, segment kinds and columns.

One source of truth: the recorder, the exporter and analysis/ (through SQL) all use these.
Units follow UCUM where the name does not say them: times in ns (`_ns`) or s (`_s`), sizes in
bytes (`By`).
"""

from __future__ import annotations

INSTRUMENTATION_SCOPE = "ranktrace"

# Span names.
STEP_SPAN = "ranktrace.step"
PHASE_SPAN = "ranktrace.phase"
COLLECTIVE_SPAN = "ranktrace.collective"

# Phases of a step (child spans of the step span).
DATA = "data"
FORWARD = "forward"
BACKWARD = "backward"
PIPELINE_WAIT = "pipeline_wait"
GRAD_SYNC = "grad_sync"
OPTIMIZER = "optimizer"
CHECKPOINT = "checkpoint"
PHASES = (DATA, FORWARD, BACKWARD, PIPELINE_WAIT, GRAD_SYNC, OPTIMIZER, CHECKPOINT)

# Parallel axes of a collective.
AXES = ("tp", "pp", "dp", "world")

# Telemetry levels of `ranktrace train --telemetry`.
LEVEL_OFF = "off"
LEVEL_STEPS = "steps"
LEVEL_COLLECTIVES = "collectives"
LEVELS = (LEVEL_OFF, LEVEL_STEPS, LEVEL_COLLECTIVES)

# Resource / span attribute keys carried by every record.
ATTR_RUN_ID = "ranktrace.run_id"
ATTR_RANK = "ranktrace.rank"
ATTR_STEP = "ranktrace.step"
ATTR_PP = "ranktrace.pp"
ATTR_DP = "ranktrace.dp"
ATTR_TP = "ranktrace.tp"
ATTR_HOST = "host.name"  # OpenTelemetry semantic convention
ATTR_PHASE = "ranktrace.phase"
ATTR_MICRO_BATCH = "ranktrace.micro_batch"
ATTR_TOKENS = "ranktrace.tokens"  # a forward phase's micro-batch: its tokens
ATTR_OP = "ranktrace.collective.op"
ATTR_AXIS = "ranktrace.collective.axis"
ATTR_GROUP_ID = "ranktrace.collective.group_id"
ATTR_GROUP_SIZE = "ranktrace.collective.group_size"
ATTR_SEQ = "ranktrace.collective.seq"
ATTR_PEER = "ranktrace.collective.peer"
ATTR_BYTES = "ranktrace.collective.bytes"
ATTR_DTYPE = "ranktrace.collective.dtype"

# Event kinds (table `events`).
EVENT_FAULT_INJECTED = "fault_injected"  # detail: the --inject spec; step: where it starts
EVENT_CRASH = "crash"
EVENT_HANG_INJECTED = "hang"  # the injected hang starts (detail: which rank stops)
# Fault tolerance; their detail is a JSON object (docs/schema.md lists the keys).
EVENT_RESTART = "restart"  # rank 0, at the start of an attempt > 0: attempt, resumed_from_step
EVENT_CHECKPOINT_SAVED = "checkpoint_saved"  # every rank: next_step, blocking_s, async_s, bytes
EVENT_CHECKPOINT_COMPLETE = "checkpoint_complete"  # rank 0: the marker was written
EVENT_CHECKPOINT_FAILED = "checkpoint_failed"  # a rank's save raised: error
EVENT_COLLECTIVE_TIMEOUT = "collective_timeout"  # alert: op, axis, group, seq, waited_s
EVENT_IN_FLIGHT = "in_flight"  # every rank before a timeout exit: its operation (op may be null)
# `ranktrace run`: a hook that could not be installed safely, so what it records is missing
# (detail: what, and why); the report's notes name it.
EVENT_CAPTURE_LIMITED = "capture_limited"

# Metric names (UCUM units).
METRIC_STEP_TIME = "ranktrace.step.duration"  # s
METRIC_TOKENS = "ranktrace.step.tokens"  # {token}

# Run kinds (run.json `kind`, column `runs.kind`): a training job (trained or imported), or a
# `ranktrace probe` of the network between its ranks.
RUN_KIND_TRAIN = "train"
RUN_KIND_PROBE = "probe"

# Segment files: runs/<run>/telemetry/rank=RRRRR/<kind>-SSSSSS.parquet
TELEMETRY_DIR = "telemetry"
SEGMENT_KINDS = ("steps", "spans", "events", "rank")
STORE_FILE = "ranktrace.duckdb"


def rank_dir_name(rank: int) -> str:
    return f"rank={rank:05d}"


def segment_name(kind: str, index: int, steps: tuple[int, int] | None = None) -> str:
    """`<kind>-<index>.parquet`; `<kind>-<first>.<last>-<index>.parquet` for a segment holding
    steps first..last (ingest then knows its steps without opening it)."""
    if steps is None:
        return f"{kind}-{index:06d}.parquet"
    return f"{kind}-{steps[0]}.{steps[1]}-{index:06d}.parquet"


def parse_segment_name(name: str) -> tuple[str, int, tuple[int, int] | None] | None:
    """(kind, index, (first, last) step or None) of a segment_name; None for another name."""
    parts = name.removesuffix(".parquet").split("-")
    if not name.endswith(".parquet") or len(parts) not in (2, 3) or not parts[-1].isdigit():
        return None
    if len(parts) == 2:
        return parts[0], int(parts[1]), None
    first, _, last = parts[1].partition(".")
    if not (first.isdigit() and last.isdigit()):
        return None
    return parts[0], int(parts[2]), (int(first), int(last))


INCOMPLETE_STEP_SEEN = "; seen: "
"""In an `incomplete_step` event's detail, before what the rank did in the step it never
finished (telemetry/job.py; analysis/verdict.py reads it)."""
