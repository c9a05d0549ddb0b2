"""Sharded checkpoints with torch.distributed.checkpoint (DCP), saved in the background.

    runs/<run>/checkpoints/step-00000010/   __<rank>_0.distcp ...  .metadata  COMPLETE.json

A checkpoint holds everything a step depends on: the compute-dtype parameters, the fp32 master
weights and Adam moments (each rank's ZeRO shard), the optimizer's step count, the CPU RNG
state, and `next_step` (the data order is a pure function of the step, trainer/data.py). Keys
name the mesh coordinates, so dp replicas of the same tensor are written once (DCP keeps one
copy of a key several ranks hold) and a checkpoint can only be loaded by the same layout.

Completeness: DCP's coordinator writes `.metadata` only after every rank's data is written;
rank 0 then writes `COMPLETE.json` (the step, the layout, every file with its size), last.
Resume only ever picks a checkpoint with that marker, so a crash during a save leaves the
previous checkpoint as the latest one. The save runs on its own gloo group: sharing the
training group mismatches gloo traffic (PITFALLS.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ranktrace.trainer.mesh import ParallelDims
from ranktrace.trainer.optim import ShardedAdamW
from ranktrace.trainer.parallel.data import DataParallelBuffers

CHECKPOINTS_DIR = "checkpoints"
COMPLETE_MARKER = "COMPLETE.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or from another layout; says what to do."""


def checkpoints_root(run_directory: Path) -> Path:
    return Path(run_directory) / CHECKPOINTS_DIR


def checkpoint_path(run_directory: Path, next_step: int) -> Path:
    """Where the checkpoint taken before step `next_step` lives."""
    return checkpoints_root(run_directory) / f"step-{next_step:08d}"


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def _saved_checkpoints(run_directory: Path) -> list[Path]:
    """Every checkpoint directory, complete or not, by step."""
    root = checkpoints_root(run_directory)
    found = [p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=_step_of)


def read_marker(path: Path) -> dict | None:
    """The completion marker of one checkpoint, None when it has none (never completed)."""
    try:
        return json.loads((path / COMPLETE_MARKER).read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"checkpoint {path} has an unreadable {COMPLETE_MARKER} ({error}); delete that "
            f"directory to resume from the checkpoint before it"
        ) from None


def complete_checkpoints(run_directory: Path) -> list[Path]:
    """Checkpoints whose save finished on every rank, oldest first."""
    return [p for p in _saved_checkpoints(run_directory) if (p / COMPLETE_MARKER).exists()]


def remove_incomplete(run_directory: Path) -> list[Path]:
    """Delete the saves that never completed (abandoned by a crash); returns their paths.

    Called by rank 0 when an attempt starts, before any rank can save: a redone step saves to
    the same path, and a rank creating it while another deletes it fails (FileExistsError,
    seen when rank 0 deleted it at the save itself)."""
    abandoned = [p for p in _saved_checkpoints(run_directory) if not (p / COMPLETE_MARKER).exists()]
    for path in abandoned:
        shutil.rmtree(path, ignore_errors=True)
    return abandoned


def verify_checkpoint(path: Path, layout: dict) -> dict:
    """The marker of a complete checkpoint `layout` (tp, pp, dp, zero) can load; CheckpointError
    naming the problem when it is incomplete, from another layout, or missing or changed files."""
    marker = read_marker(path)
    if marker is None:
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {COMPLETE_MARKER}: its save never finished)"
        )
    if marker.get("layout") != layout:
        raise CheckpointError(
            f"checkpoint {path} was saved by layout {marker.get('layout')}, not {layout}; "
            f"resume with the layout it was saved with"
        )
    for name, size in marker.get("files", {}).items():
        file = path / name
        if not file.exists():
            raise CheckpointError(
                f"checkpoint {path} is damaged: {name} is missing; delete the directory to "
                f"resume from the checkpoint before it"
            )
        if file.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {name} has {file.stat().st_size} bytes, "
                f"{size} were written; delete the directory to resume from the one before it"
            )
    try:
        FileSystemReader(str(path)).read_metadata()
    except Exception as error:
        raise CheckpointError(
            f"checkpoint {path} is damaged: its .metadata does not load ({type(error).__name__}); "
            f"delete the directory to resume from the one before it"
        ) from None
    return marker


