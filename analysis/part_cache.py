"""A live run's diagnosed analysis windows, kept beside its stored windows so that each window
the run adds costs the diagnosis of its last, still-growing analysis window only, not of every
one before it (`ranktrace watch` and the dashboard's live pages recompute the report as each
window lands):

    runs/ranktrace.windows/run_id=<run>/parts/<key>.pickle

A closed analysis window (analysis/windows.py `analysis_spans(live=True)`) does not change while
the run grows; its Part is kept under a key over everything its diagnosis reads (the analysis
code, its windows' generations, the columns, the run's rank rows and the run.json keys it
reads, its replay budget), so a resumed run's rewritten windows or newer code are diagnosed
afresh. The files are the store's own, like its windows: read back only from there. Keeping them
is best effort: a folder that cannot be written (a read-only store) or a file that cannot be
read back costs a diagnosis, never a report. A run's report after it ended removes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ranktrace.analysis.run_part import Part

if TYPE_CHECKING:
    from ranktrace.analysis.window_report import SpanTask

FOLDER = "parts"


def parts_dir(run_windows: Path) -> Path:
    """The kept Parts of the run whose windows are under `run_windows`."""
    return run_windows / FOLDER


def task_key(task: SpanTask) -> str:
    """A digest of everything the diagnosis of `task` reads but its files' contents (which
    their windows' generations name)."""
    from ranktrace.analysis.run import analysis_version  # run.py imports the window report

    span = task.span
    described = {
        "code": analysis_version(),
        "span": [span.first_step, span.end_step, span.steps, span.by_name, span.windows],
        "shapes": task.shapes,
        "run": task.run,
        "max_calls": task.max_calls,
        # row order as the catalog returned it is not part of what was diagnosed
        "rows": {table: sorted(json.dumps(row, default=str, sort_keys=True)
                               for row in rows.to_pylist())
                 for table, rows in task.rows.items()},
    }  # fmt: skip
    text = json.dumps(described, default=str, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def diagnosed(tasks: list[SpanTask], folder: Path,
              diagnose: Callable[[list[SpanTask]], list[Part]]) -> list[Part]:  # fmt: skip
    """The Part of each task: a closed analysis window's as kept in `folder` when there,
    else `diagnose(the others)` (in one call: they may run in parallel), the closed ones kept.
    Parts kept for windows no longer among `tasks` (superseded) are removed."""
    keys = [task_key(task) if task.span.closed else None for task in tasks]
    parts = [_load(folder / f"{key}.pickle") if key else None for key in keys]
    todo = [index for index, part in enumerate(parts) if part is None]
    for index, part in zip(todo, diagnose([tasks[i] for i in todo]), strict=True):
        parts[index] = part
        if keys[index]:
            _keep(folder, keys[index], part)
    _remove_others(folder, {f"{key}.pickle" for key in keys if key})
    return parts


def forget(folder: Path) -> None:
    """Remove a run's kept Parts (it ended: its report is computed once more, and stored)."""
    shutil.rmtree(folder, ignore_errors=True)


def _load(path: Path) -> Part | None:
    try:
        with path.open("rb") as handle:
            part = pickle.load(handle)
    except Exception:  # absent, cut short, or from another pandas: diagnosed afresh
        return None
    return part if isinstance(part, Part) else None


def _keep(folder: Path, key: str, part: Part) -> None:
    """Written whole under a name of its own, then renamed: a concurrent reader (another
    process computing the same report) reads the old file or the new one."""
    temporary = folder / f".{key}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with temporary.open("wb") as handle:
            pickle.dump(part, handle, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(temporary, folder / f"{key}.pickle")
    except OSError:  # a read-only store, a full disk: the next report diagnoses it again
        temporary.unlink(missing_ok=True)


def _remove_others(folder: Path, kept: set[str]) -> None:
    try:
        stale = [p for p in folder.glob("*.pickle") if p.name not in kept]
    except OSError:
        return
    for path in stale:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            return
