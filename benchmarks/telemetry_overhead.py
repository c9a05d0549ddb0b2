"""Cost of telemetry: step time with `--telemetry collectives` vs `off`, and µs per collective.

    python benchmarks/telemetry_overhead.py [--steps 12] [--repeats 3]
    python benchmarks/telemetry_overhead.py --own-time [--repeats 1]

Runs `small` (bf16, global batch 16, 4 micro-batches, sequence 128, synthetic tokens) on
tp×pp×dp = 2×1×2 and 2×2×2 through the real `ranktrace train`, alternating off / collectives
runs in ABBA order so that noise and drift hit both alike, and prints the median step time
(first two steps excluded) of each and their ratio. Then it times, in-process, the recorder's
hot path (one collective = a counter update and a tuple append) and the step-end cost per
collective (its Parquet row; spans are made for steps and phases).

`--own-time`: ranktrace's own recorded time (`steps.ranktrace_s`) per rank of the tp2 dp2 trainer
command over its median step, against the 1% budget, and where it goes (benchmarks/own_time.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import own_time  # noqa: E402
import torch  # noqa: E402
from common import train_small  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402

from ranktrace.telemetry.exporter import (  # noqa: E402
    RankIdentity,
    SegmentSpanProcessor,
    StepContext,
    TelemetrySink,
)
from ranktrace.telemetry.recorder import StepTelemetry  # noqa: E402
from ranktrace.telemetry.timers import WallTimer  # noqa: E402

LAYOUTS = [(2, 1, 2), (2, 2, 2)]  # (tp, pp, dp)


def median_step_time(tp: int, pp: int, dp: int, level: str, steps: int, runs_dir: Path) -> float:
    name = f"{tp}{pp}{dp}-{level}-{time.monotonic_ns()}"
    extra = ("--micro-batches", "4", "--telemetry", level)
    record = train_small(tp, pp, dp, steps, runs_dir, name, *extra)
    return statistics.median(record["step_times_s"][2:])


def hot_path_us(calls: int = 200_000) -> float:
    recorder = StepTelemetry(0, {"tp": 0}, 1, lambda record: None, WallTimer())
    recorder.begin_step(0)
    start = time.perf_counter()
    for i in range(calls):
        recorder.on_comm("all_reduce", "tp", 2, 4096, torch.bfloat16, i, i + 1)
    return (time.perf_counter() - start) / calls * 1e6


def step_end_us_per_collective(collectives: int = 100, steps: int = 200) -> float:
    """Span creation + row per collective at step end, flushing to Parquet every 10 steps."""
    with tempfile.TemporaryDirectory() as directory:
        provider = TracerProvider()
        processor = SegmentSpanProcessor()
        provider.add_span_processor(processor)
        context = StepContext(1.0, 1e12, 0, 0, 0, 0)
        sink = TelemetrySink(
            RankIdentity("bench", 0, 0, 0, 0, "h"),
            context,
            provider,
            processor,
            Path(directory),
            flush_every_steps=10,
        )
        recorder = StepTelemetry(0, {"tp": 0}, 1, sink, WallTimer())
        empty = StepTelemetry(0, {"tp": 0}, 1, sink, WallTimer())
        elapsed = {}
        for label, rec, n in (("with", recorder, collectives), ("without", empty, 0)):
            start = time.perf_counter()
            for step in range(steps):
                rec.begin_step(step)
                for i in range(n):
                    rec.on_comm("all_reduce", "tp", 2, 4096, torch.bfloat16, i, i + 1)
                rec.end_step(loss=1.0, tokens=1)
            sink.flush()
            elapsed[label] = time.perf_counter() - start
        return (elapsed["with"] - elapsed["without"]) / (steps * collectives) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs (default 3; 1 with --own-time)"
    )
    parser.add_argument(
        "--own-time",
        action="store_true",
        help="own time per rank against the 1%% budget, and its breakdown",
    )
    args = parser.parse_args()
    if args.own_time:
        own_time.main(runs=args.repeats or 1)
        return
    args.repeats = args.repeats or 3
    runs_dir = Path(tempfile.mkdtemp(prefix="ranktrace-overhead-"))
    print(
        f"{'tp pp dp':>9} {'off s/step':>11} {'coll s/step':>12} {'ratio':>7}   (medians of "
        f"{args.repeats} interleaved pairs, {args.steps} steps each)"
    )
    for tp, pp, dp in LAYOUTS:
        off, on, ratios = [], [], []
        for repeat in range(args.repeats):
            # ABBA order: drift over the session (thermal, other load) cancels out in pairs.
            order = ("off", "collectives") if repeat % 2 == 0 else ("collectives", "off")
            times = {level: median_step_time(tp, pp, dp, level, args.steps, runs_dir)
                     for level in order}  # fmt: skip
            off.append(times["off"])
            on.append(times["collectives"])
            ratios.append(on[-1] / off[-1])
        print(
            f"{tp:>3}{pp:>3}{dp:>3} {statistics.median(off):>11.4f} "
            f"{statistics.median(on):>12.4f} {statistics.median(ratios):>7.3f}",
            flush=True,
        )
    print(f"hot path: {hot_path_us():.2f} µs per collective (counter + tuple append)")
    print(
        f"step end: {step_end_us_per_collective():.1f} µs per collective "
        f"(its Parquet row; spans are made for steps and phases)"
    )


if __name__ == "__main__":
    main()
