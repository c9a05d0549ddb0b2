"""Read PyTorch profiler (Kineto) Chrome traces, one file per rank, into the ops/workers tables.

Input: a folder of `*.json` / `*.json.gz` files that `torch.profiler` wrote on every rank of one
job (`export_chrome_trace` or `tensorboard_trace_handler`). What each file gives:

- rank and world size: `distributedInfo.rank` / `.world_size`; full rank lists and descriptions
  of the rank's process groups: `distributedInfo.pg_config`.
- host: `host_name` / `hostName` when the trace records it, else the host in the file's name
  when that is exactly `tensorboard_trace_handler`'s `<host>_<pid>.<time>.pt.trace.json[.gz]`
  (a host name of letters, digits, dots and dashes, a numeric pid, a time of ≥ 13 digits), else
  "" (hosts unknown: the report then makes no per-node finding or advice).
- times: `baseTimeNanoseconds` (epoch offset, 0 when absent) + `ts`; `ts` and `dur` in µs.
- steps: CPU `ProfilerStep#N` spans. An operation belongs to the step whose span holds its
  start (on a GPU, its host launch); operations outside every step are dropped.
- collectives: CPU `record_param_comms` events, the outermost one per call, in the newer form
  (collective name, element counts, dtype, process group, "Seq") or the older one (at most
  input dims and types; importers/kineto_comms.py). The NCCL backend records them; gloo does
  not (torch 2.13: only `c10d::allreduce_`-style ops without a group), so such a trace is
  refused rather than imported without its communication. optype: the "Collective name"
  (`allreduce`, `_allgather_base`, ...), else the op its NCCL kernel names; op: as ranktrace
  names it (`all_reduce`, ...).

A trace with a GPU timeline (kernels, memcpy/memset; importers/kineto_gpu.py) is read from it:
- a collective is its NCCL kernel (the record_param_comms event only spans the launch), paired
  with its call through the launch's "correlation" (by order without one); its start and end are
  the kernel's, so the store's split of it holds: transfer = its end − the latest start among
  the members' kernels, blocking (waiting for late peers) = the rest. A kernel no call launched
  is a collective of its own, on the default group.
- compute: the other kernels and memory activities, placed in the step and phase span holding
  their launch, merged (gaps < 10 µs) and cut by the NCCL kernels: `forward-compute`, ...
  operations; GPU idle between two steps is a `gpu-idle` operation outside every phase (the
  step's host time), idle inside a step lies between its operations.
- `gpu_time`: per rank the split of its GPU time into compute, communication, memory and idle
  (host wait, kernel wait, other), after Holistic Trace Analysis (importers/kineto_gpu.py).
- the replay takes the rendezvous model (REPLAY_MODEL_GPU; analysis/replay_graph.py).
Without one (a CPU-only trace), compute is each phase span minus the collectives' CPU time, and
the replay the host-serial model.

Older record_param_comms (no collective name, group or sequence number): the collective comes
from the NCCL kernel (`ncclKernel_AllReduce_...` → all_reduce, SendRecv → all_to_all), the group
is the default one and calls are matched across ranks by their order in the step. Refused in one
line when that cannot hold: no kernel to name the collective (a CPU-only trace), the job has
smaller groups (pg_config) a call might have run on, or ranks launch different collectives in a
step.

Phase spans (the profiler names no phases): user annotations and Python functions named like
`*forward*`, `*backward*`, `*optimizer*` (`Optimizer.step#AdamW.step`) or
`enumerate(DataLoader)*` (data), and the `autograd::engine::evaluate_function*` ops (backward);
nested or overlapping spans are trimmed so the outer, earlier one owns the time. Compute of a
CPU-only trace: each phase span minus the time inside collectives, as `forward-compute`,
`backward-compute`, `optimizer` or `data` ops (one per gap between collectives); a step with no
phase span gives `compute` ops (phase forward) over its ProfilerStep span minus collectives.
GPU compute outside every phase span is `compute` (phase forward) too. Axes, the phase and seq
of a collective, and mesh coordinates: importers/kineto_job.py.

Not modelled: point-to-point calls batched into one kernel (`batch_isend_irecv`, coalesced
calls): a call that launched no kernel of its own is dropped. A GPU pipeline whose sends end
before their recv is posted (eager, unbatched 1F1B) has no order the rendezvous replay can follow.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from ranktrace.analysis.replay_graph import HOST_SERIAL, RENDEZVOUS
from ranktrace.importers.intervals import disjoint, lookup
from ranktrace.importers.kineto_comms import comm_rows, finish_calls, kernel_op
from ranktrace.importers.kineto_compute import cpu_compute, gpu_compute
from ranktrace.importers.kineto_gpu import (
    COMMUNICATION,
    GPU_CATEGORIES,
    RUNTIME_CATEGORIES,
    gpu_timeline,
    match_calls,
)
from ranktrace.importers.kineto_job import AXIS_WORDS, axis_word, job_collectives, workers_table
from ranktrace.importers.ops import OP_COLUMNS, WORKER_COLUMNS, TraceError, check_tables, typed
from ranktrace.importers.parallel import map_files

PARAM_COMMS = "record_param_comms"
STEP_PREFIX = "ProfilerStep#"
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function"
CPU_CATEGORIES = ("cpu_op", "user_annotation", "python_function")
TRACE_HANDLER_NAME = re.compile(
    r"^(?P<host>[A-Za-z0-9][A-Za-z0-9.-]*)_\d+\.\d{13,}\.pt\.trace\.json(\.gz)?$"
)
"""`tensorboard_trace_handler`'s file name: f"{gethostname()}_{getpid()}" then the time in ns
(ms in torch < 1.13), `.pt.trace.json`, `.gz` when compressed."""
HOST_KEYS = ("host_name", "hostName")
GPU_CATEGORY_NAMES = {*GPU_CATEGORIES, *(c.capitalize() for c in GPU_CATEGORIES)}
RUNTIME_CATEGORY_NAMES = {*RUNTIME_CATEGORIES, *(c.capitalize() for c in RUNTIME_CATEGORIES)}
REPLAY_MODEL_GPU, REPLAY_MODEL_CPU = RENDEZVOUS, HOST_SERIAL
"""GPU traces replay with point-to-point on its own stream and launch delays; CPU-only traces
as this project's CPU ranks (analysis/replay_graph.py)."""


