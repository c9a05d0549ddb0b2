"""Import speed: a 100k-op per-op trace and a 100k-event torch profiler folder, imported and
reported (the budget is 1.5 s for the per-op trace on the 2-core dev machine).

    python benchmarks/import_speed.py [--ops 100000] [--repeats 3] [--dir /tmp/import-speed]

The per-op trace comes from the simulator of the tests (tests/perop_traces.py: 1F1B, pp=4,
dp=8, 8 micro-batches, rank (dp 2, stage 1) 1.5x slow), with as many steps as reach --ops. Prints
per repeat the seconds of each stage (read and check, write segments, ingest with the analysis,
reading the stored report back) in one process, their total against the budget, and the wall
time of the same import through the CLI (`ranktrace import per-op`, Python start-up included).
Then the same for the profiler folder (tests/kineto_traces.py, tp2 pp2 dp2).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ranktrace.analysis.ingest import ingest  # noqa: E402
from ranktrace.analysis.replay_graph import HOST_SERIAL  # noqa: E402
from ranktrace.analysis.run import cached_report  # noqa: E402
from ranktrace.analysis.store import open_reader  # noqa: E402
from ranktrace.importers.kineto import read_profiler_dir  # noqa: E402
from ranktrace.importers.perop import REPLAY_MODEL as PEROP_MODEL  # noqa: E402
from ranktrace.importers.perop import read_perop  # noqa: E402
from ranktrace.importers.writer import run_record, write_run  # noqa: E402
from ranktrace.telemetry.run_record import new_run_id  # noqa: E402
from tests.kineto_traces import write_profiler_traces  # noqa: E402
from tests.perop_traces import Job, simulate, write_trace  # noqa: E402

BUDGET_S = 1.5


def timed_import(read, runs_dir: Path, layout: dict, name: str, model: str) -> dict[str, float]:
    """Each stage of one import, in seconds."""
    times = {}
    start = time.perf_counter()
    ops, workers = read()
    times["read"] = time.perf_counter() - start
    start = time.perf_counter()
    run_id = new_run_id()
    source = {"format": "benchmark", "replay_model": model}
    record = run_record(run_id, name, ops, workers, layout, source)
    write_run(runs_dir, run_id, record, ops, workers)
    times["write"] = time.perf_counter() - start
    start = time.perf_counter()
    ingest(runs_dir, [run_id])
    times["ingest"] = time.perf_counter() - start
    start = time.perf_counter()
    con = open_reader(runs_dir)
    found = cached_report(con, run_id)  # ingest analysed the run and stored its report
    con.close()
    times["read report"] = time.perf_counter() - start
    times["ops"] = len(ops)
    times["stragglers"] = [(f["rank"], f["kind"]) for f in found["stragglers"]]
    return times


def cli_seconds(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ranktrace.app.cli", "import", *args], check=True,
                   cwd=REPO, capture_output=True)  # fmt: skip
    return time.perf_counter() - start


def show(label: str, times: dict, cli_s: float) -> None:
    stages = ("read", "write", "ingest", "read report")
    total = sum(times[s] for s in stages)
    parts = "  ".join(f"{s} {times[s]:.3f}" for s in stages)
    print(f"{label}: {times['ops']} ops  {parts}  total {total:.3f} s "
          f"({total / BUDGET_S:.2f}x the {BUDGET_S:.1f} s budget)  CLI wall {cli_s:.2f} s  "
          f"stragglers {times['stragglers']}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/import-speed"))
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    per_step = len(simulate(Job(pp=4, dp=8, steps=1)))
    job = Job(pp=4, dp=8, steps=max(2, -(-args.ops // per_step)), slow_worker=(2, 1))
    trace_path = write_trace(simulate(job), args.dir / "trace.parquet")
    profiler_dir = args.dir / "profiler"
    job_shape = {"world_size": 8, "tp": 2, "pp": 2, "micro_batches": 4, "gpu": False}
    write_profiler_traces(profiler_dir, steps=2, **job_shape)
    per_step = len(read_profiler_dir(profiler_dir)[0]) / 2
    shutil.rmtree(profiler_dir)
    write_profiler_traces(profiler_dir, steps=max(2, round(args.ops / per_step)), **job_shape,
                          slow_rank=5, slow_factor=1.5)  # fmt: skip
    layout = {"tp": 1, "pp": job.pp, "dp": job.dp}
    for repeat in range(args.repeats):
        runs = args.dir / f"runs-{repeat}"
        times = timed_import(lambda: read_perop(trace_path, job.pp, job.dp), runs, layout, "b",
                             PEROP_MODEL)  # fmt: skip
        cli_s = cli_seconds("per-op", str(trace_path), "--pp", str(job.pp), "--dp", str(job.dp),
                            "--runs-dir", str(runs))  # fmt: skip
        show(f"per-op   #{repeat}", times, cli_s)
        times = timed_import(lambda: read_profiler_dir(profiler_dir), runs,
                             {"tp": 2, "pp": 2, "dp": 2}, "p", HOST_SERIAL)  # fmt: skip
        cli_s = cli_seconds("torch-profiler", str(profiler_dir), "--runs-dir", str(runs))
        show(f"profiler #{repeat}", times, cli_s)


if __name__ == "__main__":
    main()
