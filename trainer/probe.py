"""`ranktrace probe` on every rank: send bandwidth of every ordered pair of nodes, and of ranks
within a node, each pair measured alone while the other ranks wait behind a barrier.

Launched like the job (torchrun on every node, `env://`), or as `--nproc N` local ranks. Rank 0
gathers every pair's figures and returns them; the caller stores them as a run (app/probe_cmd.py)
and analysis/probe.py names the slow sender or receiver. Between nodes one pair per ordered pair
of nodes (their first ranks): a node's NIC is shared by its ranks, so its leader sees what they
see. Inside a node every ordered pair of its ranks; the nodes' intra-node pairs run at once (they
share no link).

One pair (src -> dst); the receiver leads, as it keeps the clock:
    dst: send(order: bytes n, messages k) -> src     (order (0, 0): the pair is done)
    src: send(header); send(payload[:n]) k times
    dst: recv(header); t0; recv(payload[:n]) k times; seconds = now - t0
The header arrives once src has started sending, so `seconds` is the payload's time on the wire
measured on the receiver, without the wait for src to reach the pair. Warm-up orders (64 KiB,
then 8x larger) find the pair's rate; each of the `repeats` timed samples then lasts about
`pair_seconds / repeats`: a 1 MB/s link gets one ~100 KB message a sample, not 4 MiB, and a fast
one several `--bytes` messages, so neither the slow pairs' time nor the fast pairs' noise grows.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ranktrace.telemetry.cpu_clock import cpu_affinity

MIB = 2**20
WARMUP_BYTES = 64 * 1024
"""The first message of a pair: opens the connection and estimates the rate."""
MIN_BYTES = 16 * 1024
"""Smallest measured message: below it, latency rather than bandwidth sets the time."""
MAX_MESSAGES = 256
"""Most messages in one timed sample (a fast pair sends several `--bytes` messages a sample)."""


class ProbeRefused(RuntimeError):
    """Rank 0's check before measuring failed (e.g. `--for` names no run); every rank stops."""


@dataclass
class ProbeOptions:
    """What to measure and how (the `ranktrace probe` options)."""

    max_bytes: int = 4 * MIB
    """Largest message per pair (`--bytes`); slow pairs send smaller ones (`pair_seconds`)."""
    repeats: int = 5
    """Timed samples per pair; a pair's rate is its fastest (`pair_rate`)."""
    pair_seconds: float = 0.5
    """About how long a pair's timed messages take together, at its warm-up rate."""
    device: str = "cpu"
    """cpu (gloo) or cuda (nccl, one GPU per local rank)."""
    timeout_s: float = 300.0
    """Seconds any one collective or transfer may take before the probe fails."""


