"""What `ranktrace run` costs a job: the same DDP job (benchmarks/jobs_gpt.py) with and without
it, in interleaved pairs, and ranktrace's own recorded time (`steps.ranktrace_s`).

    python benchmarks/run_overhead.py [--pairs 5] [--nproc 2] [--steps 20] [--gpu]
        [-- JOB ARGS for jobs_gpt.py, e.g. --width 2048 --layers 16 --seq 1024]

Per run, the job prints its own step times; a run's time is the median of its steps after the
first 3. Printed: each pair's ratio (with / without), the median ratio (the budget is 1.03),
and from the recorded runs the median `ranktrace_s` over the median step time (budget 1%),
the steps recorded, MFU (FLOPs from torch's FLOP counter) and the median duration of the
job's all-reduces. `--gpu`: one rank on NCCL (the device check of issue 19).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "benchmarks" / "jobs_gpt.py"
SKIPPED_STEPS = 3


def job_command(nproc: int, steps: int, job_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), str(JOB), "--steps", str(steps), *job_args]  # fmt: skip


def median_step(output: str) -> float:
    times = [float(line.split()[1]) for line in output.splitlines()
             if line.startswith("step_time_s ")]  # fmt: skip
    if len(times) <= SKIPPED_STEPS:
        raise RuntimeError(f"the job printed {len(times)} step times:\n{output[-2000:]}")
    return statistics.median(times[SKIPPED_STEPS:])


def run(argv: list[str]) -> str:
    environment = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run(argv, capture_output=True, text=True, env=environment)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... failed:\n{result.stderr[-3000:]}")
    return result.stdout


def ranktrace(*args: str) -> str:
    return run([sys.executable, "-m", "ranktrace.app.cli", *args])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gpu", action="store_true", help="one rank, NCCL")
    parser.add_argument("job_args", nargs=argparse.REMAINDER, help="-- then jobs_gpt.py options")
    args = parser.parse_args()
    job_args = args.job_args[1:] if args.job_args[:1] == ["--"] else args.job_args
    nproc = 1 if args.gpu else args.nproc
    runs_dir = Path(tempfile.mkdtemp(prefix="ranktrace-overhead-"))
    command = job_command(nproc, args.steps, job_args)
    ratios = []
    for pair in range(args.pairs):
        plain = median_step(run(command))
        recorded = median_step(ranktrace("run", "--name", f"pair{pair}", "--runs-dir",
                                         str(runs_dir), "--", *command))  # fmt: skip
        ratios.append(recorded / plain)
        print(f"pair {pair}: without {plain * 1e3:.2f} ms, with ranktrace run "
              f"{recorded * 1e3:.2f} ms, ratio {recorded / plain:.3f}", flush=True)  # fmt: skip
    print(f"median ratio {statistics.median(ratios):.3f} (budget 1.03) over {args.pairs} pairs")
    query = (
        "SELECT count(*) AS steps, median(step_time_s) AS step_s, median(ranktrace_s) AS own_s,"
        " median(mfu) AS mfu, max(flops) AS flops FROM steps WHERE step >= 1"
    )
    (row,) = json.loads(ranktrace("sql", query, "--format", "json", "--runs-dir", str(runs_dir)))
    print(f"recorded: {row['steps']} rank-steps; ranktrace's own time {row['own_s'] * 1e3:.3f} "
          f"ms per step = {100 * row['own_s'] / row['step_s']:.2f}% of the median step "
          f"{row['step_s'] * 1e3:.2f} ms (budget 1%); MFU {100 * (row['mfu'] or 0):.1f}% "
          f"from {row['flops'] or 0:.3g} FLOPs a step (torch's FLOP counter)")  # fmt: skip
    calls = json.loads(ranktrace(
        "sql", "SELECT op, axis, count(*) AS n, median(bytes) AS bytes, median(duration_s) AS d,"
        " median(wait_ns) AS wait FROM collectives GROUP BY ALL ORDER BY n DESC",
        "--format", "json", "--runs-dir", str(runs_dir),
    ))  # fmt: skip
    for call in calls:
        wait = "" if call["wait"] is None else f", waited {call['wait'] / 1e6:.3f} ms"
        print(f"  {call['op']} on {call['axis']}: {call['n']} calls, {call['bytes'] / 1e6:.1f} "
              f"MB, median {call['d'] * 1e3:.3f} ms issue to completion{wait}")  # fmt: skip
    report = json.loads(ranktrace("report", "pair0", "--json", "--runs-dir", str(runs_dir)))
    print(f"report of pair0: {len(report['stragglers'])} stragglers, status {report['status']}, "
          f"layout {report['layout']}")  # fmt: skip


if __name__ == "__main__":
    main()
