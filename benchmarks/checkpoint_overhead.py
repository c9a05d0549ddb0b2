"""Cost of checkpoints: mean step time with a checkpoint every N steps (async and sync) vs none.

    python benchmarks/checkpoint_overhead.py [--steps 30] [--every 5] [--repeats 2]

Trains `small` (bf16 with fp32 master weights and Adam state: ~70 MB of state per save, see
the bytes column) on tp×pp×dp = 1×1×2 and 2×1×2 through the real `ranktrace train`, in the
order none, async, sync, then reversed on the next repeat, so that drift hits all three alike.
The mean step time (first two steps excluded; a checkpoint step counts like any other) of each
mode is the median over repeats; the ratios to `none` are the overhead of the cadence. Per
save it prints the blocking part (the step waits: staging a copy; the whole write when sync),
the background part, and the bytes written, from the run's `checkpoint_saved` events.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import duckdb  # noqa: E402
from common import train_small  # noqa: E402

from ranktrace.analysis.store import store_path  # noqa: E402

LAYOUTS = [(1, 1, 2), (2, 1, 2)]  # (tp, pp, dp)
MODES = ("none", "async", "sync")


def _save_figures(runs_dir: Path, run_id: str) -> tuple[float, float, float]:
    """Median over saves of (blocking s, background s, bytes), the slowest rank per save."""
    con = duckdb.connect(str(store_path(runs_dir)), read_only=True)
    try:
        rows = con.execute(
            "SELECT detail FROM events WHERE run_id = ? AND kind = 'checkpoint_saved'", [run_id]
        ).fetchall()
    finally:
        con.close()
    saves: dict[int, list[dict]] = {}
    for (detail,) in rows:
        save = json.loads(detail)
        saves.setdefault(save["next_step"], []).append(save)
    blocking = [max(s["blocking_s"] for s in group) for group in saves.values()]
    background = [max(s["async_s"] for s in group) for group in saves.values()]
    written = [sum(s["bytes"] for s in group) for group in saves.values()]
    return statistics.median(blocking), statistics.median(background), statistics.median(written)


def run_mode(layout, mode: str, steps: int, every: int, runs_dir: Path) -> tuple[float, tuple]:
    tp, pp, dp = layout
    extra: tuple[str, ...] = ()
    if mode != "none":
        extra = ("--checkpoint-every", str(every), "--checkpoint-keep", "1")
        extra += ("--checkpoint-sync",) if mode == "sync" else ()
    name = f"{tp}{pp}{dp}-{mode}-{time.monotonic_ns()}"
    record = train_small(tp, pp, dp, steps, runs_dir, name, *extra)
    mean_step = statistics.mean(record["step_times_s"][2:])
    figures = _save_figures(runs_dir, record["run_id"]) if mode != "none" else ()
    return mean_step, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"small, {args.steps} steps, a checkpoint every {args.every} steps (keep 1); "
          f"mean step time, median of {args.repeats} repeats")  # fmt: skip
    header = (f"{'layout':>7} {'mode':>6} {'step ms':>8} {'ratio':>6} {'blocking ms':>12} "
              f"{'background ms':>14} {'MB/save':>8}")  # fmt: skip
    print(header)
    with tempfile.TemporaryDirectory() as tmp:
        runs_dir = Path(tmp) / "runs"
        for layout in LAYOUTS:
            times: dict[str, list[float]] = {mode: [] for mode in MODES}
            figures: dict[str, list[tuple]] = {mode: [] for mode in MODES}
            for repeat in range(args.repeats):
                order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    step, saved = run_mode(layout, mode, args.steps, args.every, runs_dir)
                    times[mode].append(step)
                    figures[mode].append(saved)
            base = statistics.median(times["none"])
            name = "x".join(map(str, layout))
            for mode in MODES:
                step = statistics.median(times[mode])
                cols = ""
                if figures[mode][0]:
                    blocking, background, written = (
                        statistics.median(f[i] for f in figures[mode]) for i in range(3)
                    )
                    cols = (f" {blocking * 1e3:>12.1f} {background * 1e3:>14.1f} "
                            f"{written / 1e6:>8.1f}")  # fmt: skip
                print(f"{name:>7} {mode:>6} {step * 1e3:>8.1f} {step / base:>6.3f}{cols}")
    print("ratio: mean step time / mean step time without checkpoints (same layout)")


if __name__ == "__main__":
    main()
