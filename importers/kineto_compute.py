"""Compute operations of one rank's profiler trace (importers/kineto.py): phase spans minus the
collectives' CPU time (CPU-only traces), or the GPU's compute and memory activities and its idle
time between steps (GPU traces, importers/kineto_gpu.py). Times in µs on the trace's clock;
`start_s` of the ops returned is from the trace's 0."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ranktrace.importers.intervals import lookup, minus
from ranktrace.importers.kineto_gpu import (
    GpuTimeline,
    activity_times,
    compute_pieces,
    gpu_time,
    idle_before_steps,
)

COMPUTE_OPTYPES = {"forward": "forward-compute", "backward": "backward-compute",
                   "optimizer": "optimizer", "data": "data"}  # fmt: skip
GPU_IDLE = "gpu-idle"
"""optype of the GPU's idle time between two steps (phase "": host time)."""


def cpu_compute(steps: tuple, spans: tuple, comms: pd.DataFrame) -> pd.DataFrame:
    """Compute ops of a CPU-only trace: phase spans minus the collectives' CPU time; a step
    without phase spans is one "compute" span."""
    step_no, step_start, step_end = steps
    span_phase, span_start, span_end = spans
    span_step = lookup(span_start, step_start, step_end, step_no, -1)
    bare = ~np.isin(step_no, span_step)
    inside = span_step >= 0
    return _compute_ops(
        np.concatenate([span_phase[inside], np.full(bare.sum(), "compute", dtype=object)]),
        np.concatenate([span_step[inside], step_no[bare]]),
        np.concatenate([span_start[inside], step_start[bare]]),
        np.concatenate([span_end[inside], step_end[bare]]),
        comms,
    )


def gpu_compute(gpu: GpuTimeline, steps: tuple, spans: tuple) -> tuple[pd.DataFrame, dict]:
    """Compute ops from the GPU timeline (start_s from the trace's 0), with the GPU's idle time
    between steps, and the rank's GPU time split."""
    step_no, step_start, step_end = steps
    span_phase, span_start, span_end = spans
    at = activity_times(gpu)
    step = lookup(at, step_start, step_end, step_no, -1).astype(np.int64)
    phase = lookup(at, span_start, span_end, span_phase, "")
    phase_code, phases = pd.factorize(np.where(phase == "", "compute", phase).astype(object))
    code = np.where(step >= 0, step * len(phases) + phase_code, -1)  # one per (step, phase)
    piece, start, end = compute_pieces(gpu, code)
    piece_step = piece // max(len(phases), 1)
    piece_phase = np.asarray(phases, dtype=object)[piece % max(len(phases), 1)]
    idle = idle_before_steps(gpu, step)
    compute = pd.concat([
        _ops_frame(piece_step, piece_phase, start, end),
        _ops_frame(idle["step"].to_numpy(), np.full(len(idle), "", dtype=object),
                   idle["start"].to_numpy(), idle["end"].to_numpy(), GPU_IDLE),
    ], ignore_index=True)  # fmt: skip
    return compute, gpu_time(gpu, step)


def _compute_ops(phase, step, start, end, comms: pd.DataFrame) -> pd.DataFrame:
    """The phase spans (µs) minus the collectives' time: compute ops, start_s from the trace's 0."""
    index, start, end = minus(
        start, end, comms["ts"].to_numpy(), (comms["ts"] + comms["dur"]).to_numpy()
    )
    return _ops_frame(step[index], phase[index], start, end)


def _ops_frame(step, phase, start, end, optype: str | None = None) -> pd.DataFrame:
    """Compute ops of `phase` ("compute": none, phase forward) from µs intervals."""
    return pd.DataFrame({
        "step": step,
        "optype": [optype or COMPUTE_OPTYPES.get(p, "compute") for p in phase],
        "phase": np.where(phase == "compute", "forward", phase), "mb": -1,
        "start_s": start * 1e-6, "duration_s": (end - start) * 1e-6, "op": "", "axis": "",
        "group_id": -1, "group_size": 0, "peer": -1, "seq": -1, "bytes": 0,
    })  # fmt: skip
