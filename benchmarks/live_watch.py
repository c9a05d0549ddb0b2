"""What `ranktrace watch` pays per window as a long run grows: benchmarks/store_scale.py's
synchronous run (rank 5 30% slower from the middle step) landing one window at a time, each
window ingested as it completes (`ingest(..., complete_only=True)`, in this process, as `watch`
does), which also computes and stores the report over the windows so far.

    python benchmarks/live_watch.py [--ranks 1024] [--steps 2000] [--window 100] [--dir D]

Writing the segments (into a staging folder) and copying each window's into the live run are
not timed. Prints each window's ingest + report time against the steps stored so far, the last
windows' time over the first ones' (flat when a window costs the same whatever the run's
length), the run's final ingest once it ends, and the findings of the last live report.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import store_scale  # noqa: E402

from ranktrace.analysis.ingest import ingest  # noqa: E402
from ranktrace.analysis.run import cached_report  # noqa: E402
from ranktrace.analysis.store import open_reader  # noqa: E402
from ranktrace.telemetry import names  # noqa: E402
from ranktrace.telemetry.run_record import read_run_json, write_run_json  # noqa: E402


def land_window(staging: Path, live: Path, index: int) -> None:
    """Copy every rank's segments of window `index` from the staging run into the live one."""
    for kind in ("spans", "steps"):
        for path in (staging / names.TELEMETRY_DIR).glob(f"rank=*/{kind}-*-{index:06d}.parquet"):
            target = live / path.relative_to(staging)
            shutil.copyfile(path, target)


def timed_ingest(runs_dir: Path, window: int) -> float:
    start = time.perf_counter()
    ingest(runs_dir, [store_scale.RUN_ID], window_steps=window, complete_only=True)
    return time.perf_counter() - start


def findings(runs_dir: Path) -> list[tuple]:
    con = open_reader(runs_dir)
    try:
        found = cached_report(con, store_scale.RUN_ID)
    finally:
        con.close()
    return [(f["rank"], f["kind"], f["first_step"], round(f["cost_pct"], 2))
            for f in found["stragglers"]]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--window", type=int, default=100, help="steps per window")
    parser.add_argument("--dir", type=Path, default=None, help="work here (kept)")
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="ranktrace-live-"))
    staging, runs_dir = work / "staging" / store_scale.RUN_ID, work / "runs"
    if not (staging / "run.json").exists():
        start = time.perf_counter()
        store_scale.write_run(staging, args.ranks, args.steps, args.window)
        print(f"wrote {args.ranks} ranks × {args.steps} steps in "
              f"{time.perf_counter() - start:.1f} s (not timed below)")  # fmt: skip
    shutil.rmtree(runs_dir, ignore_errors=True)
    live = runs_dir / store_scale.RUN_ID
    for rank_dir in (staging / names.TELEMETRY_DIR).iterdir():
        (live / names.TELEMETRY_DIR / rank_dir.name).mkdir(parents=True)
        for meta in rank_dir.glob("rank-*.parquet"):
            shutil.copyfile(meta, live / names.TELEMETRY_DIR / rank_dir.name / meta.name)
    record = read_run_json(staging)
    write_run_json(live, {**record, "status": "running"})
    windows = -(-args.steps // args.window)
    seconds = []
    for index in range(windows):
        land_window(staging, live, index)
        seconds.append(timed_ingest(runs_dir, args.window))
        print(f"window {index:3d}: steps 0-{min(args.steps, (index + 1) * args.window) - 1:5d} "
              f"stored, ingest + report {seconds[-1]:6.2f} s", flush=True)  # fmt: skip
    print(f"live findings at the last window: {findings(runs_dir)}")
    write_run_json(live, {**record, "status": "completed"})
    final = timed_ingest(runs_dir, args.window)
    print(f"the run ends: final ingest + report {final:.2f} s; findings {findings(runs_dir)}")
    tail = max(1, windows // 5)
    first, last = sum(seconds[:tail]) / tail, sum(seconds[-tail:]) / tail
    figures = {"ranks": args.ranks, "steps": args.steps, "window": args.window,
               "total_live_s": round(sum(seconds), 1), "first_windows_s": round(first, 2),
               "last_windows_s": round(last, 2), "last_over_first": round(last / first, 2),
               "final_s": round(final, 2)}  # fmt: skip
    print(json.dumps(figures))
    if args.dir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
