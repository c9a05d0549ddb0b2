"""Composition root of one rank: builds mesh, model, buffers, optimizer and data, runs the steps,
and (on rank 0) reports progress and writes `run.json`.

`rank_main` is the entry point of every rank, whether spawned by `ranktrace train` or by torchrun.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from telemetry.names import (
    BACKWARD,
    DATA,
    EVENT_CRASH,
    EVENT_FAULT_INJECTED,
    FORWARD,
    GRAD_SYNC,
    OPTIMIZER,
    PIPELINE_WAIT,
)
from trainer.comm import Comm
from trainer.config import TrainConfig
from trainer.data import BatchSource
from trainer.export import save_consolidated
from trainer.faults import RankFaults, check_faults
from trainer.mesh import ParallelDims
from trainer.model import StageModel, initialize, stage_layer_ids
from trainer.observability import open_rank_telemetry
from trainer.optim import ShardedAdamW, learning_rate
from trainer.parallel.data import DataParallelBuffers
from trainer.parallel.pipeline import SCHEDULES, StageTransfers, backward_step
from trainer.run_record import new_run_id, run_dir, write_rank_info, write_run_json

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
        self.dims = ParallelDims(cfg.pp, cfg.dp, cfg.tp, device.type)
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
        needs_data = self.dims.is_first_stage or self.dims.is_last_stage
        self.data = (
            BatchSource(cfg.data, cfg.seq_len, cfg.global_batch, mcfg.vocab_size, cfg.seed)
            if needs_data
            else None
        )
        local_seq = cfg.seq_len // cfg.tp if cfg.sequence_parallel else cfg.seq_len
        boundary = (cfg.micro_batch_size, local_seq, mcfg.hidden)  # [b, S_local, H]
        self.telemetry, self.instrumentor = open_rank_telemetry(
            cfg, self.comm, device, self.buffers
        )
        phase = self.telemetry.recorder.phase
        self.transfers = StageTransfers(
            self.comm, boundary, dtype, device, wait=lambda: phase(PIPELINE_WAIT)
        )
        self.schedule = SCHEDULES[cfg.schedule]
        faults = check_faults(cfg.inject, cfg.world_size, cfg.steps)
        self.faults = RankFaults(faults, self.dims.rank, device)
        for fault in self.faults.faults:  # the store says what was injected, and from when
            self.telemetry.event(EVENT_FAULT_INJECTED, fault.first_step, fault.text)

    def train_step(self, step: int) -> tuple[float, float, float]:
        """One optimizer step over the global batch; returns (global mean loss, global grad
        norm, learning rate)."""
        cfg, dims, phase = self.cfg, self.dims, self.telemetry.recorder.phase
        faults = self.faults
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
            with phase(FORWARD, mb), faults.compute():
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
            loss = self._global_loss(loss_sum)
        return loss, grad_norm, lr

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

    def _global_loss(self, loss_sum: torch.Tensor) -> float:
        """Mean loss over the global batch, known on every rank (one world all-reduce)."""
        owner = self.dims.is_last_stage and self.dims.coords.tp == 0
        share = loss_sum / self.cfg.dp if owner else torch.zeros_like(loss_sum)
        return self.comm.all_reduce(share.reshape(1), "world").item()

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
        if is_rank0:
            write_run_json(directory, record)
        log_every = cfg.resolved_log_every()
        show_bar = is_rank0 and sys.stdout.isatty()  # between summary lines, on a terminal only
        tokens_per_step = cfg.global_batch * cfg.seq_len
        recorder = self.telemetry.recorder
        for step in range(cfg.steps):
            if self.faults:
                self.faults.begin_step(step, self.comm.link_delay_s)
                self.faults.crash_if_due(lambda step=step: self._record_crash(step))
            start = time.perf_counter()
            recorder.begin_step(step)
            loss, grad_norm, lr = self.train_step(step)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            step_time = time.perf_counter() - start
            recorder.end_step(loss=loss, grad_norm=grad_norm, tokens=tokens_per_step, lr=lr)
            record["losses"].append(loss)
            record["grad_norms"].append(grad_norm)
            record["step_times_s"].append(step_time)
            if not is_rank0:
                continue
            if (step + 1) % log_every == 0 or step == 0 or step + 1 == cfg.steps:
                print(
                    f"{CLEAR_LINE}step {step + 1:>5}/{cfg.steps}  loss {loss:.4f}  "
                    f"grad-norm {grad_norm:.3f}  {step_time * 1e3:7.1f} ms/step  "
                    f"{tokens_per_step / step_time:9.0f} tok/s",
                    flush=True,
                )
                write_run_json(directory, record)
            elif show_bar:
                print(progress_bar(step + 1, cfg.steps, record["step_times_s"]), end="", flush=True)
        self.telemetry.close()
        if self.instrumentor is not None:
            self.instrumentor.uninstrument()
        if cfg.save_weights:
            save_consolidated(self.buffers, self.comm, directory)
        times = record["step_times_s"][1:] or record["step_times_s"]  # first step warms up
        record["tokens_per_s"] = tokens_per_step * len(times) / sum(times)
        record["status"] = "completed"
        record["finished_at"] = time.time()
        if is_rank0:
            write_run_json(directory, record)
        return record


def _agree_on_run_id(cfg: TrainConfig) -> None:
    """Under torchrun no launcher chose a run id: rank 0 picks one and broadcasts it."""
    if cfg.run_id:
        return
    box = [new_run_id() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    cfg.run_id = box[0]


def rank_main(cfg_dict: dict) -> dict | None:
    """Entry point of every rank. Returns run.json's record on rank 0, None elsewhere."""
    cfg = TrainConfig(**cfg_dict)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = resolve_device(
        cfg.device,
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        _agree_on_run_id(cfg)
        record = Trainer(cfg, device).fit()
        dist.barrier()
        return record if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