class _Worker(NamedTuple):
    host: str
    comms: pd.DataFrame  # one row per collective call, before axis, phase and seq
    compute: pd.DataFrame  # finished compute ops
    described: list[tuple[tuple[int, ...], str]]  # (ranks, axis) of pg_config groups
    gpu_time: dict | None  # kineto_gpu.gpu_time, None without a GPU timeline


class _Events(NamedTuple):
    steps: list  # (n, ts, dur) of ProfilerStep#n
    spans: list  # (phase, ts, dur)
    comms: list  # record_param_comms events
    c10d_op: str  # a c10d op's name, "" when none
    activities: list  # GPU kernels, memcpy, memset
    launches: dict  # correlation → (ts, tid) of runtime calls


@dataclass
class ProfilerTrace:
    """What a folder of profiler traces holds, ready to import."""

    ops: pd.DataFrame
    workers: pd.DataFrame
    gpu_time: dict[int, dict] | None
    """Per rank its GPU time split (kineto_gpu.GPU_TIME_KEYS); None without a GPU timeline."""
    replay_model: str
    """REPLAY_MODEL_GPU or REPLAY_MODEL_CPU."""

    def gpu_time_record(self) -> dict[str, dict] | None:
        """`gpu_time` as run.json keeps it (the report's `gpu_time`): rank (a string, as JSON
        keys are) → its split."""
        return {str(r): split for r, split in self.gpu_time.items()} if self.gpu_time else None


