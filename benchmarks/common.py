"""What the benchmarks share: training the `small` model through the real `ranktrace train`,
and timing a command with the peak memory of its whole process tree."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 128


def train_small(
    tp: int, pp: int, dp: int, steps: int, runs_dir: Path, name: str, *extra: str
) -> dict:
    """Train `small` (bf16, global batch 16, sequence 128, synthetic tokens) on tp×pp×dp ranks;
    returns the run's run.json. `extra`: more `ranktrace train` options."""
    argv = [sys.executable, "-m", "ranktrace.app.cli", "train", "--model", "small", "--tp", str(tp),
            "--pp", str(pp), "--dp", str(dp), "--steps", str(steps), "--global-batch", "16",
            "--seq-len", str(SEQ_LEN), "--data", "synthetic", "--runs-dir", str(runs_dir),
            "--run-name", name, *extra]  # fmt: skip
    subprocess.run(argv, check=True, cwd=REPO, capture_output=True)
    for path in runs_dir.glob("*/run.json"):
        record = json.loads(path.read_text())
        if record["name"] == name:
            return record
    raise RuntimeError(f"run {name} left no run.json under {runs_dir}")


def run_measured(argv: list[str], every_s: float = 0.05) -> tuple[float, int, str]:
    """Run `argv` to its end; (wall seconds, peak resident bytes of its process tree — the sum
    over the process and every child alive at each sample, `every_s` apart — and stdout).
    Raises when it fails."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        process = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=err, text=True)
        root, peak = psutil.Process(process.pid), 0
        while process.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                peak = max(peak, sum(_rss(p) for p in tree))
            except psutil.NoSuchProcess:
                pass
            time.sleep(every_s)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({process.returncode}): {stderr[-2000:]}")
    return wall, peak, stdout


def _rss(process: psutil.Process) -> int:
    try:
        return process.memory_info().rss
    except psutil.NoSuchProcess:
        return 0
