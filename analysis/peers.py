"""A run's rank-steps and the robust reference of each rank's peers (the ranks of its pipeline
stage at the same step), the common ground of the straggler and imbalance analyzers.
"""

from __future__ import annotations

import duckdb
import numpy as np
import pandas as pd

WARMUP_STEPS = 1
"""The first step (allocation, first-touch) is left out of every comparison."""
KIND_COLUMNS = {"compute": "cpu_work_s", "data": "data_s", "host": "host_all_s",
                "communication": "transfer_s"}  # fmt: skip
"""Straggler kind -> the column (see `load_breakdown`) holding that part of a rank's time."""


BREAKDOWN_COLUMNS = (
    "rank", "pp", "dp", "tp", "host", "step", "step_time_s", "own_s", "work_s", "data_s", "host_s",
    "comm_transfer_s", "pipeline_wait_s", "optimizer_s", "mfu", "tokens", "tp_transfer_s",
    "dp_transfer_s", "world_transfer_s", "tp_blocking_s", "dp_blocking_s", "world_blocking_s",
    "work_cpu_s", "work_core_wait_s",
)  # fmt: skip
"""The columns of step_breakdown the analyzers read."""


def load_breakdown(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """The run's rank-steps with own/work/data/host/transfer times (warm-up steps left out) and
    whether each rank ran on a CPU device (`cpu_device`)."""
    frame = con.execute(
        f"SELECT {', '.join(f'b.{c}' for c in BREAKDOWN_COLUMNS)}, "
        "coalesce(r.device LIKE 'cpu%', false) AS cpu_device "
        "FROM step_breakdown b LEFT JOIN ranks r USING (run_id, rank) "
        "WHERE b.run_id = ? AND b.step >= ? ORDER BY b.step, b.rank",
        [run_id, WARMUP_STEPS],
    ).df()
    frame["transfer_s"] = frame["comm_transfer_s"].fillna(0.0)
    return frame


def split_compute(frame: pd.DataFrame) -> pd.DataFrame:
    """Add the split of compute wall time on CPU devices into `core_wait_s` (the main thread's
    wait for a core, as the kernel counts it; where it was not recorded, wall minus CPU time) and
    `cpu_work_s` (the rest: computing, or blocked on something other than a core, e.g. I/O or a
    sleep), and `host_all_s`: the host's time, outside every phase plus waiting for a core.
    Elsewhere (GPU, imported traces, rank-steps without CPU times) all compute is
    `cpu_work_s`."""
    nan = pd.Series(np.nan, frame.index)
    cpu_work, counted = frame.get("work_cpu_s", nan), frame.get("work_core_wait_s", nan)
    measured = (cpu_work.notna() | counted.notna()) & frame.get("cpu_device", False)
    work = frame["work_s"].clip(lower=0.0)
    waited = counted.fillna(work - cpu_work).clip(lower=0.0)
    # never the time its CPU time shows it computing (a wait read from another thread lands
    # after its start: the dashboard's 3x straggler read 89 ms of wait beside 70 ms of CPU in
    # 84 ms of compute, and no compute at all)
    core_wait = np.minimum(waited, work - np.minimum(work, cpu_work.fillna(0.0)))
    core_wait = core_wait.where(measured, 0.0)
    return frame.assign(core_wait_s=core_wait, cpu_work_s=frame["work_s"] - core_wait,
                        host_all_s=frame["host_s"] + core_wait)  # fmt: skip


LARGE_GROUP = 8
"""Peer groups larger than this use the whole group's median (one member barely moves it)."""


def peer_references(values: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per element, (reference, scale) among the elements of its group: the median of the
    *other* members and 1.4826 × their median absolute deviation (a robust standard deviation);
    NaN for a member with no peers. Vectorised over groups of equal size."""
    order = np.argsort(groups, kind="stable")
    sorted_groups = groups[order]
    starts = np.flatnonzero(np.r_[True, sorted_groups[1:] != sorted_groups[:-1]])
    sizes = np.diff(np.r_[starts, len(values)])
    sorted_values = values[order]
    reference = np.full(len(values), np.nan)
    scale = np.full(len(values), np.nan)
    for size in np.unique(sizes):
        if size == 1:
            continue
        index = starts[sizes == size][:, None] + np.arange(size)  # [G, size]
        block = sorted_values[index]  # [G, size]
        if size > LARGE_GROUP:
            median = np.median(block, axis=1, keepdims=True)  # [G, 1]
            mad = 1.4826 * np.median(np.abs(block - median), axis=1, keepdims=True)
            median, mad = np.broadcast_to(median, block.shape), np.broadcast_to(mad, block.shape)
        else:
            others_mask = ~np.eye(size, dtype=bool)  # row i: every member but i
            others = np.broadcast_to(block[:, None, :], (len(block), size, size))
            others = others[:, others_mask].reshape(len(block), size, size - 1)
            median = np.median(others, axis=2)  # [G, size]
            mad = 1.4826 * np.median(np.abs(others - median[..., None]), axis=2)
        reference[order[index]] = median
        scale[order[index]] = mad
    return reference, scale


def with_references(frame: pd.DataFrame) -> pd.DataFrame:
    """Add the compute split (`split_compute`), <column>_ref (peers' reference) for own time,
    every kind's column and the CPU time of the phases (where recorded), and own_scale;
    peers: the ranks of the same pipeline stage at the same step."""
    frame = split_compute(frame)
    groups = frame.groupby(["step", "pp"], sort=False).ngroup().to_numpy()
    cpu_time = ("work_cpu_s",) if "work_cpu_s" in frame else ()  # recorded CPU jobs only
    for column in ("own_s", "host_s", "core_wait_s", *KIND_COLUMNS.values(), *cpu_time):
        reference, scale = peer_references(frame[column].to_numpy(dtype=float), groups)
        frame[f"{column}_ref"] = reference
        if column == "own_s":
            frame["own_scale"] = scale
    return frame


def job_step_times(frame: pd.DataFrame) -> pd.Series:
    """Per step, the job's step time: the slowest rank's (every rank waits for it)."""
    return frame.groupby("step")["step_time_s"].max()
