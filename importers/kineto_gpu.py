"""The GPU timeline of one rank's PyTorch profiler trace: its kernels, memory copies and sets,
each with the host launch that queued it; NCCL kernels paired with their `record_param_comms`
calls; compute operations from the other kernels; and the split of the rank's GPU time.

Kineto writes every GPU activity ("cat": "kernel", "gpu_memcpy", "gpu_memset") with args
"device", "stream" and "correlation"; the CUDA runtime call that launched it
("cat": "cuda_runtime", e.g. `cudaLaunchKernel`) carries the same "correlation". Times in µs.

Kinds, as Holistic Trace Analysis (HTA) classifies kernels: communication when the name holds
"nccl", memory for memcpy/memset, compute otherwise.

GPU time split (`gpu_time`), after HTA's temporal and idle-time breakdowns, over the rank's
activities of the profiled steps, from the first one's start to the last one's end (its span):
- compute: time some compute kernel runs; communication: some NCCL kernel runs and no compute
  kernel (an NCCL kernel runs while it waits for its peers, so waiting counts here, as in HTA);
  memory: only memory activities run; idle: nothing runs.
- each idle gap is classed by the activity that ends it (the one launched earliest of those
  starting then): host wait when its launch came after the gap began (the GPU waited for the
  host to queue work), kernel wait when it had been launched already (it waited on another
  stream's work, an event or a synchronisation), other when the trace records no launch for it.
  HTA classes per stream and calls gaps of an already launched kernel "kernel wait" only below
  30 ns ("other" above); here the classes are of the rank's whole GPU, whose idle time is what
  a step loses, and a queued kernel's wait is kernel wait whatever its length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ranktrace.importers.intervals import minus
from ranktrace.importers.ops import TraceError

GPU_CATEGORIES = {"kernel": 0, "gpu_memcpy": 2, "memcpy": 2, "gpu_memset": 2, "memset": 2}
"""Chrome-trace categories of GPU activities (lower case; older Kineto wrote "Kernel",
"Memcpy", "Memset") → kind, unless the name says otherwise (COMPUTE, COMMUNICATION, MEMORY)."""
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver", "runtime")
COMPUTE, COMMUNICATION, MEMORY = 0, 1, 2
MERGE_GAP_US = 10.0
"""Compute kernels of one step and phase less than this apart make one compute operation: the
gap between back-to-back kernels is launch overhead (a real step has thousands of kernels)."""
GPU_TIME_KEYS = ("span_s", "compute_pct", "communication_pct", "memory_pct", "idle_pct",
                 "idle_host_wait_pct", "idle_kernel_wait_pct", "idle_other_pct")  # fmt: skip
"""A rank's `gpu_time` entry: its span in seconds and shares of it in percent (the idle
classes add up to idle_pct)."""


@dataclass
class GpuTimeline:
    """A rank's GPU activities, sorted by start (µs on the trace's clock)."""

    name: np.ndarray
    start: np.ndarray
    end: np.ndarray
    kind: np.ndarray
    """COMPUTE, COMMUNICATION or MEMORY."""
    launch: np.ndarray
    """When the host launched it (the runtime call's start); NaN when unknown."""
    launch_tid: np.ndarray
    """The launching thread ("" when unknown)."""

    def __len__(self) -> int:
        return len(self.start)


def gpu_timeline(activities: list[dict], launches: dict) -> GpuTimeline | None:
    """The timeline of GPU `activities` (Kineto events) launched by `launches` (correlation →
    (ts, tid) of runtime calls); None without activities."""
    if not activities:
        return None
    name = np.array([str(a.get("name", "")) for a in activities], dtype=object)
    start = np.array([float(a["ts"]) for a in activities])
    end = start + np.array([float(a.get("dur", 0)) for a in activities])
    kind = np.array([GPU_CATEGORIES[a["cat"].lower()] for a in activities], dtype=np.int8)
    lower = np.array([n.lower() for n in name], dtype=object)
    kind[["nccl" in n for n in lower]] = COMMUNICATION
    kind[[n.startswith(("memcpy", "memset")) for n in lower]] = MEMORY
    launched = [launches.get((a.get("args") or {}).get("correlation")) for a in activities]
    launch = np.array([np.nan if x is None else x[0] for x in launched])
    launch_tid = np.array(["" if x is None else x[1] for x in launched], dtype=object)
    order = np.argsort(start, kind="stable")
    return GpuTimeline(name[order], start[order], end[order], kind[order], launch[order],
                       launch_tid[order])  # fmt: skip


def match_calls(calls: pd.DataFrame, gpu: GpuTimeline, path: Path) -> pd.DataFrame:
    """Each NCCL kernel with the `record_param_comms` call that launched it (`calls`, one row
    per call): the call whose span on the launching thread holds the kernel's launch; without
    launches recorded, the n-th kernel with the n-th call. Returns the calls that launched a
    kernel, then the kernels no call launched (name "", no group: the kernel says what they
    are), with kernel_start, kernel_end (µs) and kernel (its name); calls without a kernel are
    dropped (a coalesced part, or work outside the profiled window)."""
    nccl = np.flatnonzero(gpu.kind == COMMUNICATION)
    owner = np.full(len(nccl), -1)
    launched = ~np.isnan(gpu.launch[nccl])
    if calls.empty:
        pass  # no record_param_comms at all: every kernel is read on its own
    elif launched.any():
        for tid, part in calls.groupby("tid", sort=False):  # outermost calls: disjoint per tid
            starts, ends = part["ts"].to_numpy(), (part["ts"] + part["dur"]).to_numpy()
            mine = np.flatnonzero(launched & (gpu.launch_tid[nccl] == tid))
            at = np.searchsorted(starts, gpu.launch[nccl[mine]], side="right") - 1
            inside = (at >= 0) & (gpu.launch[nccl[mine]] <= ends[np.clip(at, 0, None)])
            owner[mine[inside]] = part.index.to_numpy()[at[inside]]
        # A launch on another thread than its call's: the latest call whose span holds it.
        ordered = calls.sort_values("ts", kind="stable")
        starts, ends = ordered["ts"].to_numpy(), (ordered["ts"] + ordered["dur"]).to_numpy()
        rest = np.flatnonzero(launched & (owner < 0))
        at = np.searchsorted(starts, gpu.launch[nccl[rest]], side="right") - 1
        inside = (at >= 0) & (gpu.launch[nccl[rest]] <= ends[np.clip(at, 0, None)])
        owner[rest[inside]] = ordered.index.to_numpy()[at[inside]]
    elif len(nccl) == len(calls):
        owner[:] = calls.sort_values("ts", kind="stable").index.to_numpy()
    else:
        raise TraceError(
            f"{path.name}: {len(nccl)} NCCL kernels but {len(calls)} record_param_comms calls and "
            "no launch correlation to pair them; export the trace with the CUDA runtime "
            "events (ProfilerActivity.CPU and CUDA)"
        )
    kernels = pd.DataFrame({
        "owner": owner, "kernel_start": gpu.start[nccl], "kernel_end": gpu.end[nccl],
        "kernel": gpu.name[nccl], "launch": gpu.launch[nccl],
    })  # fmt: skip
    owned = kernels[kernels["owner"] >= 0].groupby("owner").agg(
        kernel_start=("kernel_start", "min"), kernel_end=("kernel_end", "max"),
        kernel=("kernel", "first"),
    )  # fmt: skip
    matched = calls.join(owned, how="inner")
    alone = kernels[kernels["owner"] < 0]
    bare = pd.DataFrame({
        "ts": np.where(np.isnan(alone["launch"]), alone["kernel_start"], alone["launch"]),
        "dur": 0.0, "tid": "", "name": "", "bytes": 0, "peer": -1, "local_peer": -1,
        "ranks": None, "size": 0, "desc": "", "pg": "", "pg_seq": -1,
        "kernel_start": alone["kernel_start"], "kernel_end": alone["kernel_end"],
        "kernel": alone["kernel"],
    })  # fmt: skip
    return pd.concat([matched, bare], ignore_index=True) if len(bare) else matched


def activity_times(gpu: GpuTimeline) -> np.ndarray:
    """(activities,) the host time that places each activity in a step and phase: its launch,
    else its own start."""
    return np.where(np.isnan(gpu.launch), gpu.start, gpu.launch)


def compute_pieces(gpu: GpuTimeline, code: np.ndarray) -> tuple[np.ndarray, ...]:
    """Compute operations of a rank: its compute and memory activities with `code` (one per
    (step, phase), -1: outside the profiled steps) made disjoint (the earlier one owns an
    overlap), those of one code less than MERGE_GAP_US apart joined, minus the NCCL kernels'
    time. Returns (code, start, end) of the pieces, µs."""
    work = (gpu.kind != COMMUNICATION) & (code >= 0)
    order = np.flatnonzero(work)[np.lexsort((-gpu.end[work], gpu.start[work]))]
    start, end, piece_code = gpu.start[order], gpu.end[order], code[order]
    covered = np.concatenate([[-np.inf], np.maximum.accumulate(end)[:-1]])
    start = np.maximum(start, covered)
    kept = end > start
    start, end, piece_code = start[kept], end[kept], piece_code[kept]
    new = np.ones(len(start), dtype=bool)
    new[1:] = (piece_code[1:] != piece_code[:-1]) | (start[1:] - end[:-1] >= MERGE_GAP_US)
    first = np.flatnonzero(new)
    start = start[first]
    end = np.maximum.reduceat(end, first) if len(first) else end[first]
    piece_code = piece_code[first]
    nccl = gpu.kind == COMMUNICATION
    index, start, end = minus(start, end, gpu.start[nccl], gpu.end[nccl])
    return piece_code[index], start, end


def idle_before_steps(gpu: GpuTimeline, step: np.ndarray) -> pd.DataFrame:
    """Per profiled step after the first: the GPU's idle time between the previous step's last
    activity and this step's first one (step, start, end in µs), so that a rank's steps follow
    one another on the GPU as the trainer's step spans do, and time the GPU waited between
    steps is the step's host time."""
    inside = step >= 0
    order = np.argsort(step[inside], kind="stable")
    steps = step[inside][order]
    if not len(steps):
        return pd.DataFrame({"step": steps, "start": [], "end": []})
    first = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    begin = np.minimum.reduceat(gpu.start[inside][order], first)
    finish = np.maximum.reduceat(gpu.end[inside][order], first)
    gap = pd.DataFrame({"step": steps[first][1:], "start": finish[:-1], "end": begin[1:]})
    return gap[gap["end"] > gap["start"]]


def gpu_time(gpu: GpuTimeline, step: np.ndarray) -> dict:
    """A rank's GPU time split (module docstring) over its activities of the profiled steps
    (`step` >= 0): GPU_TIME_KEYS."""
    inside = step >= 0
    start, end, kind = gpu.start[inside], gpu.end[inside], gpu.kind[inside]
    launch = gpu.launch[inside]
    if not len(start):
        return dict.fromkeys(GPU_TIME_KEYS, 0.0)
    span = float(end.max() - start.min())
    compute = _covered(start, end, kind == COMPUTE)
    busy_no_memory = _covered(start, end, kind != MEMORY)
    busy = _covered(start, end, np.ones(len(start), dtype=bool))
    order = np.lexsort((launch, start))  # among equal starts, the earliest launch first
    start, end, launch = start[order], end[order], launch[order]
    reached = np.maximum.accumulate(end)
    gap = np.flatnonzero(start[1:] > reached[:-1]) + 1  # activities that end an idle gap
    gap_start, gap_end, gap_launch = reached[gap - 1], start[gap], launch[gap]
    seconds = gap_end - gap_start
    host_wait = seconds[gap_launch > gap_start].sum()
    kernel_wait = seconds[gap_launch <= gap_start].sum()
    other = seconds[np.isnan(gap_launch)].sum()

    def pct(us: float) -> float:
        return 100.0 * float(us) / span if span > 0 else 0.0

    return {
        "span_s": span * 1e-6, "compute_pct": pct(compute),
        "communication_pct": pct(busy_no_memory - compute),
        "memory_pct": pct(busy - busy_no_memory), "idle_pct": pct(span - busy),
        "idle_host_wait_pct": pct(host_wait),
        "idle_kernel_wait_pct": pct(kernel_wait), "idle_other_pct": pct(other),
    }  # fmt: skip


def _covered(start: np.ndarray, end: np.ndarray, mask: np.ndarray) -> float:
    """µs covered by the union of the intervals where `mask`."""
    if not mask.any():
        return 0.0
    order = np.argsort(start[mask], kind="stable")
    s, e = start[mask][order], end[mask][order]
    reached = np.concatenate([[-np.inf], np.maximum.accumulate(e)[:-1]])
    return float(np.clip(e - np.maximum(s, reached), 0.0, None).sum())