def probe_rank(options: ProbeOptions, check: Callable[[], str | None] | None = None) -> dict | None:
    """One rank's part: join the process group (env://), measure, leave. Returns the probe's
    figures on rank 0, None elsewhere.

    `check` runs on rank 0 before anything is measured; an error string it returns is raised
    on every rank as ProbeRefused, so no rank waits for a peer that stopped."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if options.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=options.timeout_s)
    device_id = device if backend == "nccl" else None
    dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    try:
        refusal = [check() if check and dist.get_rank() == 0 else None]
        dist.broadcast_object_list(refusal, src=0)
        if refusal[0]:
            raise ProbeRefused(refusal[0])
        return _measure(options, device, backend, local_rank)
    finally:
        dist.destroy_process_group()


def _measure(options: ProbeOptions, device: torch.device, backend: str, local_rank: int):
    started_at, started = time.time(), time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks: list = [None] * world
    me = {"rank": rank, "host": socket.gethostname(), "local_rank": local_rank,
          "cpu_affinity": cpu_affinity()}  # fmt: skip
    dist.all_gather_object(ranks, me)
    hosts = [info["host"] for info in ranks]
    payload = torch.zeros(options.max_bytes, dtype=torch.uint8, device=device)
    measured = []  # this rank's pairs as the receiver
    for pairs in schedule(hosts):
        for src, dst in pairs:
            if rank == src:
                _send_side(dst, payload)
            elif rank == dst:
                measured.append(_receive_side(src, payload, options))
        dist.barrier()  # the next round's pairs run alone
    gathered: list = [None] * world if rank == 0 else None
    dist.gather_object(measured, gathered, dst=0)
    if rank != 0:
        return None
    pairs = sorted((pair for part in gathered for pair in part),
                   key=lambda p: (p["src"], p["dst"]))  # fmt: skip
    return {
        "backend": backend, "world_size": world, "ranks": ranks, "pairs": pairs,
        **{f.name: getattr(options, f.name) for f in dataclasses.fields(options)},
        "started_at": started_at, "finished_at": time.time(),
        "duration_s": time.perf_counter() - started,
    }  # fmt: skip


def schedule(hosts: list[str]) -> list[list[tuple[int, int]]]:
    """Rounds of (src, dst) rank pairs measured at once; `hosts[r]` is rank r's host.

    Between nodes: one round per ordered pair of nodes (their lowest ranks). Inside nodes:
    round k holds the k-th ordered pair of ranks of every node."""
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    leaders = [ranks[0] for ranks in nodes.values()]
    rounds = [[(a, b)] for a in leaders for b in leaders if a != b]
    intra = [[(a, b) for a in ranks for b in ranks if a != b] for ranks in nodes.values()]
    for k in range(max(map(len, intra))):
        rounds.append([pairs[k] for pairs in intra if k < len(pairs)])
    return rounds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # NCCL calls return once queued on the stream
        torch.cuda.synchronize(device)


def _send_side(dst: int, payload: torch.Tensor) -> None:
    """Send what the receiver asks for: (bytes, messages) orders until (0, 0)."""
    order = torch.zeros(2, dtype=torch.int64, device=payload.device)  # bytes, messages
    header = torch.zeros(1, dtype=torch.int64, device=payload.device)
    while True:
        dist.recv(order, dst)
        size, count = (int(v) for v in order.tolist())
        if size == 0:
            return
        dist.send(header, dst)
        for _ in range(count):
            dist.send(payload[:size], dst)
        _sync(payload.device)


def _timed(src: int, payload: torch.Tensor, size: int, count: int) -> float:
    """Order `count` messages of `size` bytes from `src`; seconds from its header to the last."""
    device = payload.device
    dist.send(torch.tensor([size, count], dtype=torch.int64, device=device), src)
    dist.recv(torch.zeros(1, dtype=torch.int64, device=device), src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(count):
        dist.recv(payload[:size], src)
    _sync(device)
    return time.perf_counter() - t0


def _receive_side(src: int, payload: torch.Tensor, options: ProbeOptions) -> dict:
    """Measure src -> this rank: warm up with growing messages until one takes a good share of
    a sample's time (or is `max_bytes`), then `repeats` samples of ~pair_seconds/repeats each."""
    sample_s = options.pair_seconds / options.repeats
    size = min(WARMUP_BYTES, payload.numel())
    while True:
        rate = size / max(_timed(src, payload, size, 1), 1e-9)  # bytes/s
        if size >= payload.numel() or size / rate >= sample_s / 4:
            break
        size = min(payload.numel(), size * 8)
    wanted = rate * sample_s  # bytes per sample
    size = int(min(payload.numel(), max(MIN_BYTES, wanted)))
    count = int(min(MAX_MESSAGES, max(1, round(wanted / size))))
    seconds = [_timed(src, payload, size, count) for _ in range(options.repeats)]
    dist.send(torch.zeros(2, dtype=torch.int64, device=payload.device), src)  # done
    return {"src": src, "dst": dist.get_rank(), "bytes": size, "messages": count,
            "seconds": seconds, "bytes_per_s": pair_rate(size * count, seconds),
            "warmup_bytes_per_s": rate}  # fmt: skip


def pair_rate(sent_bytes: int, seconds: list[float]) -> float:
    """A pair's send rate from its timed samples (each `sent_bytes`): the fastest. A sample's
    time is the bytes' time on the wire plus whatever delayed either end (a descheduled rank,
    a busy host), never less, so the fastest sample holds the least of that delay. On a crowded
    2-core host an unlimited pair whose warm-up message stalled was sized at one 127 KB message
    a sample; its samples took 0.34-76 ms, and their median read 13.8 MB/s (the fastest, 375),
    while the limited pairs' samples moved by 6% (a slow-NIC test run in a timing loop)."""
    return sent_bytes / max(min(seconds), 1e-9)


def _local_rank_main(options: dict) -> dict | None:
    """Entry point of a rank spawned by `launch_local` (a module-level function: pickled)."""
    return probe_rank(ProbeOptions(**options))


def launch_local(options: ProbeOptions, nproc: int, run_id: str) -> dict:
    """Run the probe as `nproc` ranks on this machine (torch elastic); rank 0's figures."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ranktrace.trainer.launch import _quiet_launcher_logs, free_port
    from ranktrace.trainer.rank_server import start_rank_server

    _quiet_launcher_logs()
    start_rank_server()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id, rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0, monitor_interval=0.1,
        start_method="forkserver",
    )  # fmt: skip
    results = elastic_launch(config, _local_rank_main)(dataclasses.asdict(options))
    return results[0]
