"""Composition root of one rank: builds mesh, model, buffers, optimizer and data, runs the steps,
and (on rank 0) reports progress and writes `run.json`.

`rank_main` is the entry point of every rank, whether spawned by `ranktrace train` or by torchrun.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from ranktrace.telemetry.names import (
    BACKWARD,
    CHECKPOINT,
    DATA,
    EVENT_CHECKPOINT_COMPLETE,
    EVENT_CHECKPOINT_FAILED,
    EVENT_CHECKPOINT_SAVED,
    EVENT_CRASH,
    EVENT_FAULT_INJECTED,
    EVENT_HANG_INJECTED,
    EVENT_RESTART,
    FORWARD,
    GRAD_SYNC,
    OPTIMIZER,
    PIPELINE_WAIT,
)
from ranktrace.telemetry.run_record import (
    new_run_id,
    read_run_json,
    resumed_record,
    run_dir,
    write_rank_info,
    write_run_json,
)
from ranktrace.trainer.checkpoint import (
    Checkpointer,
    CheckpointError,
    latest_checkpoint,
    remove_incomplete,
)
from ranktrace.trainer.comm import Comm
from ranktrace.trainer.config import TrainConfig
from ranktrace.trainer.data import BatchSource
from ranktrace.trainer.export import save_consolidated
from ranktrace.trainer.fault_injection import RankFaults
from ranktrace.trainer.faults import check_faults
from ranktrace.trainer.lengths import micro_batch_lengths
from ranktrace.trainer.mesh import ParallelDims
from ranktrace.trainer.model import StageModel, initialize, stage_layer_ids
from ranktrace.trainer.observability import open_rank_telemetry
from ranktrace.trainer.optim import ShardedAdamW, learning_rate
from ranktrace.trainer.parallel.data import DataParallelBuffers
from ranktrace.trainer.parallel.pipeline import SCHEDULES, StageTransfers, backward_step
from ranktrace.trainer.termination import TERMINATION
from ranktrace.trainer.watchdog import SAVE_OP, CollectiveWatchdog

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CLEAR_LINE = "\r\033[K" if sys.stdout.isatty() else ""


def progress_bar(done: int, total: int, step_times_s: list[float], width: int = 30) -> str:
    """`\r[#####.....] 120/1000 steps, 41 s left`, from the mean of the last 20 step times."""
    filled = width * done // total
    recent = step_times_s[-20:]
    left_s = (total - done) * sum(recent) / len(recent)
    bar = "#" * filled + "." * (width - filled)
    return f"{CLEAR_LINE}[{bar}] {done}/{total} steps, {left_s:.0f} s left"


def resolve_device(requested: str, local_rank: int, local_world_size: int) -> torch.device:
    """cpu, or this rank's own GPU. 'auto' picks CUDA when every local rank can have its own
    GPU (NCCL refuses two ranks on one device)."""
    gpus = torch.cuda.device_count()
    use_cuda = requested == "cuda" or (requested == "auto" and gpus >= local_world_size)
    if not use_cuda:
        return torch.device("cpu")
    if gpus < local_world_size:
        raise RuntimeError(f"--device cuda needs {local_world_size} GPUs here, torch sees {gpus}")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", torch.cuda.current_device())


def base_record(cfg: TrainConfig, status: str) -> dict:
    """The fields of run.json known before training starts."""
    m = cfg.model_config
    return {
        "run_id": cfg.run_id,
        "name": cfg.run_name or cfg.run_id,
        "status": status,
        "layout": {"tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp, "zero": cfg.zero},
        "world_size": cfg.world_size,
        "model": cfg.model,
        "n_params": m.n_params(),
        "model_config": dataclasses.asdict(m),
        "stage_layers": cfg.stage_split(),
        "precision": cfg.precision,
        "steps": cfg.steps,
        "global_batch": cfg.global_batch,
        "micro_batches": cfg.micro_batches,
        "seq_len": cfg.seq_len,
        "schedule": cfg.schedule,
        "sequence_parallel": cfg.sequence_parallel,
        "data": cfg.data,
        "seed": cfg.seed,
        "host": socket.gethostname(),
        "started_at": time.time(),
        "attempt": cfg.attempt,
        "losses": [],
        "grad_norms": [],
        "step_times_s": [],
        "tokens_per_s": None,
        "config": cfg.to_dict(),
    }


class Trainer:
    """One rank's share of the 3D-parallel job."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.dims = ParallelDims(cfg.pp, cfg.dp, cfg.tp, device.type, cfg.rank_order)
        self.comm = Comm(self.dims)
        mcfg, coords = cfg.model_config, self.dims.coords
        layer_ids = stage_layer_ids(cfg.stage_split(), coords.pp)
        self.model = StageModel(mcfg, self.comm, layer_ids, cfg.seq_len, cfg.sequence_parallel)
        initialize(self.model, cfg.seed)
        self.model.to(device)
        dtype = COMPUTE_DTYPES[cfg.precision]
        self.buffers = DataParallelBuffers(
            list(self.model.named_parameters()),
            self.comm,
            cfg.zero,
            int(cfg.bucket_mb * 2**20),
            dtype,
        )
        self.optimizer = ShardedAdamW(self.buffers, self.comm, cfg.weight_decay, cfg.grad_clip)
        self.sp_params = [p for p in self.model.parameters() if getattr(p, "sequence_parallel", 0)]
        self.lengths = micro_batch_lengths(cfg)  # every stage knows them: the shapes it gets
        needs_data = self.dims.is_first_stage or self.dims.is_last_stage
        self.data = None
        if needs_data:
            self.data = BatchSource(cfg.data, cfg.seq_len, cfg.global_batch, mcfg.vocab_size,
                                    cfg.seed, self.lengths)  # fmt: skip
        self.telemetry, self.instrumentor = open_rank_telemetry(
            cfg, self.comm, device, self.buffers
        )
        phase = self.telemetry.recorder.phase
        self._step = 0  # the step train_step runs (the transfers' shapes depend on it)
        self.transfers = StageTransfers(
            self.comm, self._boundary_shape, dtype, device, wait=lambda: phase(PIPELINE_WAIT)
        )
        self.schedule = SCHEDULES[cfg.schedule]
        faults = check_faults(cfg.inject, cfg.world_size, cfg.steps)
        first_attempt = restart_count() == 0  # one-off faults (crash, hang) happen once
        self.faults = RankFaults(faults, self.dims.rank, device, first_attempt)
        for fault in self.faults.faults:  # the store says what was injected, and from when
            self.telemetry.event(EVENT_FAULT_INJECTED, fault.first_step, fault.text)
        self.layout = {"tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp, "zero": cfg.zero}
        checkpointing = cfg.checkpoint_every > 0 or cfg.checkpoint_minutes > 0
        self.checkpointer = None
        if checkpointing or cfg.attempt > 0:  # every rank alike: this makes a process group
            directory = run_dir(cfg.runs_dir, cfg.run_id)
            self.checkpointer = Checkpointer(
                directory, self.dims, self.buffers, self.optimizer, self.layout,
                cfg.checkpoint_keep, cfg.checkpoint_sync,
            )  # fmt: skip
        self.start_step = self._restore() if cfg.attempt > 0 else 0

    def seq_len_of(self, step: int, mb: int) -> int:
        """Tokens per sequence of this rank's micro-batch `mb` at `step`."""
        if self.lengths is None:
            return self.cfg.seq_len
        return self.lengths.length(step, self.dims.coords.dp, mb)

    def tokens_at(self, step: int) -> int:
        """Tokens the whole job trains on at `step`."""
        cfg = self.cfg
        if self.lengths is None:
            return cfg.global_batch * cfg.seq_len
        return self.lengths.tokens(step, cfg.micro_batch_size)

    def _boundary_shape(self, mb: int) -> tuple[int, int, int]:
        """[b, S_local, H] of micro-batch `mb`'s stage boundary activation this step."""
        cfg = self.cfg
        seq = self.seq_len_of(self._step, mb)
        local_seq = seq // cfg.tp if cfg.sequence_parallel else seq
        return (cfg.micro_batch_size, local_seq, cfg.model_config.hidden)

    def _restore(self) -> int:
        """A restarted or resumed attempt: load the latest complete checkpoint (rank 0 picks
        it for everyone) and return the step to continue from; 0 when a restarted job has
        none yet. A damaged checkpoint, or `--resume` without one, is a CheckpointError."""
        directory = run_dir(self.cfg.runs_dir, self.cfg.run_id)
        found, error = None, None
        if self.dims.rank == 0:
            try:
                latest = latest_checkpoint(directory, self.layout)
                found = str(latest[0]) if latest else None
            except CheckpointError as failure:
                error = str(failure)
            remove_incomplete(directory)  # before the broadcast: no rank saves before it
        found, error = self.comm.broadcast_object((found, error))
        if error is None and found is None and self.cfg.resume:
            error = f"run {self.cfg.run_id} has no complete checkpoint to resume from"
        if error is not None:
            raise CheckpointError(error)
        start = self.checkpointer.load(Path(found)) if found else 0
        detail = {
            "attempt": self.cfg.attempt,
            "resumed_from_step": start,
            "checkpoint": found,
            "how": "resume" if self.cfg.resume and restart_count() == 0 else "restart",
        }
        if self.dims.rank == 0:
            self.telemetry.event(EVENT_RESTART, start, json.dumps(detail))  # fmt: skip
        return start

    def train_step(self, step: int) -> tuple[float, float, float, bool]:
        """One optimizer step over the global batch; returns (global mean loss, global grad
        norm, learning rate, whether rank 0 asks for a time-based checkpoint now)."""
        cfg, dims, phase = self.cfg, self.dims, self.telemetry.recorder.phase
        faults = self.faults
        self._step = step
        self.buffers.zero_grad()
        with phase(DATA):
            micro = (
                self.data.micro_batches(step, dims.coords.dp, cfg.dp, cfg.micro_batches)
                if self.data is not None
                else None
            )
            if faults:
                faults.slow_data()
        if faults:
            faults.host_pause()  # outside every phase, like a GC pause
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)

        def forward_step(mb: int, received: torch.Tensor | None) -> torch.Tensor:
            tokens_in = cfg.micro_batch_size * self.seq_len_of(step, mb)
            with phase(FORWARD, mb, tokens=tokens_in), faults.compute():
                tokens = micro[mb].to(self.device) if micro is not None else None  # [b, S+1]
                x = tokens[:, :-1] if dims.is_first_stage else received
                if not dims.is_last_stage:
                    return self.model(x)
                loss = self.model(x, tokens[:, 1:]) / cfg.micro_batches
                loss_sum.add_(loss.detach())
                return loss

        def timed_backward_step(received, output, output_grad):
            with phase(BACKWARD), faults.compute():
                return backward_step(received, output, output_grad)

        self.schedule(cfg.micro_batches, forward_step, timed_backward_step, self.transfers)
        with phase(GRAD_SYNC):
            self._reduce_sequence_parallel_grads()
            grads = self.buffers.sync_grads()
        lr = learning_rate(step, cfg.lr, cfg.resolved_warmup_steps(), cfg.steps)
        with phase(OPTIMIZER):
            grad_norm = self.optimizer.step(grads, lr)
        with phase(GRAD_SYNC):  # every collective sits in a phase: the rest is host time
            loss, save_vote = self._global_loss(loss_sum)
        return loss, grad_norm, lr, save_vote

    def _reduce_sequence_parallel_grads(self) -> None:
        """Norm weights under SP saw only S/tp tokens on each rank: sum their grads over tp."""
        if not self.sp_params or self.dims.tp == 1:
            return
        flat = torch.cat([p.grad.flatten() for p in self.sp_params])
        self.comm.all_reduce(flat, "tp")
        offset = 0
        for p in self.sp_params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()

    def _global_loss(self, loss_sum: torch.Tensor) -> tuple[float, bool]:
        """Mean loss over the global batch, known on every rank (one world all-reduce). With
        `--checkpoint-minutes`, rank 0's "a checkpoint is due" rides along in the same
        all-reduce, so every rank agrees on when to save without another collective."""
        owner = self.dims.is_last_stage and self.dims.coords.tp == 0
        share = loss_sum / self.cfg.dp if owner else torch.zeros_like(loss_sum)
        if self.cfg.checkpoint_minutes <= 0:
            return self.comm.all_reduce(share.reshape(1), "world").item(), False
        due = (
            self.dims.rank == 0
            and time.monotonic() - self.checkpointer.last_save >= 60 * self.cfg.checkpoint_minutes
        )
        values = torch.stack([share.float(), torch.tensor(float(due), device=share.device)])
        loss, vote = self.comm.all_reduce(values, "world").tolist()
        return loss, vote > 0

    def _save_due(self, step: int, vote: bool) -> bool:
        every = self.cfg.checkpoint_every
        return self.checkpointer is not None and (vote or (every > 0 and (step + 1) % every == 0))

    def _save(self, step: int) -> None:
        """Checkpoint before step `step + 1`; the blocking part is the step's `checkpoint`
        phase."""
        with self._saving(), self.telemetry.recorder.phase(CHECKPOINT):
            delay = self.faults.io_delay_s() if self.faults else 0.0
            self.checkpointer.save(step + 1, delay)

    @contextlib.contextmanager
    def _saving(self) -> Iterator[None]:
        """Mark a checkpoint save (or the wait for one) as this rank's operation in flight: the
        collective-timeout watchdog leaves it alone."""
        comm = self.comm
        comm.in_flight = (SAVE_OP, "world", (), -1, time.monotonic())
        try:
            yield
        finally:
            comm.in_flight, comm.last_done = None, time.monotonic()

    def _record_saves(self) -> None:
        """Turn the saves that finished since the last call into events."""
        for save in self.checkpointer.finished() if self.checkpointer else []:
            detail = {"next_step": save.next_step, "path": str(save.path),
                      "blocking_s": save.blocking_s, "async_s": save.async_s,
                      "bytes": save.bytes, "sync": self.cfg.checkpoint_sync}  # fmt: skip
            if save.error:
                kind = EVENT_CHECKPOINT_FAILED
                detail["error"] = save.error
            else:
                kind = EVENT_CHECKPOINT_SAVED
            self.telemetry.event(kind, save.next_step, json.dumps(detail))
            if save.complete:
                marker = {"next_step": save.next_step, "path": str(save.path),
                          "seconds": save.blocking_s + (save.async_s or 0.0)}  # fmt: skip
                self.telemetry.event(EVENT_CHECKPOINT_COMPLETE, save.next_step, json.dumps(marker))

    def _record_hang(self, step: int) -> None:
        """What an injected hang leaves behind before the rank stops."""
        self.telemetry.event(EVENT_HANG_INJECTED, step, f"injected hang of rank {self.dims.rank}")
        self.telemetry.flush()
        sys.stdout.flush()

    def _record_crash(self, step: int) -> None:
        """What an injected crash leaves behind: its event, written before the process dies."""
        self.telemetry.event(EVENT_CRASH, step, f"injected crash of rank {self.dims.rank}")
        self.telemetry.flush()
        sys.stdout.flush()

    def fit(self) -> dict:
        """Train for cfg.steps; rank 0 prints progress and keeps run.json current."""
        cfg = self.cfg
        is_rank0 = self.dims.rank == 0
        directory = run_dir(cfg.runs_dir, cfg.run_id)
        c = self.dims.coords
        write_rank_info(
            directory,
            self.dims.rank,
            {
                "rank": self.dims.rank,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                "device": str(self.device),
                "pp": c.pp,
                "dp": c.dp,
                "tp": c.tp,
            },
        )
        record = base_record(cfg, "running")
        record["device"] = self.device.type
        record["backend"] = dist.get_backend()
        if is_rank0 and cfg.attempt > 0:
            record = resumed_record(read_run_json(directory), record, self.start_step)
        if is_rank0:
            write_run_json(directory, record)
        watchdog = None
        if cfg.collective_timeout > 0:
            watchdog = CollectiveWatchdog(
                self.comm, cfg.collective_timeout, self.telemetry.event, self.telemetry.flush
            ).start()
        log_every = cfg.resolved_log_every()
        show_bar = is_rank0 and sys.stdout.isatty()  # between summary lines, on a terminal only
        recorder = self.telemetry.recorder
        tokens_trained = 0
        for step in range(self.start_step, cfg.steps):
            if watchdog is not None:
                watchdog.begin_step(step)
            if self.faults:
                self.faults.begin_step(step, self.comm.link_delay_s)
                self.faults.crash_if_due(lambda step=step: self._record_crash(step))
                self.faults.hang_if_due(lambda step=step: self._record_hang(step))
            self._record_saves()
            start = time.perf_counter()
            recorder.begin_step(step)
            loss, grad_norm, lr, save_vote = self.train_step(step)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            record["losses"].append(loss)
            record["grad_norms"].append(grad_norm)
            if self._save_due(step, save_vote):
                if is_rank0:  # run.json holds the results of every step a checkpoint covers
                    so_far = [*record["step_times_s"], time.perf_counter() - start]
                    write_run_json(directory, {**record, "step_times_s": so_far})
                self._save(step)
            step_time = time.perf_counter() - start
            tokens_per_step = self.tokens_at(step)
            if step > self.start_step:  # the first step warms up
                tokens_trained += tokens_per_step
            with TERMINATION.deferred():  # end_step may write a segment
                recorder.end_step(loss=loss, grad_norm=grad_norm, tokens=tokens_per_step, lr=lr)
            record["step_times_s"].append(step_time)
            if not is_rank0:
                continue
            if (step + 1) % log_every == 0 or step == 0 or step + 1 == cfg.steps:
                print(
                    f"{CLEAR_LINE}step {step:>5} ({step + 1}/{cfg.steps})  loss {loss:.4f}  "
                    f"grad-norm {grad_norm:.3f}  {step_time * 1e3:7.1f} ms/step  "
                    f"{tokens_per_step / step_time:9.0f} tok/s",
                    flush=True,
                )
                write_run_json(directory, record)
            elif show_bar:
                print(progress_bar(step + 1, cfg.steps, record["step_times_s"]), end="", flush=True)
        if self.checkpointer is not None:
            with self._saving():
                self.checkpointer.wait()
            self._record_saves()
        if watchdog is not None:
            watchdog.stop()
        self.telemetry.close()
        if self.instrumentor is not None:
            self.instrumentor.uninstrument()
        if cfg.save_weights:
            save_consolidated(self.buffers, self.comm, directory)
        times = record["step_times_s"][1:] or record["step_times_s"]  # first step warms up
        tokens = tokens_trained or self.tokens_at(self.start_step) * len(times)
        record["tokens_per_s"] = tokens / sum(times)
        record["status"] = "completed"
        record["finished_at"] = time.time()
        if is_rank0:
            write_run_json(directory, record)
        return record


