"""Per-op traces for import tests and benchmarks: a small simulator of a 1F1B pipeline with data
parallelism that writes the per-op Parquet schema (importers/perop.py), with causes planted.

Semantics (the ones real traces show): a worker runs its ops one after another; a send never
waits (its transfer takes P2P_S); a recv ends P2P_S after both it and its send were issued; a
collective ends TRANSFER_S after its last member arrives. Every op's recorded duration runs from
when its worker issued it to its end, so waiting is inside recv and collective durations. Each
step starts for every worker at the end of the previous one (plus STEP_GAP_S).

`ideal_step_times` re-runs the same steps with every compute op at the mean over all workers of
its (step, optype): the reference the analysis's slowdown S is checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

P2P_S = 0.0008
TRANSFER_S = {
    "grads-reduce-scatter": 0.004, "params-all-gather": 0.003,
    "embedding-grads-all-reduce": 0.0015, "layernorm-grads-all-reduce": 0.0004,
}  # fmt: skip
BASE_S = {"forward-compute": 0.010, "backward-compute": 0.020, "optimizer": 0.004,
          "optimizer-clip-main-grad": 0.001}  # fmt: skip
STEP_GAP_S = 0.002
END_OF_STEP = ("layernorm-grads-all-reduce", "grads-reduce-scatter", "optimizer-clip-main-grad",
               "optimizer", "params-all-gather")  # fmt: skip


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
    """(step, worker) -> seconds of a GC pause at the start of that step."""
    seed: int = 0

    def worker(self, dp_rank: int, stage: int) -> int:
        return stage * self.dp + dp_rank


def _program(job: Job, stage: int, dp_rank: int) -> list[tuple[str, int]]:
    """One step's ops of a worker in issue order: (optype, micro-batch or -1)."""
    m, last = job.micro_batches, job.pp - 1
    warmup = min(job.pp - stage - 1, m)

    def forward(mb):
        return (
            ([("forward-recv", mb)] if stage > 0 else [])
            + [("forward-compute", mb)]
            + ([("forward-send", mb)] if stage < last else [])
        )

    def backward(mb):
        return (
            ([("backward-recv", mb)] if stage < last else [])
            + [("backward-compute", mb)]
            + ([("backward-send", mb)] if stage > 0 else [])
        )

    ops = [op for mb in range(warmup) for op in forward(mb)]
    for i in range(m - warmup):
        ops += forward(warmup + i) + backward(i)
    ops += [op for mb in range(m - warmup, m) for op in backward(mb)]
    if job.pp > 1 and stage in (0, last):
        ops.append(("embedding-grads-all-reduce", -1))
    ops += [(name, -1) for name in END_OF_STEP]
    return ops


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


