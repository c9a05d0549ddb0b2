"""A live run's diagnosed analysis windows, kept beside its stored windows so that each window
the run adds costs the diagnosis of its last, still-growing analysis window only, not of every
one before it (`ranktrace watch` and the dashboard's live pages recompute the report as each
window lands):

    runs/ranktrace.windows/run_id=<run>/parts/<key>.parquet

A closed analysis window (analysis/windows.py `analysis_spans(live=True)`) does not change while
the run grows; its Part is kept under a key over everything its diagnosis reads (the analysis
code, its windows' generations and segment signatures, the columns, the run's rank rows and the
run.json keys it reads, its replay budget), so a resumed run's rewritten windows or newer code
are diagnosed afresh. A Part is kept as data, never as code to run: its per-step frame as
Parquet, the rest as JSON in the file's metadata (the runs directory may be shared: reading it
must not run what someone else wrote there). Keeping is best effort: a folder that cannot be
written (a read-only store) or a file that cannot be read back costs a diagnosis, never a
report. A run's first report once it ended removes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ranktrace.analysis.imbalances import Imbalance
from ranktrace.analysis.run_part import Part
from ranktrace.analysis.stragglers import Straggler

if TYPE_CHECKING:
    from ranktrace.analysis.window_report import SpanTask

FOLDER = "parts"
SUFFIX = ".parquet"
META_KEY = b"ranktrace.part"


def parts_dir(run_windows: Path) -> Path:
    """The kept Parts of the run whose windows are under `run_windows`."""
    return run_windows / FOLDER


def task_keys(tasks: list[SpanTask]) -> list[str | None]:
    """Per task, a digest of everything its diagnosis reads but its files' contents (which
    their windows' generations and signatures name); None for an open analysis window. The
    analysis code's digest and the run's rows, the same for every task of a report (8,192
    rank rows at 8,192 ranks), are described once."""
    from ranktrace.analysis.run import analysis_version  # run.py imports the window report

    code = analysis_version()
    rows_of: dict[int, dict] = {}  # id(task.rows) -> their description (the tasks hold them)
    keys: list[str | None] = []
    for task in tasks:
        if not task.span.closed:
            keys.append(None)
            continue
        if id(task.rows) not in rows_of:  # row order as the catalog gave it is not diagnosed
            rows_of[id(task.rows)] = {
                table: sorted(json.dumps(row, default=str, sort_keys=True)
                              for row in rows.to_pylist())
                for table, rows in task.rows.items()
            }  # fmt: skip
        span = task.span
        described = {
            "code": code,
            "span": [span.first_step, span.end_step, span.steps, span.by_name, span.windows],
            "shapes": task.shapes,
            "run": task.run,
            "max_calls": task.max_calls,
            "rows": rows_of[id(task.rows)],
        }
        text = json.dumps(described, default=str, sort_keys=True)
        keys.append(hashlib.sha256(text.encode()).hexdigest()[:32])
    return keys


def diagnosed(tasks: list[SpanTask], folder: Path,
              diagnose: Callable[[list[SpanTask]], list[Part]]) -> list[Part]:  # fmt: skip
    """The Part of each task: a closed analysis window's as kept in `folder` when there,
    else `diagnose(the others)` (in one call: they may run in parallel), the closed ones kept.
    Files kept for windows no longer among `tasks` (superseded) are removed."""
    keys = task_keys(tasks)
    parts = [_load(folder / f"{key}{SUFFIX}") if key else None for key in keys]
    todo = [index for index, part in enumerate(parts) if part is None]
    for index, part in zip(todo, diagnose([tasks[i] for i in todo]), strict=True):
        parts[index] = part
        if keys[index]:
            _keep(folder, keys[index], part)
    _remove_others(folder, {f"{key}{SUFFIX}" for key in keys if key})
    return parts


def forget(folder: Path) -> None:
    """Remove a run's kept Parts (it ended: its report is computed once more, and stored)."""
    shutil.rmtree(folder, ignore_errors=True)


def encoded(part: Part) -> pa.Table:
    """`part` as a table: its per-step frame, the rest as JSON in the schema's metadata."""
    job_step = part.job_step
    rest = {
        "stragglers": [finding.to_dict() for finding in part.stragglers],
        "imbalances": [imbalance.to_dict() for imbalance in part.imbalances],
        "notes": part.notes,
        "replayed": part.replayed,
        "job_step": {"name": job_step.name, "dtype": str(job_step.dtype),
                     "index": job_step.index.tolist(), "index_name": job_step.index.name,
                     "index_dtype": str(job_step.index.dtype), "values": job_step.tolist()},
    }  # fmt: skip
    _require_text_keys(rest)
    table = pa.Table.from_pandas(part.per_step, preserve_index=True)
    text = json.dumps(rest, default=_plain, allow_nan=True)
    return table.replace_schema_metadata({**(table.schema.metadata or {}), META_KEY: text})


def decoded(table: pa.Table) -> Part:
    """The Part `encoded` made `table` from."""
    rest = json.loads(table.schema.metadata[META_KEY])
    steps = rest["job_step"]
    index = pd.Index(steps["index"], name=steps["index_name"], dtype=steps["index_dtype"])
    job_step = pd.Series(steps["values"], index=index, name=steps["name"], dtype=steps["dtype"])
    return Part([Straggler(**finding) for finding in rest["stragglers"]],
                [Imbalance(**imbalance) for imbalance in rest["imbalances"]], rest["notes"],
                job_step, table.to_pandas(), rest["replayed"])  # fmt: skip


def _plain(value):
    """numpy scalars and arrays as Python's; anything else cannot be kept (TypeError)."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} in a Part is not kept")


def _require_text_keys(value) -> None:
    """JSON would turn a key 5 into "5", and the merge would then miss it: such a Part is not
    kept (TypeError)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"a {type(key).__name__} key in a Part is not kept")
            _require_text_keys(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _require_text_keys(item)


def _load(path: Path) -> Part | None:
    try:
        return decoded(pq.read_table(path))
    except Exception:  # absent, cut short, or written by other code: diagnosed afresh
        return None


def _keep(folder: Path, key: str, part: Part) -> None:
    """Written whole under a name of its own (this process and thread), then renamed: a
    concurrent reader (another process or dashboard thread computing the same report) reads the
    old file or the new one."""
    temporary = folder / f".{key}.{uuid.uuid4().hex}.tmp"
    try:
        folder.mkdir(exist_ok=True)  # not its parents: a run being removed stays removed
        pq.write_table(encoded(part), temporary)
        os.replace(temporary, folder / f"{key}{SUFFIX}")
    except Exception:  # a read-only store, a full disk, a value JSON cannot hold: not kept
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


def _remove_others(folder: Path, kept: set[str]) -> None:
    """Every file of `folder` but `kept` (a temporary file left by a process that died
    included; one being written now is then not kept, and diagnosed again next time)."""
    with contextlib.suppress(OSError):
        for path in folder.iterdir():
            if path.name not in kept:
                path.unlink(missing_ok=True)
