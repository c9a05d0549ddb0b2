"""Run a function on N real gloo ranks (separate processes) and collect what each returns.

The ranks are forked from a forkserver that imported torch once for the session (as the
trainer's rank server does), not spawned: a rank starts in well under a second instead of
importing torch afresh (~3 s of CPU each here)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "tests.distributed"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable, world_size: int, *args) -> list:
    """fn(rank, world_size, *args) on `world_size` gloo ranks; returns the per-rank results.

    `fn` must be a module-level function (it is pickled into the forked rank processes).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, _free_port(), out_dir, fn, args),
                           nprocs=world_size, start_method="forkserver")  # fmt: skip
        return [
            torch.load(Path(out_dir) / f"{r}.pt", weights_only=False) for r in range(world_size)
        ]
