"""Independent tasks run in this process, in local worker processes (`--workers N`), or as
tasks of one CPU on a Ray cluster (`--ray ADDRESS`) whose nodes read the same runs directory:
ingest's windows (analysis/window_writer.py) and the report's analysis windows
(analysis/window_report.py). A task's result does not depend on where it ran."""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

from ranktrace.analysis.store import StoreError


def map_tasks(function: Callable, tasks: list, workers: int = 1,
              ray_address: str | None = None, here: Callable | None = None) -> list:  # fmt: skip
    """The results of every task, in order: `function(task, threads)` on the Ray cluster at
    `ray_address` (threads 1) or in `workers` local processes (threads: this machine's cores
    shared among them); else in this process, one after the other, `here(task)` where given
    (e.g. on a connection already open), `function(task)` otherwise. `function` must be a
    module's top-level function (the workers import it)."""
    if not tasks:
        return []
    if ray_address:
        return _on_ray(function, tasks, ray_address)
    if workers > 1 and len(tasks) > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        context = multiprocessing.get_context("spawn")  # DuckDB's threads do not survive fork
        with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=context) as pool:
            return list(pool.map(function, tasks, [threads] * len(tasks)))
    return [here(task) if here is not None else function(task) for task in tasks]


def _on_ray(function: Callable, tasks: list, address: str) -> list:
    """The tasks as Ray tasks of one CPU each, on the cluster at `address`."""
    try:
        import ray
    except ImportError:
        raise StoreError(
            "--ray needs Ray, an optional extra: pip install 'ranktrace[ray]'"
        ) from None
    problem = _unreachable(address)
    if problem is None:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as error:
            problem = str(error).splitlines()[0]
    if problem is not None:
        raise StoreError(f"no Ray cluster at {address} ({problem}); start one with "
                         "`ray start --head` or give its address")  # fmt: skip
    try:
        remote = ray.remote(num_cpus=1)(function)
        return ray.get([remote.remote(task, 1) for task in tasks])
    finally:
        ray.shutdown()


def _unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers at a HOST:PORT address (Ray itself retries for minutes), or None
    (also for the addresses Ray resolves itself: `auto`, `local`)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as error:
        return error.strerror or type(error).__name__
    return None
