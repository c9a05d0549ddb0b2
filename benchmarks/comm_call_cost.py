"""What ranktrace's hooks cost one torch.distributed call: a job of one gloo rank making CALLS
small calls a step (async all-reduces with their waits, or blocking ones), run bare and under
`ranktrace run`, in interleaved pairs.

    python benchmarks/comm_call_cost.py [--pairs 3] [--steps 30] [--calls 50] [--blocking]

Per run the job prints, for its steps after the first 3, the median wall and main-thread CPU
time of one call (issue to the end of its wait); printed are both runs' figures, each pair's
ratio, and the median added time per call. A call here moves 4 bytes, so the bare figure is
gloo's own floor and the difference is ranktrace's wrappers and recorder.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIPPED_STEPS = 3

JOB = """
import os, statistics, sys, time
import torch, torch.distributed as dist
steps, calls, blocking = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "blocking"
skip = int(sys.argv[4])
dist.init_process_group("gloo")
model = torch.nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
tensor = torch.ones(1)
walls, cpus = [], []
for step in range(steps):
    model(torch.randn(4, 8)).sum().backward()
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(calls):
        if blocking:
            dist.all_reduce(tensor)
        else:
            dist.all_reduce(tensor, async_op=True).wait()
    walls.append((time.perf_counter_ns() - wall) / calls)
    cpus.append((time.thread_time_ns() - cpu) / calls)
    optimizer.step()
    optimizer.zero_grad()
print("per_call_us", statistics.median(walls[skip:]) / 1e3, statistics.median(cpus[skip:]) / 1e3)
dist.destroy_process_group()
"""


def per_call(output: str) -> tuple[float, float]:
    """(wall µs, main-thread CPU µs) of one call, as the job printed them."""
    for line in output.splitlines():
        if line.startswith("per_call_us "):
            wall, cpu = line.split()[1:]
            return float(wall), float(cpu)
    raise RuntimeError(f"the job printed no per-call figure:\n{output[-2000:]}")


def run_job(script: Path, args: argparse.Namespace, runs_dir: Path | None, name: str):
    mode = "blocking" if args.blocking else "async"
    job = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        str(script),
        str(args.steps),
        str(args.calls),
        mode,
        str(SKIPPED_STEPS),
    ]
    if runs_dir is not None:
        job = [sys.executable, "-m", "ranktrace.app.cli", "run", "--name", name,
               "--runs-dir", str(runs_dir), "--", *job]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(job, capture_output=True, text=True, env=env, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(job)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )
    return per_call(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--blocking", action="store_true", help="blocking calls, not async")
    args = parser.parse_args()
    added = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "calls_job.py"
        script.write_text(JOB)
        for pair in range(args.pairs):
            bare = run_job(script, args, None, "")
            traced = run_job(script, args, Path(tmp) / "runs", f"calls-{pair}")
            added.append(traced[0] - bare[0])
            print(f"pair {pair}: bare {bare[0]:.1f} µs ({bare[1]:.1f} µs CPU), ranktrace "
                  f"{traced[0]:.1f} µs ({traced[1]:.1f} µs CPU), ratio {traced[0] / bare[0]:.2f}",
                  flush=True)  # fmt: skip
    kind = "blocking" if args.blocking else "async (with its wait)"
    print(f"median added per {kind} call: {statistics.median(added):.1f} µs")


if __name__ == "__main__":
    main()
