"""Per-op traces for import tests and benchmarks: a small simulator of a GPU job, 1F1B pipeline
with data parallelism, Megatron-style, that writes the per-op Parquet schema
(importers/perop.py), with causes planted.

What it simulates (written apart from the replay, so the two do not agree by construction):
- the host issues a worker's ops in program order, each LAUNCH_S after the previous one (plus
  any host pause); it blocks on every point-to-point call until the call completes (Megatron's
  synchronous p2p), not on compute or collectives;
- compute ops and collectives run in order on the compute stream, each from the later of its
  launch and the stream being free; a forward (backward) compute also waits for the recv that
  brought its input;
- point-to-point calls run in order on their own stream: a call posts at the later of its
  launch, the stream being free and (a send) the compute that produced its tensor; in steady
  1F1B a send and a recv go out as one batched call (two rows, one start, one duration); each
  transfer completes P2P_S after both its ends posted, a call when all its transfers did, so a
  send waits for its peer;
- after the last backward: gc, layernorm-grads all-reduce, embedding-grads all-reduce (first
  and last stage), grads reduce-scatter, optimizer-clip-main-grad (an all-reduce of every
  worker), optimizer; the step starts with the params all-gather. A collective ends its
  TRANSFER_S after its last member started.
Rows: every op's start on its stream and its duration (waiting included); seq_id is the n-th op
of its type in the step on that worker, mb_id the micro-batch of compute ops.

`true_slowdown` is the published S on the simulator's own dynamics: the steps simulated without
launch delays over the same steps with every compute op at its mean over all workers and steps
of the same op (optype, seq_id), the reference the analysis's S is checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

P2P_S = 0.0008
LAUNCH_S = 0.0003
TRANSFER_S = {
    "grads-reduce-scatter": 0.004, "params-all-gather": 0.003,
    "embedding-grads-all-reduce": 0.0015, "layernorm-grads-all-reduce": 0.0004,
    "optimizer-clip-main-grad": 0.0005,
}  # fmt: skip
BASE_S = {"forward-compute": 0.010, "backward-compute": 0.020, "optimizer": 0.004, "gc": 0.0}
STEP_GAP_S = 0.002
AFTER_BACKWARD = ("gc", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
                  "grads-reduce-scatter", "optimizer-clip-main-grad", "optimizer")  # fmt: skip
SENDS = {"forward-send": ("forward", +1), "backward-send": ("backward", -1)}
RECVS = {"forward-recv": ("forward", -1), "backward-recv": ("backward", +1)}


@dataclass
class Job:
    """A simulated job and what is planted in it."""

    pp: int = 4
    dp: int = 4
    micro_batches: int = 8
    steps: int = 16
    noise: float = 0.02
    """Lognormal sigma of every compute op (real kernels are not exact)."""
    slow_worker: tuple[int, int] | None = None
    """(dp_rank, stage) whose compute takes `slow_factor` × as long..."""
    slow_factor: float = 1.5
    long_stage: int | None = None
    """...a stage whose compute takes `stage_factor` × as long on every dp_rank..."""
    stage_factor: float = 1.6
    sequence_spread: float = 0.0
    """...each (step, dp_rank, micro-batch) compute scaled by U(1 - s, 1 + s) on every stage."""
    gc: dict[tuple[int, int], float] = field(default_factory=dict)
    """(step, worker) -> seconds the host pauses at the start of that step (a GC pause)."""
    launch_s: float = LAUNCH_S
    """Host time between two launches (0: a host that never delays the device)."""
    seed: int = 0

    def worker(self, dp_rank: int, stage: int) -> int:
        return stage * self.dp + dp_rank


def _program(job: Job, stage: int) -> list[list[tuple[str, int]]]:
    """One step's calls of a worker in issue order; a call is one op or a batched send and
    recv: [(optype, micro-batch or -1)]. Megatron's 1F1B without virtual stages: warm-up
    forwards, then one forward and one backward per micro-batch with the sends and recvs
    between them batched, then the cool-down backwards."""
    m, first, last = job.micro_batches, stage == 0, stage == job.pp - 1
    warmup = min(job.pp - stage - 1, m)
    steady = m - warmup
    calls: list[list[tuple[str, int]]] = [[("params-all-gather", -1)]]

    def add(*ops: tuple[str, int]) -> None:
        if ops:
            calls.append(list(ops))

    for mb in range(warmup):
        add(*([] if first else [("forward-recv", mb)]))
        add(("forward-compute", mb))
        add(*([] if last else [("forward-send", mb)]))
    if steady:
        add(*([] if first else [("forward-recv", warmup)]))
    for i in range(steady):
        add(("forward-compute", warmup + i))
        add(*([] if last else [("forward-send", warmup + i), ("backward-recv", i)]))
        add(("backward-compute", i))
        if i == steady - 1:
            add(*([] if first else [("backward-send", i)]))
        else:
            add(*([] if first else [("backward-send", i), ("forward-recv", warmup + i + 1)]))
    for mb in range(steady, m):
        add(*([] if last else [("backward-recv", mb)]))
        add(("backward-compute", mb))
        add(*([] if first else [("backward-send", mb)]))
    for name in AFTER_BACKWARD:
        if name != "embedding-grads-all-reduce" or (job.pp > 1 and (first or last)):
            add((name, -1))
    return calls


def compute_durations(job: Job) -> Callable[[int, int, int, str, int], float]:
    """(step, stage, dp_rank, optype, mb) -> seconds, with the planted causes and noise."""
    rng = np.random.default_rng(job.seed)
    noise: dict = {}
    spread: dict = {}

    def duration(step, stage, dp_rank, optype, mb):
        key = (step, stage, dp_rank, optype, mb)
        if key not in noise:
            noise[key] = float(rng.lognormal(0.0, job.noise))
        seconds = BASE_S[optype] * noise[key]
        if optype in ("forward-compute", "backward-compute"):
            if job.sequence_spread and mb >= 0:
                if (step, dp_rank, mb) not in spread:
                    s = job.sequence_spread
                    spread[(step, dp_rank, mb)] = float(rng.uniform(1 - s, 1 + s))
                seconds *= spread[(step, dp_rank, mb)]
            if stage == job.long_stage:
                seconds *= job.stage_factor
        if (dp_rank, stage) == job.slow_worker:
            seconds *= job.slow_factor
        return seconds

    return duration


@dataclass
class _Worker:
    dp: int
    stage: int
    calls: list
    position: int = 0
    host: float = 0.0  # when the host can launch the next call
    compute_free: float = 0.0
    comm_free: float = 0.0
    produced: dict = field(default_factory=dict)  # (direction, mb) -> compute end
    received: dict = field(default_factory=dict)  # (direction, mb) -> recv call end
    counts: dict = field(default_factory=dict)  # optype -> ops so far this step


def simulate_step(job: Job, step: int, t0: float, duration) -> list[dict]:
    """One step of every worker from time t0: the per-op rows (module docstring)."""
    workers = {(d, s): _Worker(d, s, _program(job, s)) for s in range(job.pp)
               for d in range(job.dp)}  # fmt: skip
    for (d, s), w in workers.items():
        w.host = w.compute_free = w.comm_free = t0
        w.host += job.gc.get((step, job.worker(d, s)), 0.0)
    posted: dict = {}  # (direction, dp, lower stage, mb) -> {side: post time}
    arrived: dict = {}  # (optype, members) -> {worker: start}
    rows: list[dict] = []

    def record(w: _Worker, optype: str, mb: int, start: float, end: float) -> None:
        nth = w.counts.get(optype, 0)
        w.counts[optype] = nth + 1
        compute = optype.endswith("-compute")
        rows.append({"dp_rank": w.dp, "stage": w.stage, "rank": job.worker(w.dp, w.stage),
                     "step": step, "optype": optype, "start_ts": start, "duration": end - start,
                     "seq_id": nth, "mb_id": mb if compute else None})  # fmt: skip

    def transfer_key(optype: str, w: _Worker, mb: int):
        direction, offset = {**SENDS, **RECVS}[optype]
        return (direction, w.dp, min(w.stage, w.stage + offset), mb)

    def try_call(w: _Worker) -> bool:
        call = w.calls[w.position]
        launch = w.host + job.launch_s
        optype, mb = call[0]
        if optype in SENDS or optype in RECVS:
            post = max(launch, w.comm_free)
            for name, m in call:
                if name in SENDS:
                    post = max(post, w.produced[(SENDS[name][0], m)])
            transfers = [posted.setdefault(transfer_key(name, w, m), {}) for name, m in call]
            for (name, _), sides in zip(call, transfers, strict=True):
                sides.setdefault("send" if name in SENDS else "recv", post)
            if any(len(sides) < 2 for sides in transfers):
                return False  # a peer has not posted yet: come back
            end = max(max(sides.values()) + P2P_S for sides in transfers)
            for name, m in call:
                record(w, name, -1, post, end)
                if name in RECVS:
                    w.received[(RECVS[name][0], m)] = end
            w.comm_free = w.host = end  # the host waits for the call
            return True
        start = max(launch, w.compute_free)
        if optype.endswith("-compute"):
            direction = optype.split("-")[0]
            start = max(start, w.received.get((direction, mb), start))
            end = start + duration(step, w.stage, w.dp, optype, mb)
            w.produced[(direction, mb)] = end
        elif optype in TRANSFER_S:
            members = _members(job, optype, w.dp, w.stage)
            group = arrived.setdefault((optype, members), {})
            group.setdefault((w.dp, w.stage), start)
            if len(group) < len(members):
                return False
            end = max(group.values()) + TRANSFER_S[optype]
            start = group[(w.dp, w.stage)]
        else:  # optimizer, gc
            end = start + duration(step, w.stage, w.dp, optype, mb)
        record(w, optype, mb, start, end)
        w.compute_free, w.host = end, launch
        return True

    progress = True
    while progress:
        progress = False
        for w in workers.values():
            while w.position < len(w.calls) and try_call(w):
                w.position += 1
                progress = True
    stuck = [key for key, w in workers.items() if w.position < len(w.calls)]
    assert not stuck, f"simulated schedule deadlocked on {stuck}"
    return rows


def _members(job: Job, optype: str, dp_rank: int, stage: int) -> tuple:
    if optype in ("grads-reduce-scatter", "params-all-gather"):
        return tuple((d, stage) for d in range(job.dp))
    if optype == "embedding-grads-all-reduce":
        return ((dp_rank, 0), (dp_rank, job.pp - 1))
    if optype == "optimizer-clip-main-grad":
        return tuple((d, s) for s in range(job.pp) for d in range(job.dp))
    return ((dp_rank, stage),)  # layernorm: tp folded into the worker


def simulate(job: Job, duration=None) -> pd.DataFrame:
    """Every step of `job` as per-op rows (all columns of the per-op schema)."""
    duration = duration or compute_durations(job)
    rows, t0 = [], 1000.0
    for step in range(job.steps):
        step_rows = simulate_step(job, step, t0, duration)
        rows += step_rows
        t0 = max(r["start_ts"] + r["duration"] for r in step_rows) + STEP_GAP_S
    frame = pd.DataFrame(rows).sort_values(["rank", "start_ts"], kind="stable")
    frame = frame.reset_index(drop=True)
    frame["mc"] = 0
    frame["gmc"] = frame["stage"]
    frame["mb_id"] = frame["mb_id"].astype("Int64")
    return frame


def step_times(trace: pd.DataFrame) -> pd.Series:
    """Per step: last end - first start over all workers."""
    ends = trace["start_ts"] + trace["duration"]
    return ends.groupby(trace["step"]).max() - trace["start_ts"].groupby(trace["step"]).min()


def true_slowdown(job: Job, trace: pd.DataFrame, steps: list[int]) -> float:
    """The published S of `steps`, on the simulator's own dynamics (module docstring)."""
    compute = trace[trace["optype"].isin(list(BASE_S))]
    compute = compute[compute["step"].isin(steps)]
    means = compute.groupby(["optype", "seq_id"])["duration"].mean().to_dict()
    counts: dict = {}

    def ideal(step, stage, dp_rank, optype, mb):
        key = (step, stage, dp_rank, optype)
        nth = counts.get(key, 0)
        counts[key] = nth + 1
        return means[(optype, nth)]

    quiet = replace(job, gc={}, launch_s=0.0)
    actual = step_times(simulate(quiet, compute_durations(job)))[steps].sum()
    return actual / step_times(simulate(quiet, ideal))[steps].sum()


def write_trace(trace: pd.DataFrame, path: Path, steps: list[int] | None = None) -> Path:
    """The per-op Parquet file of `trace` (only `steps` when given: a sample)."""
    if steps is not None:
        trace = trace[trace["step"].isin(steps)]
    trace.to_parquet(path, index=False)
    return path
