"""An imported trace (importers/ops.py tables) as a ranktrace run: telemetry segments and a
run.json under `<runs-dir>/<run_id>/`, then ingested into the store like any trained run.

All or nothing: the run is written under a hidden staging name, moved into place, ingested and
reported; if any of that fails, the run's directory and its store rows are removed again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ranktrace.telemetry import names
from ranktrace.telemetry.schema import SCHEMAS

IMPORTED_DIR = "rank=imported"
"""All workers' segments in one folder: one file per kind keeps a 100k-op import fast."""


def _step_windows(ops: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """Per (worker, step), sorted: first start and last end, in ns; and (ops,) each op's row in
    that table."""
    grouped = ops.assign(end_ns=ops["start_ns"] + ops["duration_ns"]).groupby(
        ["worker", "step"], sort=True
    )
    windows = grouped.agg(start_ns=("start_ns", "min"), end_ns=("end_ns", "max")).reset_index()
    return windows, grouped.ngroup().to_numpy()


def _array(values, kind: pa.DataType) -> pa.Array:
    """`values` (a list, a NumPy or Arrow array, or (array, null mask)) as an Arrow array of
    `kind`."""
    if isinstance(values, pa.Array):
        return values.cast(kind)
    if isinstance(values, tuple):
        data, nulls = values
        return pa.array(data, type=kind, mask=nulls)
    return pa.array(values, type=kind)


def _table(kind: str, columns: dict) -> pa.Table:
    """A table of segment `kind` from `columns` (absent columns are nulls)."""
    schema = SCHEMAS[kind]
    n = len(next(iter(columns.values())))
    arrays = [
        _array(columns[field.name], field.type) if field.name in columns
        else pa.nulls(n, type=field.type)
        for field in schema
    ]  # fmt: skip
    return pa.Table.from_arrays(arrays, schema=schema)


def spans_table(run_id: str, ops: pd.DataFrame, windows: pd.DataFrame, block, comm) -> pa.Table:
    """Step spans, phase spans (compute ops with a phase) and collective spans. `block`: each
    op's row in `windows`; `comm`: which ops are collectives."""
    n_steps = len(windows)
    step_ids = np.arange(1, n_steps + 1, dtype=np.uint64)
    kept = (ops["phase"].to_numpy() != "") | comm
    spans = ops[kept]
    comm = comm[kept]
    n_ops = len(spans)

    def on_comm(column: str) -> tuple:  # the collective columns: null on phase spans
        return spans[column].to_numpy(), ~comm

    op_columns = {
        "run_id": pa.repeat(run_id, n_ops),
        "rank": spans["worker"].to_numpy(),
        "step": spans["step"].to_numpy(),
        "span_id": np.arange(n_steps + 1, n_steps + 1 + n_ops, dtype=np.uint64),
        "parent_span_id": step_ids[block[kept]],
        "name": np.where(comm, names.COLLECTIVE_SPAN, names.PHASE_SPAN),
        "phase": (spans["phase"].to_numpy(dtype=object), comm),
        "micro_batch": (spans["mb"].to_numpy(), spans["mb"].to_numpy() < 0),
        "op": on_comm("op"),
        "axis": on_comm("axis"),
        "group_id": on_comm("group_id"),
        "group_size": on_comm("group_size"),
        "seq": on_comm("seq"),
        "peer": on_comm("peer"),
        "bytes": on_comm("bytes"),
        "start_ns": spans["start_ns"].to_numpy(),
        "end_ns": (spans["start_ns"] + spans["duration_ns"]).to_numpy(),
        "attempt": np.zeros(n_ops, dtype=np.int32),
    }
    step_columns = {
        "run_id": pa.repeat(run_id, n_steps),
        "rank": windows["worker"].to_numpy(),
        "step": windows["step"].to_numpy(),
        "span_id": step_ids,
        "parent_span_id": np.zeros(n_steps, dtype=np.uint64),
        "name": pa.repeat(names.STEP_SPAN, n_steps),
        "start_ns": windows["start_ns"].to_numpy(),
        "end_ns": windows["end_ns"].to_numpy(),
        "attempt": np.zeros(n_steps, dtype=np.int32),
    }
    return pa.concat_tables([_table("spans", step_columns), _table("spans", op_columns)])


def steps_table(run_id: str, ops: pd.DataFrame, windows, workers, block, comm) -> pa.Table:
    """One row per (worker, step) of `windows`: its window and the seconds of every phase."""
    n = len(windows)
    seconds = ops["duration_s"].to_numpy()
    phase = ops["phase"].to_numpy()
    placed = workers.set_index("worker").reindex(windows["worker"])
    columns = {
        "run_id": pa.repeat(run_id, n),
        "rank": windows["worker"].to_numpy(), "pp": placed["pp"].to_numpy(),
        "dp": placed["dp"].to_numpy(), "tp": placed["tp"].to_numpy(),
        "host": placed["host"].to_numpy(dtype=object), "step": windows["step"].to_numpy(),
        "start_ns": windows["start_ns"].to_numpy(), "end_ns": windows["end_ns"].to_numpy(),
        "step_time_s": (windows["end_ns"] - windows["start_ns"]).to_numpy() / 1e9,
        "comm_s": np.bincount(block, weights=np.where(comm, seconds, 0.0), minlength=n),
        "n_collectives": np.bincount(block[comm], minlength=n),
        "traced": np.ones(n, dtype=bool), "attempt": np.zeros(n, dtype=np.int32),
    }  # fmt: skip
    for name in names.PHASES:
        mine = phase == name
        columns[f"{name}_s"] = np.bincount(block[mine], weights=seconds[mine], minlength=n)
    return _table("steps", columns)


def ranks_table(run_id: str, workers: pd.DataFrame, world_size: int) -> pa.Table:
    """One row per worker; `world_size`: the workers of the job, with any the trace lost."""
    n = len(workers)
    return _table("rank", {
        "run_id": [run_id] * n, "rank": workers["worker"].tolist(), "pp": workers["pp"].tolist(),
        "dp": workers["dp"].tolist(), "tp": workers["tp"].tolist(),
        "host": workers["host"].tolist(), "device": ["imported"] * n,
        "world_size": [world_size] * n,
        "level": [names.LEVEL_COLLECTIVES] * n, "trace_every": [1] * n,
        "clock_offset_ns": [0] * n, "attempt": [0] * n,
    })  # fmt: skip


def run_record(run_id: str, name: str, ops: pd.DataFrame, workers, layout, source) -> dict:
    """run.json of an imported run: its layout, steps and where it came from (`imported`)."""
    steps = sorted(int(s) for s in ops["step"].unique())
    started = float(ops["start_s"].min())
    finished = float((ops["start_s"] + ops["duration_s"]).max())
    return {
        "run_id": run_id, "name": name, "status": "completed",
        "layout": {**layout, "zero": layout.get("zero", 0)}, "world_size": len(workers),
        "model": None, "precision": None, "steps": len(steps), "losses": [],
        "micro_batches": int(ops["mb"].max()) + 1 if (ops["mb"] >= 0).any() else 1,
        "schedule": "1f1b", "started_at": started, "finished_at": finished,
        "imported": {**source, "ops": len(ops), "workers": len(workers),
                     "first_step": steps[0], "last_step": steps[-1]},
        "config": {},
    }  # fmt: skip


def write_run(runs_dir: Path, run_id: str, record: dict, ops, workers) -> Path:
    """Write the run's directory (staged, then moved into place); returns it."""
    ops = ops.assign(
        start_ns=np.round(ops["start_s"].to_numpy() * 1e9).astype(np.int64),
        duration_ns=np.round(ops["duration_s"].to_numpy() * 1e9).astype(np.int64),
    )
    windows, block = _step_windows(ops)
    comm = ops["axis"].to_numpy() != ""
    staging = runs_dir / f".import-{run_id}"
    folder = staging / names.TELEMETRY_DIR / IMPORTED_DIR
    folder.mkdir(parents=True)
    try:
        pq.write_table(spans_table(run_id, ops, windows, block, comm),
                       folder / names.segment_name("spans", 0))  # fmt: skip
        pq.write_table(steps_table(run_id, ops, windows, workers, block, comm),
                       folder / names.segment_name("steps", 0))  # fmt: skip
        pq.write_table(ranks_table(run_id, workers, record["world_size"]),
                       folder / names.segment_name("rank", 0))  # fmt: skip
        (staging / "run.json").write_text(json.dumps(record, indent=2) + "\n")
        final = runs_dir / run_id
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final
