"""What the benchmarks share: training the `small` model through the real `ranktrace train`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