def simulate_step(job: Job, step: int, t0: float, duration) -> list[dict]:
    """One step of every worker from time t0: the per-op rows (module docstring)."""
    workers = [(d, s) for s in range(job.pp) for d in range(job.dp)]
    programs = {w: _program(job, w[1], w[0]) for w in workers}
    clock = {w: t0 + job.gc.get((step, job.worker(*w)), 0.0) for w in workers}
    position = dict.fromkeys(workers, 0)
    sent, arrivals, rows = {}, {}, []

    def record(w, optype, mb, start, end):
        d, s = w
        rows.append({"dp_rank": d, "stage": s, "rank": job.worker(d, s), "step": step,
                     "optype": optype, "start_ts": start, "duration": end - start,
                     "mb_id": mb if mb >= 0 else None})  # fmt: skip

    for w in workers:  # the GC pause itself
        pause = job.gc.get((step, job.worker(*w)), 0.0)
        if pause:
            record(w, "gc", -1, t0, t0 + pause)
    progress = True
    while progress:
        progress = False
        for w in workers:
            d, s = w
            while position[w] < len(programs[w]):
                optype, mb = programs[w][position[w]]
                t = clock[w]
                if optype.endswith("-compute") or optype.startswith("optimizer"):
                    end = t + duration(step, s, d, optype, mb)
                elif optype.endswith("-send"):
                    to = s + 1 if optype == "forward-send" else s - 1
                    sent[(optype.split("-")[0], d, min(s, to), mb)] = t
                    end = t + P2P_S
                elif optype.endswith("-recv"):
                    frm = s - 1 if optype == "forward-recv" else s + 1
                    key = (optype.split("-")[0], d, min(s, frm), mb)
                    if key not in sent:
                        break
                    end = max(t, sent[key]) + P2P_S
                else:
                    members = _members(job, optype, d, s)
                    group = arrivals.setdefault((optype, members), {})
                    group.setdefault(w, t)
                    if len(group) < len(members):
                        break
                    end = max(group.values()) + TRANSFER_S[optype]
                    for other, start in group.items():  # the others wait there
                        if other != w:
                            record(other, optype, -1, start, end)
                            clock[other], position[other] = end, position[other] + 1
                    record(w, optype, mb, group[w], end)
                    clock[w], position[w] = end, position[w] + 1
                    progress = True
                    continue
                record(w, optype, mb, t, end)
                clock[w], position[w] = end, position[w] + 1
                progress = True
    stuck = [w for w in workers if position[w] < len(programs[w])]
    assert not stuck, f"simulated schedule deadlocked on {stuck}"
    return rows


def _members(job: Job, optype: str, dp_rank: int, stage: int) -> tuple:
    if optype in ("grads-reduce-scatter", "params-all-gather"):
        return tuple((d, stage) for d in range(job.dp))
    if optype == "embedding-grads-all-reduce":
        return ((dp_rank, 0), (dp_rank, job.pp - 1))
    return ((dp_rank, stage),)  # layernorm: tp folded into the worker


def simulate(job: Job, duration=None) -> pd.DataFrame:
    """Every step of `job` as per-op rows (all columns of the per-op schema)."""
    duration = duration or compute_durations(job)
    rows, t0 = [], 1000.0
    for step in range(job.steps):
        step_rows = simulate_step(job, step, t0, duration)
        rows += step_rows
        t0 = max(r["start_ts"] + r["duration"] for r in step_rows) + STEP_GAP_S
    frame = pd.DataFrame(rows)
    frame = frame.sort_values(["rank", "start_ts"], kind="stable").reset_index(drop=True)
    frame["seq_id"] = frame.groupby("rank").cumcount()
    frame["mc"] = frame["mb_id"].fillna(-1).astype(int)
    frame["gmc"] = frame["step"] * job.micro_batches + frame["mc"].clip(lower=0)
    frame["mb_id"] = frame["mb_id"].astype("Int64")
    return frame


def step_times(trace: pd.DataFrame) -> pd.Series:
    """Per step: last end - first start over all workers."""
    ends = trace["start_ts"] + trace["duration"]
    return ends.groupby(trace["step"]).max() - trace["start_ts"].groupby(trace["step"]).min()


def ideal_step_times(job: Job, trace: pd.DataFrame) -> pd.Series:
    """The same steps replayed with every compute op at the mean over all workers of its
    (step, optype), communication at its transfer time; GC pauses gone."""
    compute = trace[trace["optype"].isin(list(BASE_S))]
    means = compute.groupby(["step", "optype"])["duration"].mean().to_dict()

    def ideal(step, stage, dp_rank, optype, mb):
        return means[(step, optype)]

    clean = Job(**{**job.__dict__, "gc": {}})
    return step_times(simulate(clean, ideal))


def write_trace(trace: pd.DataFrame, path: Path, steps: list[int] | None = None) -> Path:
    """The per-op Parquet file of `trace` (only `steps` when given: a sample)."""
    if steps is not None:
        trace = trace[trace["step"].isin(steps)]
    trace.to_parquet(path, index=False)
    return path