def latest_checkpoint(run_directory: Path, layout: dict) -> tuple[Path, dict] | None:
    """The latest complete checkpoint and its marker, verified; None when the run has none.
    A damaged latest checkpoint raises: resuming from an older one silently would redo work
    the user believes saved."""
    complete = complete_checkpoints(run_directory)
    if not complete:
        return None
    return complete[-1], verify_checkpoint(complete[-1], layout)


def training_state(
    dims: ParallelDims, buffers: DataParallelBuffers, optimizer: ShardedAdamW
) -> dict[str, torch.Tensor]:
    """The live tensors a checkpoint holds, keyed by mesh coordinates (loaded in place)."""
    c = dims.coords
    shard = f"pp{c.pp}.tp{c.tp}"
    # Under ZeRO 0 every dp replica holds the same optimizer state: one key, written once.
    owner = f"{shard}.dp{c.dp}" if buffers.zero else shard
    return {
        f"params/{shard}": buffers.params,  # compute dtype [total]
        f"master/{owner}": optimizer.master,  # fp32 [owned]
        f"exp_avg/{owner}": optimizer.exp_avg,
        f"exp_avg_sq/{owner}": optimizer.exp_avg_sq,
    }


class _DelayedWriter(FileSystemWriter):
    """A FileSystemWriter whose data writes start `delay_s` late (the `io` fault: slow storage)."""

    def __init__(self, path: Path, delay_s: float) -> None:
        super().__init__(str(path))
        self.delay_s = delay_s

    def write_data(self, plan, planner):
        time.sleep(self.delay_s)
        return super().write_data(plan, planner)


@dataclass
class SaveRecord:
    """One rank's share of one save, for telemetry."""

    next_step: int
    path: Path
    started: float
    blocking_s: float = 0.0
    async_s: float | None = None
    bytes: int | None = None
    error: str | None = None
    complete: bool = False
    """Rank 0 only: the marker was written (every rank finished)."""
    finished: threading.Event = field(default_factory=threading.Event)
    """Set once `Checkpointer._finish` is done with this save (marker, pruning, bookkeeping)."""


