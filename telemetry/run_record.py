"""The run directory and its `run.json`: the run's identity, layout, status and per-step results.

`run.json` is always replaced atomically (written to a temporary name, then renamed), so a reader
never sees half a file, even if the writer is killed.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

RUN_JSON = "run.json"
FINISHED_STATUSES = ("completed", "failed")
"""The statuses of a run that ended: its segments are final and ready to ingest."""


def new_run_id() -> str:
    """A sortable, collision-resistant id such as `20261202-131500-a3f9`."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def run_dir(runs_dir: str | os.PathLike, run_id: str) -> Path:
    return Path(runs_dir) / run_id


def write_run_json(directory: Path, record: dict) -> Path:
    """Atomically write `record` as `directory/run.json`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RUN_JSON
    tmp = directory / f".{RUN_JSON}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_run_json(directory: Path) -> dict:
    return json.loads((directory / RUN_JSON).read_text())


def update_run_json(directory: Path, **fields) -> dict:
    """run.json with `fields` set (an empty record where there is none yet), written back
    atomically; the record."""
    path = directory / RUN_JSON
    record = read_run_json(directory) if path.exists() else {}
    record.update(fields)
    write_run_json(directory, record)
    return record


def run_records(runs_dir: str | os.PathLike) -> dict[str, tuple[float, dict]]:
    """Run id (its folder) -> (its run.json's modification time, run.json) of every run under
    `runs_dir`, in id order; one being replaced this instant is left out (a later look sees
    it)."""
    records = {}
    for path in sorted(Path(runs_dir).glob(f"*/{RUN_JSON}")):
        try:
            records[path.parent.name] = (path.stat().st_mtime, json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


def runs_named(runs_dir: str | os.PathLike, run: str) -> list[dict]:
    """The run.json records under `runs_dir` whose run id or name is `run` (unreadable ones
    left out)."""
    return [record for _, record in run_records(runs_dir).values()
            if run in (record.get("run_id"), record.get("name"))]  # fmt: skip


def latest_run_id(runs_dir: str | os.PathLike, run: str) -> str | None:
    """The id of run `run` (an id, or a name: the latest run of that name), as every command
    takes it; None when there is none."""
    if (run_dir(runs_dir, run) / RUN_JSON).exists():
        return run
    named = [(r.get("started_at") or 0, r["run_id"]) for r in runs_named(runs_dir, run)]
    return max(named)[1] if named else None


def write_rank_info(directory: Path, rank: int, info: dict) -> Path:
    """Record which process is which rank (`ranks/RRRRR.json`: pid, host, coordinates, ...),
    so that an operator can find, profile or stop a given rank."""
    path = directory / "ranks" / f"{rank:05d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info) + "\n")
    os.replace(tmp, path)
    return path


def read_rank_info(directory: Path) -> dict[int, dict]:
    """Every rank's info from `ranks/`, by global rank."""
    infos = (json.loads(p.read_text()) for p in sorted((directory / "ranks").glob("*.json")))
    return {info["rank"]: info for info in infos}


def resumed_record(previous: dict, fresh: dict, start_step: int) -> dict:
    """run.json of an attempt that continues `previous` from `start_step`: the earlier steps'
    results kept (later ones will be redone), the start time kept, the restart listed."""
    record = {**fresh, "started_at": previous.get("started_at", fresh["started_at"])}
    for key in ("losses", "grad_norms", "step_times_s"):
        record[key] = previous.get(key, [])[:start_step]
    restart = {"attempt": fresh["attempt"], "resumed_from_step": start_step, "at": time.time()}
    record["restarts"] = [*previous.get("restarts", []), restart]
    return record
