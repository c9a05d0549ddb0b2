"""Tokens/s of the `small` model for several layouts on this machine, as ratios to (1,1,1).

    python benchmarks/trainer_scaling.py [--steps 8] [--runs-dir /tmp/ranktrace-bench]

Each layout runs through the real `ranktrace train` (bf16, global batch 16, 2 micro-batches,
sequence 128, synthetic tokens); tokens/s excludes the first (warm-up) step. On a machine with
fewer cores than ranks the ranks share cores, so ratios below 1 show communication and
oversubscription cost, not what the layout would do with one device per rank.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import SEQ_LEN, train_small  # noqa: E402

from ranktrace.telemetry.flops import training_flops_per_token  # noqa: E402
from ranktrace.trainer.config import MODELS  # noqa: E402

LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 1), (1, 2, 1), (2, 2, 2)]  # (tp, pp, dp)


def run_layout(tp: int, pp: int, dp: int, steps: int, runs_dir: Path) -> dict:
    return train_small(tp, pp, dp, steps, runs_dir, f"bench-{tp}{pp}{dp}", "--micro-batches", "2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs-dir", type=Path, default=None)
    args = parser.parse_args()
    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="ranktrace-bench-"))
    m = MODELS["small"]
    flops_per_token = training_flops_per_token(
        m.n_non_embedding_params(), m.n_layers, m.hidden, SEQ_LEN
    )
    print(f"model small ({m.n_params() / 1e6:.2f}M params), {args.steps} steps per layout")
    print(f"{'tp pp dp':>9} {'ranks':>5} {'tokens/s':>10} {'ratio':>7} {'GFLOP/s':>8}")
    baseline = None
    for tp, pp, dp in LAYOUTS:
        tokens_per_s = run_layout(tp, pp, dp, args.steps, runs_dir)["tokens_per_s"]
        baseline = baseline or tokens_per_s
        print(
            f"{tp:>3}{pp:>3}{dp:>3} {tp * pp * dp:>5} {tokens_per_s:>10.0f} "
            f"{tokens_per_s / baseline:>7.2f} {tokens_per_s * flops_per_token / 1e9:>8.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
