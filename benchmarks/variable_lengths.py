"""Varying sequence lengths, a real source of random imbalance: is it named, priced and told
apart from a slow rank, and is it absent when the lengths are fixed?

    python benchmarks/variable_lengths.py [--seeds 3] [--seed S] [--steps 30]
        [--lengths uniform:16,128] [--layouts dp4,pp2dp2] [--rescore DIR]

For each layout and seed (drawn from `--seed`, printed), the `small` model trains twice,
interleaved: every micro-batch cut to its own length (`--seq-len-dist`), then the same seed
at a fixed length. Printed per run: the random imbalance (its cost and name), the stragglers
named (none expected), and the share of S - 1 the named causes cover. Targets (issue 26): with
varying lengths a random imbalance named with its cost, no rank blamed, the causes covering
>= 80% of S - 1; with fixed lengths, no random imbalance.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"dp4": ("--dp", "4"), "pp2dp2": ("--pp", "2", "--dp", "2")}
COMMON = ("--model", "small", "--global-batch", "16", "--micro-batches", "2", "--seq-len", "128")


def ranktrace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ranktrace.app.cli", *args], cwd=REPO,
                          capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip


def train(runs_dir: Path, name: str, *args: str) -> None:
    result = ranktrace("train", *COMMON, *args, "--run-name", name, "--runs-dir", str(runs_dir))
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed: {result.stderr[-800:]}")


def summary(runs_dir: Path, name: str) -> dict:
    report = json.loads(ranktrace("report", name, "--json", "--runs-dir", str(runs_dir)).stdout)
    randoms = [i for i in report["imbalances"] if i["kind"] == "random"]
    causes = report["slowdown_by_cause"]
    covered = sum(c["share_pct"] for c in causes if c.get("share_pct") is not None)
    return {
        "random": randoms[0]["cost_pct"] if randoms else None,
        "name": next((c["cause"] for c in causes if c["kind"] == "random"), None),
        "stragglers": [(f["rank"], f["kind"]) for f in report["stragglers"]],
        "covered": covered if causes else None,
        "slowdown": report["slowdown"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lengths", default="uniform:16,128")
    parser.add_argument("--layouts", default="dp4,pp2dp2")
    parser.add_argument("--rescore", type=Path, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    rng = random.Random(seed)
    runs_dir = args.rescore or Path(tempfile.mkdtemp(prefix="lengths-")) / "runs"
    print(f"seed {seed}, runs in {runs_dir}", flush=True)
    cases = []
    for layout in args.layouts.split(","):
        for _ in range(args.seeds):
            trainer_seed = str(rng.randrange(1, 10**6))
            common = (*LAYOUTS[layout], "--steps", str(args.steps), "--seed", trainer_seed)
            varying, fixed = f"varying-{layout}-s{trainer_seed}", f"fixed-{layout}-s{trainer_seed}"
            if args.rescore is None:
                train(runs_dir, varying, *common, "--seq-len-dist", args.lengths)
                train(runs_dir, fixed, *common)
                print(f"  trained {varying} and {fixed}", flush=True)
            cases.append((varying, fixed))
    hits = clean = 0
    print(f"\n{'run':<26} {'S':>6} {'random':>7} {'covered':>8}  stragglers  cause")
    for varying, fixed in cases:
        for name in (varying, fixed):
            s = summary(runs_dir, name)
            random_text = "-" if s["random"] is None else f"{s['random']:.1f}%"
            covered = "-" if s["covered"] is None else f"{s['covered']:.0f}%"
            print(f"{name:<26} {s['slowdown']:>6.3f} {random_text:>7} {covered:>8}  "
                  f"{s['stragglers'] or '-'}  {s['name'] or '-'}")  # fmt: skip
            if name == varying:
                hits += bool(s["random"] is not None and not s["stragglers"]
                             and (s["covered"] or 0) >= 80)  # fmt: skip
            else:
                clean += s["random"] is None
    print(
        f"\nvarying lengths: random imbalance named, no rank blamed, >= 80% of S - 1 covered "
        f"in {hits}/{len(cases)}; fixed lengths: no random imbalance in {clean}/{len(cases)}"
    )


if __name__ == "__main__":
    main()
