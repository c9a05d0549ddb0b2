"""The form every importer produces: one table of operations and one of workers, checked here.

A worker is one process of the imported job as the store sees it (a "rank" there). Operations:

- worker (int): the worker that ran it, 0..W-1;
- step (int): training step (need not be contiguous: a sample of steps is fine);
- optype (str): what it was (the per-op names, or names from the torch profiler);
- phase (str): its telemetry phase: forward, backward, pipeline_wait, grad_sync, optimizer,
  data; "" for host time outside every phase (a GC pause);
- mb (int): micro-batch, -1 when none;
- start_s, duration_s (float): seconds, one clock for all workers; durations ≥ 0;
- op (str): communication: the operation (all_reduce, all_gather, reduce_scatter, send, recv,
  ...); "" for compute;
- axis (str): communication: pp, dp, tp or world; "" for compute;
- group_id (int): communication: the lowest worker of its group; -1 for compute;
- group_size (int): communication: workers in its group (2 for point-to-point); 0 for compute;
- peer (int): point-to-point: the worker at the other end; -1 otherwise;
- seq (int): communication: equal on every member of one instance (both ends of a transfer)
  and distinct between the instances of one (axis, group, pair);
- bytes (int): communication: payload bytes, 0 when unknown.

Workers: worker, pp, dp, tp (mesh coordinates), host.
"""

from __future__ import annotations

import pandas as pd

OP_COLUMNS = {
    "worker": "int32", "step": "int64", "optype": "object", "phase": "object", "mb": "int32",
    "start_s": "float64", "duration_s": "float64", "op": "object", "axis": "object",
    "group_id": "int32", "group_size": "int32", "peer": "int32", "seq": "int64", "bytes": "int64",
}  # fmt: skip
WORKER_COLUMNS = {"worker": "int32", "pp": "int32", "dp": "int32", "tp": "int32", "host": "object"}
PHASES_OF_OPS = ("forward", "backward", "pipeline_wait", "grad_sync", "optimizer", "data", "")
AXES = ("pp", "dp", "tp", "world")


class TraceError(ValueError):
    """The trace cannot be imported; the message names the problem and the fix (one line)."""


def check_tables(ops: pd.DataFrame, workers: pd.DataFrame) -> None:
    """Raise TraceError when `ops`/`workers` break the contract in the module docstring."""
    for name, table, columns in (("ops", ops, OP_COLUMNS), ("workers", workers, WORKER_COLUMNS)):
        missing = [c for c in columns if c not in table.columns]
        if missing:
            raise TraceError(f"{name} lack columns {missing}")
    if ops.empty:
        raise TraceError("the trace holds no operations")
    unknown = set(ops["worker"].unique()) - set(workers["worker"])
    if unknown:
        raise TraceError(f"operations on unknown workers {sorted(unknown)[:5]}")
    idle = sorted(set(workers["worker"]) - set(ops["worker"].unique()))
    if idle:
        raise TraceError(f"workers {idle[:5]} have no operations: a partial trace")
    bad_phase = set(ops["phase"].unique()) - set(PHASES_OF_OPS)
    if bad_phase:
        raise TraceError(f"unknown phases {sorted(bad_phase)}")
    comm = ops["axis"] != ""
    bad_axis = set(ops.loc[comm, "axis"].unique()) - set(AXES)
    if bad_axis:
        raise TraceError(f"unknown axes {sorted(bad_axis)}")
    if (ops["duration_s"] < 0).any():
        raise TraceError("negative durations")


def typed(table: pd.DataFrame, columns: dict[str, str]) -> pd.DataFrame:
    """`table` reduced to `columns`, in that order, cast to their types."""
    return table[list(columns)].astype(columns)
