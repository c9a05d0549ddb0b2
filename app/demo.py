"""`ranktrace demo`: the main job on embedded defaults, sized for a laptop CPU (a few minutes on
two cores): a one-axis sweep (tp 1 -> 2 at pp=2, dp=2), then a 3D run (tp=2 pp=2 dp=2, ZeRO-1)
with a compute straggler injected on one rank, all with telemetry into the runs dir's store;
the sweep table and the straggler run's report are printed, then the dashboard is served.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from ranktrace.trainer.config import TrainConfig

STRAGGLER_RANK = 5
STRAGGLER_FACTOR = 3
"""A compute fault of factor 3: where bf16 matmuls run through fp32 (trainer/cpu_bf16.py),
compute is a smaller share of the step, and factor 2 dropped the MFU by 19% against step-to-
step noise that sometimes hid the drop (factor 3: 32-41%)."""
STRAGGLER_FROM = 8
"""The fault's first step: 7 steps after the warm-up step and 16 with the fault, each side more
than the efficiency analysis' least segment (5 steps)."""
BASE = TrainConfig(
    tp=1, pp=2, dp=2, zero=1, model="small", steps=12, global_batch=16, micro_batches=4,
    seq_len=128, log_every=5,
)  # fmt: skip
"""The sweep's runs: 12 steps give the sweep table 11 after the warm-up step; the straggler run
is BASE at tp=2 with more steps and the fault."""
STRAGGLER = dataclasses.replace(
    BASE, tp=2, steps=24, run_name="demo-straggler",
    inject=[f"compute:rank={STRAGGLER_RANK},factor={STRAGGLER_FACTOR},from={STRAGGLER_FROM}"],
)  # fmt: skip
SWEEP_VALUES = [1, 2]


def demo_configs(runs_dir: str) -> tuple[list[TrainConfig], TrainConfig]:
    """(the sweep's configs, the straggler run's config), validated, under `runs_dir`."""
    from ranktrace.app.sweep import sweep_configs

    base = dataclasses.replace(BASE, runs_dir=runs_dir, run_name="demo")
    sweep = sweep_configs(base, "tp", SWEEP_VALUES)
    straggler = dataclasses.replace(STRAGGLER, runs_dir=runs_dir)
    straggler.validate()
    return sweep, straggler


def run_demo(runs_dir: str) -> tuple[int, list[str], str | None]:
    """Train the demo's runs one after another, printing progress; returns (exit code, the
    sweep's run ids, the straggler run's id)."""
    from ranktrace.app.jobs import launch_and_ingest

    sweep, straggler = demo_configs(runs_dir)
    jobs = [*sweep, straggler]
    started = time.perf_counter()
    for index, cfg in enumerate(jobs, start=1):
        what = (f"sweep point tp={cfg.tp}" if cfg is not straggler
                else f"a run with an injected straggler ({cfg.inject[0]})")  # fmt: skip
        print(f"\n== demo {index}/{len(jobs)}: {what}, {cfg.world_size} ranks "
              f"(tp={cfg.tp} pp={cfg.pp} dp={cfg.dp}), {cfg.steps} steps of `{cfg.model}` "
              f"[{time.perf_counter() - started:.0f} s so far]", flush=True)  # fmt: skip
        if launch_and_ingest(cfg) != 0:
            print(f"ranktrace demo: error: the {cfg.run_name} run failed; demo stopped")
            return 1, [], None
    return 0, [cfg.run_id for cfg in sweep], straggler.run_id


def print_results(runs_dir: Path, sweep_ids: list[str], straggler_id: str) -> None:
    """The sweep table and the straggler run's report."""
    from ranktrace.analysis.run import cached_report
    from ranktrace.analysis.store import open_reader
    from ranktrace.app.output import render
    from ranktrace.app.report_text import format_report
    from ranktrace.app.sweep import sweep_table

    con = open_reader(runs_dir)
    try:
        columns, rows = sweep_table(con, sweep_ids, "tp")
        report = cached_report(con, straggler_id)
    finally:
        con.close()
    print("\n== one-axis sweep of tp (pp=2, dp=2, everything else fixed):")
    print(render(columns, rows, "table"))
    print(f"\n== report of the straggler run (rank {STRAGGLER_RANK} was made {STRAGGLER_FACTOR}x "
          f"slow in compute from step {STRAGGLER_FROM}):")  # fmt: skip
    print(format_report(report))
