"""The store at scale: a synthetic run of 1,024 ranks × 1,000 steps × 20 spans per rank-step,
written as real per-rank Parquet segments, ingested, and queried.

    python benchmarks/store_scale.py [--ranks 1024] [--steps 1000] [--window 100]
                                     [--workers 1] [--dir /tmp/store-scale] [--keep-segments]
                                     [--read-floor]

Each rank's segments hold one window of steps each (a rank flushing once a window). Timed:
`ranktrace ingest --window W` (which also computes and stores the report) and
`ranktrace report --json`, each a process of its own, with the peak resident memory of its
process tree; writing the segments is not timed.

Layout tp=8 × pp=8 × dp=16 (for 1,024 ranks). Each rank-step has 1 step span, 6 phase spans and
13 collective spans (8 tp all-reduces, 2 pp transfers, 2 dp bucket all-reduces, 1 world
all-reduce) with sequence numbers that line up across each group, as the trainer writes them.
The steps are a synchronous job's (`synchronous_timeline`): rank 5 does 30% more work from the
middle step on, and its groups' other members wait for it in their collectives, so the replay
reproduces the recorded steps. Prints: write time, ingest rows/s, store size, and
the time of the summary queries (per-step max/median/argmax rank; a rank × step heatmap of the
last 200 steps) and of the whole report; with --read-floor, the time DuckDB takes to read every
value of the segments once (the floor under any ingest of them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import run_measured  # noqa: E402

from ranktrace.analysis.store import open_reader, query, store_path  # noqa: E402
from ranktrace.analysis.windows import DEFAULT_WINDOW_STEPS, windows_root  # noqa: E402
from ranktrace.telemetry import names  # noqa: E402
from ranktrace.telemetry.exporter import write_segment  # noqa: E402
from ranktrace.telemetry.run_record import write_run_json  # noqa: E402
from ranktrace.telemetry.schema import RANK_SCHEMA, SPAN_SCHEMA, STEP_SCHEMA  # noqa: E402
from ranktrace.trainer.mesh import coordinates_of  # noqa: E402

RUN_ID = "synthetic-scale"
STEP_NS = 100_000_000  # 100 ms steps
COLLECTIVES = [("tp", "all_reduce", 4 << 20)] * 8 + [("pp", "send_recv", 8 << 20)] * 2 + [
    ("dp", "all_reduce", 64 << 20)] * 2 + [("world", "all_reduce", 8)]  # fmt: skip


def layout_for(ranks: int) -> tuple[int, int, int]:
    tp = 8 if ranks % 8 == 0 else 1
    pp = 8 if (ranks // tp) % 8 == 0 else 1
    return tp, pp, ranks // (tp * pp)


SLOW_RANK, SLOW_FACTOR = 5, 1.3
"""Rank 5's work is 30% more from the run's middle step on (the straggler the report must
find)."""
TRANSFER_NS = 1_000_000
"""Every collective moves its data in 1 ms once its last member has arrived."""
PHASE_ENDS = {"data": None, "forward": 3, "backward": 7, "pipeline_wait": 9, "grad_sync": 11}
"""Each phase ends where the collective of that index ends (forward holds tp all-reduces 0-3,
backward 4-7, the pipeline's transfers 8-9, the gradient all-reduces 10-11); data is the first
half of the first chunk of work, and the optimizer (the world all-reduce) runs to the step's
end."""


_GROUP_AXES = {"tp": (3,), "dp": (2,), "pp": (1,), "world": (1, 2, 3)}
"""The axes of a [steps, pp, dp, tp] array a group of each kind spans (tp innermost)."""


def synchronous_timeline(steps: np.ndarray, tp: int, pp: int, dp: int, slow_from: int) -> dict:
    """The steps of a synchronous job, every rank at once: each rank's work per step (100 ms,
    ±2% noise; rank 5 30% more from step `slow_from`) in 14 equal chunks, one before each collective
    of COLLECTIVES and one after; a collective starts when its rank arrives and ends 1 ms
    after the last member of its group arrives (its peers wait for a slow rank, as in a real
    job). Returns, in ns from each step's start, [steps, ranks] arrays: `arrive` and `end` per
    collective, and `step_end`. Seeded by the first step, so a segment is the same whoever
    writes it."""
    ranks = tp * pp * dp
    rng = np.random.default_rng(int(steps[0]))
    work = STEP_NS * (1 + 0.02 * rng.standard_normal((len(steps), ranks)))
    if ranks > SLOW_RANK:
        work[steps >= slow_from, SLOW_RANK] *= SLOW_FACTOR
    chunk = work / (len(COLLECTIVES) + 1)
    clock = np.zeros_like(work)
    arrive, end = [], []
    for axis, _, _ in COLLECTIVES:
        here = clock + chunk + rng.integers(0, 200_000, work.shape)
        last = here.reshape(len(steps), pp, dp, tp).max(axis=_GROUP_AXES[axis], keepdims=True)
        clock = np.broadcast_to(last, (len(steps), pp, dp, tp)).reshape(here.shape) + TRANSFER_NS
        arrive.append(here.astype(np.int64))
        end.append(clock.astype(np.int64))
    return {"arrive": arrive, "end": end, "step_end": (clock + chunk).astype(np.int64),
            "first_chunk": chunk.astype(np.int64)}  # fmt: skip


def rank_tables(rank: int, steps: np.ndarray, tp: int, pp: int, dp: int, timeline: dict,
                slow_from: int):  # fmt: skip
    """(steps table, spans table) of one rank for the given steps, from their
    `synchronous_timeline`."""
    c = coordinates_of(rank, pp, dp, tp)
    n = len(steps)
    start = steps * 2 * STEP_NS
    step_time = timeline["step_end"][:, rank]
    group_ids = {"tp": rank - c.tp, "pp": rank - c.pp * dp * tp, "dp": rank - c.dp * tp,
                 "world": 0}  # fmt: skip
    spans = {k: [] for k in SPAN_SCHEMA.names}

    def add(name, offsets, duration, **attrs):
        spans["name"].append(np.full(n, name, dtype=object))
        spans["start_ns"].append(start + offsets)
        spans["end_ns"].append(start + offsets + duration)
        for key in ("phase", "op", "axis", "dtype"):
            spans[key].append(np.full(n, attrs.get(key), dtype=object))
        for key in ("micro_batch", "group_id", "group_size", "seq", "peer", "bytes", "wait_ns",
                    "core_wait_start_ns", "core_wait_end_ns", "tokens"):  # fmt: skip
            value = attrs.get(key)
            spans[key].append(value if isinstance(value, np.ndarray) else np.full(n, value))

    add(names.STEP_SPAN, 0, step_time)
    bounds = [timeline["first_chunk"][:, rank] // 2]  # the end of each phase, in order
    bounds += [timeline["end"][index][:, rank] for index in list(PHASE_ENDS.values())[1:]]
    bounds.append(step_time)
    phase_start = np.zeros(n, dtype=np.int64)
    for phase, phase_end in zip(names.PHASES[:6], bounds, strict=True):
        add(names.PHASE_SPAN, phase_start, phase_end - phase_start, phase=phase, micro_batch=-1)
        phase_start = phase_end
    phase_seconds = np.diff(np.stack([np.zeros(n, dtype=np.int64), *bounds]), axis=0) / 1e9
    axis_count: dict[str, int] = {}
    per_step = {axis: sum(1 for a, _, _ in COLLECTIVES if a == axis) for axis, _, _ in COLLECTIVES}
    for k, (axis, op, nbytes) in enumerate(COLLECTIVES):
        seq = steps * per_step[axis] + axis_count.get(axis, 0)
        axis_count[axis] = axis_count.get(axis, 0) + 1
        arrive, end = timeline["arrive"][k][:, rank], timeline["end"][k][:, rank]
        add(names.COLLECTIVE_SPAN, arrive, end - arrive, op=op, axis=axis,
            group_id=group_ids[axis], group_size={"tp": tp, "pp": pp, "dp": dp,
                                                  "world": tp * pp * dp}[axis],
            seq=seq, peer=-1, bytes=nbytes, dtype="bfloat16")  # fmt: skip
    total = len(spans["name"]) * n
    span_table = pa.table({
        "run_id": pa.array(np.full(total, RUN_ID, dtype=object), pa.string()),
        "rank": pa.array(np.full(total, rank), pa.int32()),
        "step": pa.array(np.tile(steps, len(spans["name"])), pa.int64()),
        "span_id": pa.array(np.arange(total, dtype=np.uint64) + (rank << 40), pa.uint64()),
        "parent_span_id": pa.nulls(total, pa.uint64()),
        "attempt": pa.array(np.zeros(total, np.int32), pa.int32()),
        **{k: pa.array(np.concatenate(v), SPAN_SCHEMA.field(k).type) for k, v in spans.items()
           if k not in ("run_id", "rank", "step", "span_id", "parent_span_id", "attempt")},
    }).select(SPAN_SCHEMA.names)  # fmt: skip
    slow = SLOW_FACTOR if rank == SLOW_RANK else 1.0
    step_columns = {f.name: pa.nulls(n, f.type) for f in STEP_SCHEMA}
    step_columns.update({
        "run_id": pa.array(np.full(n, RUN_ID, dtype=object), pa.string()),
        "rank": pa.array(np.full(n, rank), pa.int32()),
        "pp": pa.array(np.full(n, c.pp), pa.int32()),
        "dp": pa.array(np.full(n, c.dp), pa.int32()),
        "tp": pa.array(np.full(n, c.tp), pa.int32()),
        "step": pa.array(steps, pa.int64()), "start_ns": pa.array(start, pa.int64()),
        "end_ns": pa.array(start + step_time, pa.int64()),
        "step_time_s": pa.array(step_time / 1e9, pa.float64()),
        **{f"{phase}_s": pa.array(seconds, pa.float64())
           for phase, seconds in zip(names.PHASES[:6], phase_seconds, strict=True)},
        "tokens": pa.array(np.full(n, 4096), pa.int64()),
        "mfu": pa.array(np.where(steps >= slow_from, 0.4 / slow, 0.4), pa.float64()),
    })  # fmt: skip
    return pa.table(step_columns).select(STEP_SCHEMA.names), span_table


def write_run(run_dir: Path, ranks: int, steps: int, segment_steps: int = 100,
              slow_from: int | None = None) -> int:  # fmt: skip
    """The synthetic run's run.json and every rank's segments of `segment_steps` steps under
    `run_dir` (rank 5 slow from step `slow_from`, steps // 2 unless given); the rows written."""
    tp, pp, dp = layout_for(ranks)
    slow_from = steps // 2 if slow_from is None else slow_from
    write_run_json(run_dir, {"run_id": RUN_ID, "name": RUN_ID, "status": "completed",
                             "layout": {"tp": tp, "pp": pp, "dp": dp, "zero": 1},
                             "world_size": ranks, "steps": steps, "losses": []})  # fmt: skip
    rows = 0
    for rank in range(ranks):
        directory = run_dir / names.TELEMETRY_DIR / names.rank_dir_name(rank)
        c = coordinates_of(rank, pp, dp, tp)
        meta = {"run_id": RUN_ID, "rank": rank, "pp": c.pp, "dp": c.dp, "tp": c.tp,
                "host": f"node{rank // 8}", "clock_offset_ns": 0}  # fmt: skip
        write_segment(directory, "rank", 0, pa.Table.from_pylist([meta], schema=RANK_SCHEMA))
    for index, first in enumerate(range(0, steps, segment_steps)):
        step_ids = np.arange(first, min(steps, first + segment_steps))
        timeline = synchronous_timeline(step_ids, tp, pp, dp, slow_from)
        for rank in range(ranks):
            directory = run_dir / names.TELEMETRY_DIR / names.rank_dir_name(rank)
            step_table, span_table = rank_tables(rank, step_ids, tp, pp, dp, timeline,
                                                 slow_from)  # fmt: skip
            write_segment(directory, "spans", index, span_table)
            write_segment(directory, "steps", index, step_table)
            rows += step_table.num_rows + span_table.num_rows
    return rows


def read_every_segment(run_dir: Path) -> dict[str, float]:
    """{kind: seconds for DuckDB to read every value of the run's segments of that kind once}
    (each column's max): the floor under any ingest that reads the segments."""
    import duckdb

    con = duckdb.connect()
    con.execute("SET enable_progress_bar = false")
    seconds = {}
    try:
        for kind in ("spans", "steps"):
            pattern = run_dir / names.TELEMETRY_DIR / "rank=*" / f"{kind}-*.parquet"
            start = time.perf_counter()
            con.execute(f"SELECT max(COLUMNS(*)) FROM read_parquet('{pattern}', "
                        "hive_partitioning = false)").fetchall()  # fmt: skip
            seconds[kind] = time.perf_counter() - start
    finally:
        con.close()
    return seconds


def timed(con, sql: str) -> tuple[float, int]:
    start = time.perf_counter()
    _, rows = query(con, sql)
    return time.perf_counter() - start, len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW_STEPS,
                        help="steps per window (and per segment)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=1, help="ranktrace ingest --workers")
    parser.add_argument("--dir", type=Path, default=None, help="keep the store here")
    parser.add_argument("--keep-segments", action="store_true",
                        help="ingest the segments already in --dir (written by an earlier run "
                        "with the same --ranks, --steps and --window)")  # fmt: skip
    parser.add_argument("--read-floor", action="store_true",
                        help="also time reading every segment once (what any ingest of them "
                        "costs at least)")  # fmt: skip
    args = parser.parse_args()
    runs_dir = args.dir or Path(tempfile.mkdtemp(prefix="ranktrace-scale-"))
    store_path(runs_dir).unlink(missing_ok=True)
    shutil.rmtree(windows_root(runs_dir), ignore_errors=True)
    if not args.keep_segments:
        shutil.rmtree(runs_dir / RUN_ID, ignore_errors=True)
        start = time.perf_counter()
        rows = write_run(runs_dir / RUN_ID, args.ranks, args.steps, args.window)
        print(f"wrote {rows:,} segment rows for {args.ranks} ranks × {args.steps} steps "
              f"in {time.perf_counter() - start:.1f} s (not timed below)")  # fmt: skip
    cli = [sys.executable, "-m", "ranktrace.app.cli"]
    ingest_s, ingest_peak, out = run_measured([*cli, "ingest", "--runs-dir", str(runs_dir),
                                               "--window", str(args.window), "--workers",
                                               str(args.workers)])  # fmt: skip
    print(f"ranktrace ingest --window {args.window} --workers {args.workers}: {ingest_s:.1f} s, "
          f"peak {ingest_peak / 2**30:.2f} GiB ({out.strip().splitlines()[-1]})")  # fmt: skip
    report_s, report_peak, out = run_measured(
        [*cli, "report", RUN_ID, "--runs-dir", str(runs_dir), "--json"]
    )
    found = json.loads(out)
    print(f"ranktrace report --json: {report_s:.1f} s, peak {report_peak / 2**30:.2f} GiB; "
          f"S {found['slowdown']:.3f}, stragglers "
          f"{[(f['rank'], f['kind'], f['cost_pct']) for f in found['stragglers']]}")  # fmt: skip
    print(f"together: {ingest_s + report_s:.1f} s, peak "
          f"{max(ingest_peak, report_peak) / 2**30:.2f} GiB")  # fmt: skip
    window_bytes = sum(p.stat().st_size for p in windows_root(runs_dir).rglob("*.parquet"))
    print(f"store: catalog {store_path(runs_dir).stat().st_size / 2**20:.0f} MiB, "
          f"windows {window_bytes / 2**20:.0f} MiB")  # fmt: skip
    con = open_reader(runs_dir)
    try:
        last = args.steps - 200
        queries = {
            "per-step max/median/argmax rank": "SELECT step, max(step_time_s), "
            "median(step_time_s), arg_max(rank, step_time_s) FROM steps GROUP BY step",
            "heatmap rank × last 200 steps": "SELECT rank, step, step_time_s FROM steps "
            f"WHERE run_id = '{RUN_ID}' AND step >= {last}",
            "step_stats view, last 200 steps": f"SELECT * FROM step_stats WHERE step >= {last}",
        }
        for label, sql in queries.items():
            seconds, count = timed(con, sql)
            print(f"query {label}: {seconds:.3f} s ({count:,} rows)")
    finally:
        con.close()
    if args.read_floor:
        floor = read_every_segment(runs_dir / RUN_ID)
        print(
            f"reading every segment once: {sum(floor.values()):.1f} s ("
            + ", ".join(f"{kind} {s:.1f} s" for kind, s in floor.items())
            + ")"
        )
    if args.dir is None:
        shutil.rmtree(runs_dir)


if __name__ == "__main__":
    main()
