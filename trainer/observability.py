"""Wires telemetry into one rank of the trainer: identity, MFU denominator, clock offset to
rank 0, analytic memory, and the comm observer. The only trainer module that knows telemetry.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import torch

from ranktrace.telemetry.exporter import RankIdentity, StepContext
from ranktrace.telemetry.flops import training_flops_per_token
from ranktrace.telemetry.instrument import Instrumentor
from ranktrace.telemetry.peaks import Peak, rank_peak
from ranktrace.telemetry.run_record import run_dir
from ranktrace.telemetry.session import RankTelemetry
from ranktrace.telemetry.timers import epoch_anchor_ns, timer_for
from ranktrace.trainer.comm import Comm
from ranktrace.trainer.config import TrainConfig
from ranktrace.trainer.cpu_bf16 import upcast_is_faster
from ranktrace.trainer.parallel.data import DataParallelBuffers

FP32_BYTES = 4
ADAM_STATE_COPIES = 3  # fp32 master weights, first and second moments


def peak_flops_of_this_rank(cfg: TrainConfig, device: torch.device,
                            dtype: torch.dtype) -> Peak:  # fmt: skip
    """This rank's peak (telemetry/peaks.py): `--peak-flops`, the GPU's datasheet figure, or its
    share of its host's stored peak (for bf16 on a CPU whose bf16 matmuls run through fp32, the
    fp32 rate)."""
    if dtype == torch.bfloat16 and device.type == "cpu" and upcast_is_faster():
        dtype = torch.float32
    on_host = 1
    if torch.distributed.is_initialized():
        hosts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(hosts, socket.gethostname())
        on_host = hosts.count(socket.gethostname())
    return rank_peak(device, dtype, Path(cfg.runs_dir), on_host, cfg.peak_flops or None)


def clock_offset_to_rank0_ns(comm: Comm, rounds: int = 3) -> tuple[int, int | None]:
    """(this rank's epoch clock minus rank 0's, the round trip it was measured in), NTP style:
    rank 0 pings each rank in turn; the rank answers with its clock t1; offset = t1 - (t0 +
    rtt / 2), from the round with the least round-trip time. Near 0 on one host (one clock); it
    matters across nodes. Rank 0: (0, None)."""
    rank = comm.dims.rank
    stamp = torch.zeros(2, dtype=torch.int64)  # [time, round-trip time]
    best_rtt, best_offset = None, 0
    for peer in range(1, comm.dims.world_size):
        for _ in range(rounds):
            if rank == 0:
                t0 = time.time_ns()
                comm.exchange([(stamp, peer)], [], "world")
                comm.exchange([], [(stamp, peer)], "world")
                rtt = time.time_ns() - t0
                stamp[0], stamp[1] = t0 + rtt // 2, rtt  # rank 0's clock when the peer read its
                comm.exchange([(stamp, peer)], [], "world")
            elif rank == peer:
                comm.exchange([], [(stamp, 0)], "world")
                local = time.time_ns()
                stamp[0] = local
                comm.exchange([(stamp, 0)], [], "world")
                comm.exchange([], [(stamp, 0)], "world")
                if best_rtt is None or int(stamp[1]) < best_rtt:
                    best_rtt, best_offset = int(stamp[1]), local - int(stamp[0])
    return best_offset, best_rtt


def open_rank_telemetry(
    cfg: TrainConfig, comm: Comm, device: torch.device, buffers: DataParallelBuffers
) -> tuple[RankTelemetry, Instrumentor | None]:
    """Start this rank's telemetry (every rank must call: it runs collectives)."""
    if cfg.telemetry == "off":
        return RankTelemetry.disabled(), None
    dims, m = comm.dims, cfg.model_config
    peak = peak_flops_of_this_rank(cfg, device, buffers.params.dtype)
    peak, peak_source = peak.rank_flops, peak.source
    job_peak = torch.tensor([peak], dtype=torch.float64)
    comm.all_reduce(job_peak, "world")
    offset_ns, offset_rtt_ns = clock_offset_to_rank0_ns(comm)
    element = buffers.params.element_size()
    context = StepContext(
        flops_per_token=training_flops_per_token(
            m.n_non_embedding_params(), m.n_layers, m.hidden, cfg.seq_len
        ),
        job_peak_flops=job_peak.item(),
        params_bytes=buffers.params.numel() * element,
        grads_bytes=buffers.grads.numel() * element,
        optimizer_bytes=ADAM_STATE_COPIES * FP32_BYTES * buffers.owned_numel,
        epoch_anchor_ns=epoch_anchor_ns(),
    )
    c = dims.coords
    identity = RankIdentity(
        cfg.run_id, dims.rank, c.pp, c.dp, c.tp, socket.gethostname(), cfg.attempt
    )
    group_ids = {axis: min(torch.distributed.get_process_group_ranks(dims.group(axis)))
                 for axis in ("pp", "dp", "tp")}  # fmt: skip
    group_ids["world"] = 0
    telemetry = RankTelemetry.open(
        identity, run_dir(cfg.runs_dir, cfg.run_id), context, group_ids,
        level=cfg.telemetry, trace_every=cfg.trace_every, flush_every_steps=cfg.flush_every,
        flush_seconds=cfg.flush_seconds, timer=timer_for(device), otlp_endpoint=cfg.otlp_endpoint,
        rank_metadata={"peak_flops": peak, "peak_flops_source": peak_source,
                       "clock_offset_ns": offset_ns, "clock_offset_rtt_ns": offset_rtt_ns,
                       "device": str(device),
                       "world_size": dims.world_size},
        cuda_memory=device.type == "cuda",
    )  # fmt: skip
    instrumentor = Instrumentor(telemetry.recorder)
    instrumentor.instrument(comm=comm)
    return telemetry, instrumentor