def read_profiler_dir(directory: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(ops, workers) of every `*.json` / `*.json.gz` trace in `directory` (`read_profiler`)."""
    trace = read_profiler(directory)
    return trace.ops, trace.workers


def read_profiler(directory: Path) -> ProfilerTrace:
    """Every `*.json` / `*.json.gz` trace in `directory` (one per rank), read.

    Raises TraceError, naming the file, the problem and the fix, for a folder without traces, a
    file that is not a profiler trace or lacks its rank or ProfilerStep spans, two files of one
    rank, disagreeing world sizes, missing ranks, a GPU timeline on some ranks only,
    collectives without record_param_comms (gloo), a send/recv whose peer the trace does not
    name, and older record_param_comms that cannot be matched across ranks.
    """
    files = _trace_files(Path(directory))
    workers: dict[int, _Worker] = {}
    world, world_file = -1, ""
    for path, (rank, size, worker) in zip(files, map_files(_read_file, files), strict=True):
        if world < 0:
            world, world_file = size, path.name
        elif size != world:
            raise TraceError(
                f"{path.name} says world_size {size} but {world_file} says {world}: "
                "keep only the traces of one job in the folder"
            )
        if not 0 <= rank < world:
            raise TraceError(f"{path.name}: rank {rank} outside world_size {world}")
        if rank in workers:
            raise TraceError(
                f"{path.name}: rank {rank} is also in another file of the folder: "
                "keep one trace per rank (one profiling window)"
            )
        workers[rank] = worker
    missing = sorted(set(range(world)) - set(workers))
    if missing:
        raise TraceError(
            f"{directory}: no trace of rank(s) {missing[:8]} of world_size {world}: "
            "copy every rank's trace into the folder"
        )
    on_gpu = sorted(r for r, w in workers.items() if w.gpu_time is not None)
    if on_gpu and len(on_gpu) < world:
        without = sorted(set(workers) - set(on_gpu))
        raise TraceError(
            f"{directory}: rank(s) {without[:8]} have no GPU kernels but rank {on_gpu[0]} has: "
            "profile every rank with ProfilerActivity.CUDA"
        )
    comms = job_collectives(pd.concat([w.comms for w in workers.values()]), world)
    ops = pd.concat([comms, *(w.compute for w in workers.values())], ignore_index=True)
    ops = ops.sort_values(["worker", "start_s"], kind="stable", ignore_index=True)
    described = {g for w in workers.values() for g in w.described}
    table = workers_table({r: w.host for r, w in workers.items()}, described, comms)
    check_tables(ops, table)
    return ProfilerTrace(
        typed(ops, OP_COLUMNS), typed(table, WORKER_COLUMNS),
        {r: workers[r].gpu_time for r in on_gpu} if on_gpu else None,
        REPLAY_MODEL_GPU if on_gpu else REPLAY_MODEL_CPU,
    )  # fmt: skip


def _read_file(path: Path) -> tuple[int, int, _Worker]:
    """(rank, world size, what the trace holds) of one rank's file."""
    trace = _load(path)
    rank, size = _identity(trace, path)
    return rank, size, _read_worker(trace, path, rank, size)


def _trace_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise TraceError(
            f"{directory}: no such folder; pass the folder of per-rank profiler traces"
        )
    files = sorted(p for p in directory.iterdir() if p.name.endswith((".json", ".json.gz")))
    if not files:
        raise TraceError(
            f"{directory}: no *.json or *.json.gz trace; pass the folder that "
            "torch.profiler wrote one trace per rank into"
        )
    return files


def _load(path: Path) -> dict:
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError, bad gzip, bad UTF-8
        raise TraceError(
            f"{path.name}: not a JSON trace ({e}); export it with "
            "prof.export_chrome_trace() or tensorboard_trace_handler"
        ) from e
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(
            f"{path.name}: no traceEvents list, so not a PyTorch profiler trace; "
            "export it with prof.export_chrome_trace()"
        )
    return trace


def _identity(trace: dict, path: Path) -> tuple[int, int]:
    info = trace.get("distributedInfo")
    if not isinstance(info, dict) or "rank" not in info:
        raise TraceError(
            f"{path.name}: no distributedInfo.rank; profile after "
            "torch.distributed.init_process_group so each trace names its rank"
        )
    if "world_size" not in info:
        raise TraceError(
            f"{path.name}: no distributedInfo.world_size; profile after "
            "torch.distributed.init_process_group"
        )
    return int(info["rank"]), int(info["world_size"])


def _read_worker(trace: dict, path: Path, rank: int, world: int) -> _Worker:
    events = _classify(trace["traceEvents"])
    if not events.steps:
        raise TraceError(
            f"{path.name}: no ProfilerStep#N spans; profile with a schedule and call "
            "prof.step() once per training step"
        )
    gpu = gpu_timeline(events.activities, events.launches)
    nccl_kernels = gpu is not None and bool((gpu.kind == COMMUNICATION).any())
    if events.c10d_op and not events.comms and not nccl_kernels:
        raise TraceError(
            f"{path.name}: collectives ({events.c10d_op}) without record_param_comms metadata, "
            "which the gloo backend does not record; import a trace of an NCCL run, or record "
            "this job with ranktrace's own telemetry"
        )
    steps = sorted(events.steps, key=lambda s: s[1])
    step_no, step_start, dur = (np.array(column) for column in zip(*steps, strict=True))
    step_end = step_start + dur
    pg = _pg_config(trace)
    calls = comm_rows(events.comms, {n: r for n, (r, _) in pg.items()}, world)
    if gpu is not None:
        calls = _named_by_kernels(match_calls(calls, gpu, path), path)
    elif (calls["name"] == "").any():
        raise TraceError(
            f'{path.name}: record_param_comms without a "Collective name" (an older form) and '
            "no GPU kernels to tell the collective; export the trace with "
            "ProfilerActivity.CUDA, or re-profile with torch >= 2.4"
        )
    _check_groups_known(calls, pg, world, path)
    comms = finish_calls(calls, rank, world, path)
    comms["step"] = lookup(comms["ts"].to_numpy(), step_start, step_end, step_no, -1)
    comms = comms[comms["step"] >= 0].sort_values("ts", kind="stable")
    span_phase, span_start, span_end = disjoint(events.spans)
    comms["enclosing"] = lookup(comms["ts"].to_numpy(), span_start, span_end, span_phase, "")
    comms["idx"] = comms.groupby(["key", "step"]).cumcount()
    steps = (step_no, step_start, step_end)
    spans = (span_phase, span_start, span_end)
    if gpu is None:
        compute, split = cpu_compute(steps, spans, comms), None
        begin, length = comms["ts"], comms["dur"]
    else:
        compute, split = gpu_compute(gpu, steps, spans)
        begin, length = comms["kernel_start"], comms["kernel_end"] - comms["kernel_start"]
    base_s = float(trace.get("baseTimeNanoseconds", 0)) / 1e9
    compute["start_s"] += base_s
    comms["start_s"] = base_s + begin * 1e-6
    comms["duration_s"] = length * 1e-6
    comms["worker"] = compute["worker"] = rank
    described = [(r, AXIS_WORDS[w]) for r, desc in pg.values() if (w := axis_word(desc))]
    return _Worker(_host(trace, path), comms, compute, described, split)


def _named_by_kernels(calls: pd.DataFrame, path: Path) -> pd.DataFrame:
    """Calls without a "Collective name" (older form, or a kernel no call launched) named by
    their NCCL kernel's collective; TraceError for a kernel name NCCL does not give."""
    unnamed = calls["name"] == ""
    ops = calls.loc[unnamed, "kernel"].map(kernel_op)
    unknown = ops[ops == ""]
    if len(unknown):
        kernel = calls.loc[unknown.index[0], "kernel"]
        raise TraceError(
            f'{path.name}: a collective without a "Collective name" whose kernel {kernel!r} '
            "names no NCCL collective; re-profile with torch >= 2.4 (its record_param_comms "
            "names the collective and its group)"
        )
    calls.loc[unnamed, "name"] = ops
    return calls


def _check_groups_known(calls: pd.DataFrame, pg: dict, world: int, path: Path) -> None:
    """A call without a recorded group is read as on the default group (every rank), which
    holds only when the job has no smaller group it could have run on."""
    if not calls["ranks"].isna().any():
        return
    smaller = sorted({r for r, _ in pg.values() if 1 < len(r) < world})
    if smaller:
        raise TraceError(
            f"{path.name}: {int(calls['ranks'].isna().sum())} collectives record no process "
            f"group (an older record_param_comms form) and the job has smaller groups "
            f"(pg_config: {list(smaller[0])}, ...): re-profile with torch >= 2.4 so each "
            "call names its group"
        )


def _classify(events: list) -> _Events:
    """One pass over a trace's events: what the importer reads of them (_Events)."""
    steps, spans, comms, c10d_op, activities, launches = [], [], [], "", [], {}
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        category = e.get("cat", "")
        if category not in CPU_CATEGORIES:
            if category in GPU_CATEGORY_NAMES:
                activities.append(e)
            elif category in RUNTIME_CATEGORY_NAMES:
                correlation = (e.get("args") or {}).get("correlation")
                if correlation is not None:
                    launches[correlation] = (float(e["ts"]), str(e.get("tid", "")))
            continue
        name = e.get("name", "")
        if name == PARAM_COMMS:
            comms.append(e)
        elif name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX) :].isdigit():
            steps.append((int(name[len(STEP_PREFIX) :]), float(e["ts"]), float(e.get("dur", 0))))
        elif name.startswith("c10d::"):
            c10d_op = name
        elif phase := _span_phase(name, category):
            spans.append((phase, float(e["ts"]), float(e.get("dur", 0))))
    return _Events(steps, spans, comms, c10d_op, activities, launches)


def _span_phase(name: str, category: str) -> str:
    if category == "cpu_op":
        return "backward" if name.startswith(AUTOGRAD_PREFIX) else ""
    # A Python function event is "path/file.py(line): function": match the function only.
    lower = name.rsplit("): ", 1)[-1].lower() if category == "python_function" else name.lower()
    if lower.startswith("enumerate(dataloader)"):
        return "data"
    for word in ("optimizer", "backward", "forward"):
        if word in lower:
            return word
    return ""


def _pg_config(trace: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Process group name → (ranks, description), from distributedInfo.pg_config."""
    config = trace["distributedInfo"].get("pg_config") or []
    return {str(g["pg_name"]): (tuple(sorted(int(r) for r in g.get("ranks", []))),
                                str(g.get("pg_desc", "")))
            for g in config if isinstance(g, dict) and "pg_name" in g}  # fmt: skip


def _host(trace: dict, path: Path) -> str:
    """The trace's host (HOST_KEYS), else the host of a trace handler's file name, else ""."""
    recorded = next((trace[key] for key in HOST_KEYS if trace.get(key)), "")
    if recorded:
        return str(recorded)
    match = TRACE_HANDLER_NAME.match(path.name)
    return match["host"] if match else ""
