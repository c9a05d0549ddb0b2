"""Which raw segments a run has, which steps each holds, and from them the windows to publish.

The step range of every segment comes from its name (telemetry/names.py `segment_name`) or, for
one written before names carried it, from its Parquet footer, read once; both are kept in the
catalog's `segments` table (a file that changes size or time is read again), so an ingest that
adds one window opens none of the segments of the others. A window's signature is that of the
segments holding its steps: it changes when a segment of it is added or rewritten (a resumed
attempt redoing its steps, a rank flushing its last steps), and only then is the window written
again.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pandas as pd

from ranktrace.analysis.store import StoreError
from ranktrace.telemetry import names

STEP_KINDS = ("steps", "spans")
"""The segment kinds windows are derived from (events and rank rows are the run's, not a
window's)."""
SEGMENTS_DDL = (
    "CREATE TABLE IF NOT EXISTS segments (run_id VARCHAR, path VARCHAR, kind VARCHAR, "
    "rank INTEGER, size BIGINT, mtime_ns BIGINT, min_step BIGINT, max_step BIGINT)"
)


def _on_disk(run_dir: Path) -> pd.DataFrame:
    """path (relative to run_dir), kind, rank, size, mtime_ns of every finished segment."""
    rows = []
    telemetry = run_dir / names.TELEMETRY_DIR
    if telemetry.is_dir():
        for rank_entry in os.scandir(telemetry):
            if not rank_entry.name.startswith("rank=") or not rank_entry.is_dir():
                continue
            label = rank_entry.name.split("=", 1)[1]
            rank = int(label) if label.isdigit() else -1  # rank=imported: every rank's rows
            for entry in os.scandir(rank_entry.path):
                name = entry.name
                if not name.endswith(".parquet") or name.startswith("."):
                    continue  # a temporary name: a segment being written
                stat = entry.stat()
                parsed = names.parse_segment_name(name)
                if parsed is None:
                    continue
                kind, _, steps = parsed
                first, last = steps if steps else (None, None)
                path = f"{names.TELEMETRY_DIR}/{rank_entry.name}/{name}"
                rows.append((path, kind, rank, stat.st_size, stat.st_mtime_ns, first, last))
    columns = ["path", "kind", "rank", "size", "mtime_ns", "named_min", "named_max"]
    return pd.DataFrame(rows, columns=columns)


def refresh(con: duckdb.DuckDBPyConnection, run_dir: Path, run_id: str) -> pd.DataFrame:
    """The run's segments with their step ranges (`segments` rows), after reading the footers
    of those new or changed since the last call and forgetting those gone."""
    con.execute(SEGMENTS_DDL)
    disk = _on_disk(run_dir)
    known = con.execute(
        "SELECT path, size, mtime_ns, min_step, max_step FROM segments WHERE run_id = ?", [run_id]
    ).df()
    merged = disk.merge(known, on=["path", "size", "mtime_ns"], how="left", indicator=True)
    seen = (merged.pop("_merge") == "both").to_numpy()
    for bound in ("min", "max"):
        named = merged.pop(f"named_{bound}").astype("float64")
        merged[f"{bound}_step"] = merged[f"{bound}_step"].astype("float64").fillna(named)
    # new segments named without their steps (written before names carried them): footers
    new = merged[~seen & merged["min_step"].isna() & merged["kind"].isin(STEP_KINDS)]
    if not new.empty:
        ranges = _step_ranges(con, run_dir, new["path"].tolist())
        merged = merged.set_index("path")
        merged.loc[ranges.index, ["min_step", "max_step"]] = ranges[["min_step", "max_step"]]
        merged = merged.reset_index()
    merged.insert(0, "run_id", run_id)
    if seen.all() and len(known) == len(disk):
        return merged  # nothing added, changed or gone (a watch's every look at a quiet run)
    con.execute("BEGIN TRANSACTION")
    con.execute("DELETE FROM segments WHERE run_id = ?", [run_id])
    con.register("segments_now", merged)
    con.execute("INSERT INTO segments BY NAME SELECT * FROM segments_now")
    con.unregister("segments_now")
    con.execute("COMMIT")
    return merged


def _step_ranges(con: duckdb.DuckDBPyConnection, run_dir: Path, paths: list[str]) -> pd.DataFrame:
    """min_step, max_step of each file (by path), from the `step` column's footer statistics."""
    listed = ", ".join(f"'{run_dir / path}'" for path in paths)
    try:
        frame = con.execute(
            f"SELECT file_name, min(TRY_CAST(stats_min_value AS BIGINT)) AS min_step, "
            f"max(TRY_CAST(stats_max_value AS BIGINT)) AS max_step "
            f"FROM parquet_metadata([{listed}]) WHERE path_in_schema = 'step' GROUP BY file_name"
        ).df()
    except (duckdb.InvalidInputException, duckdb.IOException) as error:
        raise unreadable_segment(run_dir, error) from None
    prefix = len(str(run_dir)) + 1
    frame["path"] = frame["file_name"].str.slice(prefix)
    return frame.set_index("path")[["min_step", "max_step"]]


def unreadable_segment(run_dir: Path, error: Exception) -> StoreError:
    """The error to give for a segment DuckDB could not read. Ranks write segments whole
    (temporary name, then rename): such a one was damaged since."""
    return StoreError(
        f"a segment of run {run_dir.name} is not a readable Parquet file "
        f"({str(error).splitlines()[0]}); move it out of {run_dir} and ingest again"
    )


def files_of(segments: pd.DataFrame, kind: str) -> list[str]:
    """The paths (relative to the run folder) of every segment of one kind."""
    return segments.loc[segments["kind"] == kind, "path"].tolist()


def signature(segments: pd.DataFrame) -> str:
    """Changes whenever a segment is added, removed or rewritten."""
    rows = segments.sort_values("path")[["path", "size", "mtime_ns"]].itertuples(index=False)
    return hashlib.sha1(repr(list(rows)).encode()).hexdigest()


@dataclass
class WindowPlan:
    """One window of a run as its segments are now."""

    window: int
    first_step: int
    end_step: int
    """Steps [first_step, end_step)."""
    complete: bool
    """Every rank has recorded the window's last step, or the run has ended."""
    files: dict[str, list[str]] = field(default_factory=dict)
    """{kind: paths} of the segments holding its steps."""
    signature: str = ""


def plan_windows(segments: pd.DataFrame, window_steps: int, ended: bool) -> list[WindowPlan]:
    """Every window some segment holds steps of, in order. A segment without step statistics
    (no rows) holds none."""
    stepped = segments[segments["kind"].isin(STEP_KINDS) & segments["min_step"].notna()]
    if stepped.empty:
        return []
    ranks = segments.loc[segments["kind"] == "rank", "rank"].unique()
    recorded = stepped[stepped["kind"] == "steps"].groupby("rank")["max_step"].max()
    # the last step every rank has recorded (-1 while one of them has recorded none)
    reached = -1 if len(ranks) == 0 or recorded.reindex(ranks).isna().any() else int(recorded.min())
    first = (stepped["min_step"] // window_steps).astype(int).to_numpy()
    last = (stepped["max_step"] // window_steps).astype(int).to_numpy()
    plans: dict[int, WindowPlan] = {}
    for (path, kind), lo, hi in zip(stepped[["path", "kind"]].itertuples(index=False), first,
                                    last, strict=True):  # fmt: skip
        for window in range(lo, hi + 1):
            if window not in plans:
                start, end = window * window_steps, (window + 1) * window_steps
                complete = bool(ended or reached >= end - 1)
                plans[window] = WindowPlan(window, start, end, complete)
            plans[window].files.setdefault(kind, []).append(path)
    by_path = stepped.set_index("path")
    for plan in plans.values():
        held = sorted(p for paths in plan.files.values() for p in paths)
        plan.signature = signature(by_path.loc[held].reset_index())
    return [plans[w] for w in sorted(plans)]
