"""The peak FLOP/s an MFU divides by: one per machine, measured once and reused.

A CPU's peak is a measurement (the matmul rate of its cores), and a measurement made afresh by
every run was noise that MFU then carried: the demo's three runs on one VM measured 2.93e11,
2.68e11 and 4.55e11 FLOP/s, so a run showed half the MFU of another at the same step time. So
the host's rate is measured once per host, device kind and dtype (every core the process may
use, one thread each, while the host's other ranks wait for it), stored with its date and
method in the runs directory's `peaks.json`, and every later run on that host reuses it. A
rank's peak is then its share of its host (the host's peak over the ranks on it), the job's the
sum over its hosts: two runs on one machine compare by their work. A GPU's peak comes from the
datasheet table (telemetry/flops.py); `--peak-flops` (a rank's device peak) overrides both.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ranktrace.telemetry.flops import gpu_peak_flops, measure_matmul_flops

PEAKS_FILE = "peaks.json"
MEASURE_SECONDS = 0.5
"""How long the host's matmul rate is measured (once per host)."""


@dataclass(frozen=True)
class Peak:
    """A rank's peak FLOP/s and where it comes from."""

    rank_flops: float
    host_flops: float
    """The whole host's (a CPU), or one device's (a GPU, `--peak-flops`)."""
    source: str


def rank_peak(device: torch.device, dtype: torch.dtype, runs_dir: Path | None,
              ranks_on_host: int, override: float | None = None) -> Peak:  # fmt: skip
    """This rank's peak: `override` (its device's peak), a GPU's datasheet figure, or its share
    of its host's stored peak (measured now, once, when the host has none for this dtype)."""
    if override:
        return Peak(override, override * ranks_on_host, "given (--peak-flops)")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is not None:
            return Peak(peak, peak * ranks_on_host, f"datasheet bf16 dense ({name})")
    entry = host_peak(runs_dir, dtype)
    share = entry["flops"] / max(1, ranks_on_host)
    source = (f"{entry['method']}, measured {entry['measured_at']} on {entry['host']} "
              f"(stored in {PEAKS_FILE}), shared by {ranks_on_host} ranks")  # fmt: skip
    return Peak(share, entry["flops"], source)


def host_peak(runs_dir: Path | None, dtype: torch.dtype) -> dict:
    """The stored peak of this host for `dtype` ({host, device, dtype, flops, measured_at,
    method}); measured and stored first if there is none. Without a runs directory (nowhere to
    keep it) it is measured, not stored."""
    key = _key(dtype)
    if runs_dir is None:
        return _measure(dtype)
    runs_dir.mkdir(parents=True, exist_ok=True)
    with open(runs_dir / (PEAKS_FILE + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one rank measures; the host's others wait for it
        path = runs_dir / PEAKS_FILE
        peaks = _read(path)
        if key not in peaks:
            peaks[key] = _measure(dtype)
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps(peaks, indent=1, sort_keys=True))
            os.replace(temporary, path)
        return peaks[key]


def stored_peaks(runs_dir: Path) -> dict:
    """Every stored peak of the runs directory, by host|device|dtype."""
    return _read(runs_dir / PEAKS_FILE)


def _read(path: Path) -> dict:
    try:
        peaks = json.loads(path.read_text())
        return peaks if isinstance(peaks, dict) else {}
    except (OSError, ValueError):  # none yet, or damaged: measured again
        return {}


def _key(dtype: torch.dtype) -> str:
    return f"{socket.gethostname()}|{_cpu_model()}|{str(dtype).removeprefix('torch.')}"


def _measure(dtype: torch.dtype) -> dict:
    """The matmul rate of every core this process may use, one thread each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, cores or 1))
    try:
        flops = measure_matmul_flops(dtype, size=1024, seconds=MEASURE_SECONDS)
    finally:
        torch.set_num_threads(threads)
    name = str(dtype).removeprefix("torch.")
    return {"host": socket.gethostname(), "device": _cpu_model(), "dtype": name, "flops": flops,
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()),
            "method": f"1024^3 {name} matmul on {cores} cores, {MEASURE_SECONDS} s"}  # fmt: skip


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"