class Checkpointer:
    """Saves and loads one rank's training state; at most one save in flight.

    Every rank constructs it at the same point (it creates a process group) and calls `save` at
    the same steps. `finished()` hands the main thread the saves that completed since.
    """

    def __init__(
        self,
        run_directory: Path,
        dims: ParallelDims,
        buffers: DataParallelBuffers,
        optimizer: ShardedAdamW,
        layout: dict,
        keep: int,
        sync: bool,
    ) -> None:
        self.run_directory, self.dims = Path(run_directory), dims
        self.buffers, self.optimizer = buffers, optimizer
        self.layout, self.keep, self.sync = layout, keep, sync
        self.group = dist.new_group(backend="gloo")  # async saves never share the training group
        self._pending: tuple[Future, SaveRecord] | None = None
        self._done: list[SaveRecord] = []
        self._lock = threading.Lock()
        self.last_save = time.monotonic()

    def _state(self, next_step: int) -> dict[str, torch.Tensor]:
        state = training_state(self.dims, self.buffers, self.optimizer)
        rank = self.dims.rank
        state["next_step"] = torch.tensor(next_step, dtype=torch.int64)
        state[f"optimizer_steps/rank{rank}"] = torch.tensor(
            self.optimizer.steps_taken, dtype=torch.int64
        )
        state[f"rng/rank{rank}"] = torch.get_rng_state()
        return state

    def save(self, next_step: int, io_delay_s: float = 0.0) -> SaveRecord:
        """Checkpoint the state before step `next_step`. Returns once the state is staged (a
        copy taken): the write goes on in the background unless `sync`."""
        self.wait()
        path = checkpoint_path(self.run_directory, next_step)  # new in this attempt: an
        # abandoned save here was removed before it started (remove_incomplete)
        record = SaveRecord(next_step, path, time.perf_counter())
        writer = _DelayedWriter(path, io_delay_s)
        state = self._state(next_step)
        self.last_save = time.monotonic()
        if self.sync:
            try:
                dcp.save(state, storage_writer=writer, process_group=self.group)
            except Exception as error:  # recorded, and the previous checkpoint stays latest
                self._finish(record, error)
            else:
                self._finish(record, None)
            record.blocking_s = time.perf_counter() - record.started
            return record
        future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        record.blocking_s = time.perf_counter() - record.started
        future.add_done_callback(lambda done: self._finish(record, done.exception()))
        self._pending = (future, record)
        return record

    def _finish(self, record: SaveRecord, error: BaseException | None) -> None:
        """When this rank's write is done (a background thread for async saves)."""
        try:
            elapsed = time.perf_counter() - record.started
            record.async_s = 0.0 if self.sync else max(0.0, elapsed - record.blocking_s)
            rank = self.dims.rank
            record.bytes = sum(f.stat().st_size for f in record.path.glob(f"__{rank}_*.distcp"))
            if error is not None:
                raise error
            if rank == 0:  # DCP's coordinator returns once every rank's write is done
                self._write_marker(record)
                self._prune(record.next_step)
                record.complete = True
        except Exception as failure:  # the save failed; the previous checkpoint stays latest
            first = str(failure).strip().splitlines()
            record.error = f"{type(failure).__name__}: {first[0] if first else ''}"
        finally:
            with self._lock:
                self._done.append(record)
            record.finished.set()

    def _write_marker(self, record: SaveRecord) -> None:
        files = {
            f.name: f.stat().st_size
            for f in sorted(record.path.iterdir())
            if f.is_file() and f.name != COMPLETE_MARKER
        }
        marker = {
            "next_step": record.next_step,
            "layout": self.layout,
            "world_size": self.dims.world_size,
            "files": files,
            "bytes": sum(files.values()),
            "saved_at": time.time(),
        }
        tmp = record.path / f".{COMPLETE_MARKER}.tmp"
        tmp.write_text(json.dumps(marker, indent=1) + "\n")
        os.replace(tmp, record.path / COMPLETE_MARKER)

    def _prune(self, newest_step: int) -> None:
        """Keep the last `keep` complete checkpoints; drop saves that never completed before
        the newest (abandoned by a crash)."""
        complete = complete_checkpoints(self.run_directory)
        stale = set(complete[: -self.keep])
        stale |= {
            p
            for p in _saved_checkpoints(self.run_directory)
            if _step_of(p) < newest_step and p not in complete
        }
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written on this rank."""
        if self._pending is not None:
            future, record = self._pending
            with contextlib.suppress(Exception):  # its callback records the error
                future.result()
            # result() returns before the done-callback has run: wait for it too, so that
            # the marker is written and the save is listed by `finished()`.
            record.finished.wait()
            self._pending = None

    def finished(self) -> list[SaveRecord]:
        """Saves completed (or failed) since the last call."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def load(self, path: Path) -> int:
        """Load the checkpoint at `path` into the live state (every rank); returns the step to
        continue from. CheckpointError names the checkpoint when DCP cannot read it."""
        state = self._state(0)
        try:
            dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        except Exception as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise CheckpointError(
                f"checkpoint {path} could not be read ({type(error).__name__}: {first[:200]}); "
                f"delete it to resume from the one before it"
            ) from None
        self.optimizer.steps_taken = int(state[f"optimizer_steps/rank{self.dims.rank}"])
        torch.set_rng_state(state[f"rng/rank{self.dims.rank}"])
        return int(state["next_step"])
