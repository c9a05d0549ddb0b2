"""An imported trace (importers/ops.py tables) as a ranktrace run: telemetry segments and a
run.json under `<runs-dir>/<run_id>/`, then ingested into the store like any trained run.

All or nothing: the run is written under a hidden staging name, moved into place, ingested and
reported; if any of that fails, the run's directory and its store rows are removed again.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from telemetry import names
from telemetry.schema import SCHEMAS

IMPORTED_DIR = "rank=imported"
"""All workers' segments in one folder: one file per kind keeps a 100k-op import fast."""


def new_import_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _step_windows(ops: pd.DataFrame) -> pd.DataFrame:
    """Per (worker, step): first start and last end, in ns."""
    ends = ops["start_ns"] + ops["duration_ns"]
    return (
        ops.assign(end_ns=ends)
        .groupby(["worker", "step"], sort=True)
        .agg(start_ns=("start_ns", "min"), end_ns=("end_ns", "max"))
        .reset_index()
    )


def _array(values, kind: pa.DataType) -> pa.Array:
    """`values` (a list, a NumPy array, or (array, null mask)) as an Arrow array of `kind`."""
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


def spans_table(run_id: str, ops: pd.DataFrame, windows: pd.DataFrame) -> pa.Table:
    """Step spans, phase spans (compute ops with a phase) and collective spans."""
    n_steps = len(windows)
    step_ids = np.arange(1, n_steps + 1, dtype=np.uint64)
    parent = windows.assign(span_id=step_ids).set_index(["worker", "step"])["span_id"]
    spans = ops[(ops["phase"] != "") | (ops["axis"] != "")]
    parents = parent.reindex(pd.MultiIndex.from_frame(spans[["worker", "step"]])).to_numpy()
    comm = (spans["axis"] != "").to_numpy()
    n_ops = len(spans)

    def on_comm(column: str) -> tuple:  # the collective columns: null on phase spans
        return spans[column].to_numpy(), ~comm

    op_columns = {
        "run_id": [run_id] * n_ops,
        "rank": spans["worker"].to_numpy(),
        "step": spans["step"].to_numpy(),
        "span_id": np.arange(n_steps + 1, n_steps + 1 + n_ops, dtype=np.uint64),
        "parent_span_id": parents.astype(np.uint64),
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
        "run_id": [run_id] * n_steps,
        "rank": windows["worker"].tolist(),
        "step": windows["step"].tolist(),
        "span_id": step_ids,
        "parent_span_id": np.zeros(n_steps, dtype=np.uint64),
        "name": [names.STEP_SPAN] * n_steps,
        "start_ns": windows["start_ns"].to_numpy(),
        "end_ns": windows["end_ns"].to_numpy(),
        "attempt": np.zeros(n_steps, dtype=np.int32),
    }
    return pa.concat_tables([_table("spans", step_columns), _table("spans", op_columns)])


def steps_table(run_id: str, ops: pd.DataFrame, windows, workers: pd.DataFrame) -> pa.Table:
    """One row per (worker, step): its window and the seconds of every phase."""
    comm = ops["axis"] != ""
    keyed = ops.assign(
        seconds=ops["duration_s"],
        phase_s=np.where(ops["phase"] == "", "host", ops["phase"]),
        comm_seconds=np.where(comm, ops["duration_s"], 0.0),
        is_comm=comm.astype(int),
    )
    per_phase = keyed.pivot_table(
        index=["worker", "step"], columns="phase_s", values="seconds", aggfunc="sum",
        fill_value=0.0,
    )  # fmt: skip
    totals = keyed.groupby(["worker", "step"]).agg(
        comm_s=("comm_seconds", "sum"), n_collectives=("is_comm", "sum")
    )
    rows = windows.set_index(["worker", "step"]).join(per_phase).join(totals).reset_index()
    rows = rows.merge(workers, on="worker", how="left")
    columns = {
        "run_id": [run_id] * len(rows),
        "rank": rows["worker"], "pp": rows["pp"], "dp": rows["dp"], "tp": rows["tp"],
        "host": rows["host"], "step": rows["step"], "start_ns": rows["start_ns"],
        "end_ns": rows["end_ns"], "step_time_s": (rows["end_ns"] - rows["start_ns"]) / 1e9,
        "comm_s": rows["comm_s"], "n_collectives": rows["n_collectives"],
        "traced": [True] * len(rows), "attempt": [0] * len(rows),
    }  # fmt: skip
    for phase in names.PHASES:
        columns[f"{phase}_s"] = rows[phase] if phase in rows else np.zeros(len(rows))
    return _table("steps", {k: list(v) if isinstance(v, pd.Series) else v
                            for k, v in columns.items()})  # fmt: skip


def ranks_table(run_id: str, workers: pd.DataFrame) -> pa.Table:
    n = len(workers)
    return _table("rank", {
        "run_id": [run_id] * n, "rank": workers["worker"].tolist(), "pp": workers["pp"].tolist(),
        "dp": workers["dp"].tolist(), "tp": workers["tp"].tolist(),
        "host": workers["host"].tolist(), "device": ["imported"] * n, "world_size": [n] * n,
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
    windows = _step_windows(ops)
    staging = runs_dir / f".import-{run_id}"
    folder = staging / names.TELEMETRY_DIR / IMPORTED_DIR
    folder.mkdir(parents=True)
    try:
        pq.write_table(spans_table(run_id, ops, windows), folder / names.segment_name("spans", 0))
        pq.write_table(steps_table(run_id, ops, windows, workers),
                       folder / names.segment_name("steps", 0))  # fmt: skip
        pq.write_table(ranks_table(run_id, workers), folder / names.segment_name("rank", 0))
        (staging / "run.json").write_text(json.dumps(record, indent=2) + "\n")
        final = runs_dir / run_id
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final