def restart_count() -> int:
    """How many times torch elastic restarted this job within the current launch."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _attempt_store() -> dist.Store | None:
    """Under torch elastic, the agent's key-value store with a prefix of this attempt.

    The agent keeps one store across restarts (torch 2.13), so a restarted job's process groups
    would read the dead attempt's addresses and fail to connect ("Connection refused");
    prefixing the keys with the restart count gives each attempt its own. None elsewhere."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
    )
    return dist.PrefixStore(f"ranktrace/attempt-{restart_count()}", client)


def _agree_on_run_id(cfg: TrainConfig) -> None:
    """Under torchrun no launcher chose a run id: rank 0 picks one and broadcasts it."""
    if cfg.run_id:
        return
    box = [new_run_id() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    cfg.run_id = box[0]


PEER_LOSS_EXIT_DELAY_S = 1.0
"""A rank whose collective failed because a peer vanished exits this much later. The launcher
reports the failure it sees first; a rank that raises at once can beat the SIGKILL of the peer
that caused it (with forked ranks, 3 of 4 runs named the survivor; with the delay, 5 of 5 the
killed rank)."""


def _lost_a_peer(error: BaseException) -> bool:
    """A collective failed because another rank's process went away."""
    text = str(error)
    return isinstance(error, dist.DistBackendError) or any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer")
    )


def rank_main(cfg_dict: dict, stdout_to_stderr: bool = False) -> dict | None:
    """Entry point of every rank. Returns run.json's record on rank 0, None elsewhere.
    `stdout_to_stderr`: this rank's stdout is its stderr (trainer/launch.py `launch`)."""
    if stdout_to_stderr:
        sys.stdout.flush()
        os.dup2(2, 1)
    cfg = TrainConfig(**cfg_dict)
    cfg.attempt += restart_count()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = resolve_device(
        cfg.device,
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    store = _attempt_store()
    if store is None:
        dist.init_process_group(backend, device_id=device_id)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, device_id=device_id
        )
    try:
        _agree_on_run_id(cfg)
        trainer = Trainer(cfg, device)
        TERMINATION.install()
        try:
            record = trainer.fit()
        except BaseException as error:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut this
            trainer.telemetry.flush()
            if _lost_a_peer(error):  # let the launcher see the rank that died before this one
                time.sleep(PEER_LOSS_EXIT_DELAY_S)
            raise
        dist.barrier()
        return record if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
