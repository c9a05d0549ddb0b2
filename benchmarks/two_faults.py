"""Two simultaneous faults of different kinds at random ranks: are both named, each on its rank
with its kind and its own saving?

    python benchmarks/two_faults.py [--runs 8] [--seed S] [--factor 1.5] [--steps 30]

Each run draws (seeded by `--seed`, printed) a layout of benchmarks/detection_accuracy.py,
two kinds of compute, link, data and pause, two distinct ranks and a trainer seed; both faults
are sized as that benchmark sizes one (each adds (factor - 1) × the layout's healthy step to
its rank's step, in its kind's part) and start at the same step. A run is a hit when the report
names both: a finding on each injected rank with the injected kind (a link finding may list the
rank among its candidates). Printed per run: the faults, the findings (rank, kind, cost) and
`slowdown_by_cause` (each cause's saving and share); then hits / runs. Target (issue 26): both
named in ≥ 7 of 8.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import detection_accuracy as matrix

from ranktrace.analysis.store import open_reader


def sizing(runs_dir: Path, layout: str, steps: int) -> tuple[float, dict, dict]:
    """(healthy step s, collectives per step by rank, compute s by rank) of a healthy run."""
    name = f"healthy-{layout}"
    matrix.train(runs_dir, name, layout, steps)
    step_s = matrix.report(runs_dir, name)["step_time_s"]
    con = open_reader(runs_dir)
    try:
        calls = dict(con.execute(
            "SELECT rank, median(n) FROM (SELECT rank, step, count(*) AS n FROM collectives c "
            "JOIN runs USING (run_id) WHERE name = ? GROUP BY ALL) GROUP BY rank", [name],
        ).fetchall())  # fmt: skip
        compute = dict(con.execute(
            "SELECT rank, median(work_s) FROM step_breakdown JOIN runs USING (run_id) "
            "WHERE name = ? AND step > 0 GROUP BY rank", [name],
        ).fetchall())  # fmt: skip
    finally:
        con.close()
    return step_s, calls, compute


def named(report: dict, rank: int, kind: str) -> bool:
    """Whether a finding names `rank` with `kind` (a link's candidates count)."""
    wanted = matrix.KINDS[kind]
    return any(f["kind"] == wanted and (f["rank"] == rank or (f["rank"] is None
               and rank in f["candidates"])) for f in report["stragglers"])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=None, help="draws the runs (printed)")
    parser.add_argument("--factor", type=float, default=1.5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layouts", default="1x2x2,2x2x2,1x2x4")
    args = parser.parse_args()
    master = args.seed if args.seed is not None else random.randrange(1 << 16)
    rng = random.Random(master)
    print(f"seed {master}", flush=True)
    hits = 0
    with tempfile.TemporaryDirectory(prefix="two-faults-") as tmp:
        runs_dir, sized = Path(tmp), {}
        for index in range(args.runs):
            layout = rng.choice(args.layouts.split(","))
            if layout not in sized:
                sized[layout] = sizing(runs_dir, layout, args.steps)
            step_s, calls, compute = sized[layout]
            kinds = rng.sample(sorted(matrix.KINDS), 2)
            ranks = rng.sample(range(matrix.world_size(layout)), 2)
            seed = rng.randrange(1, 10**6)
            specs = [matrix.fault_spec(k, r, args.factor, step_s, int(calls[r]), compute[r])
                     for k, r in zip(kinds, ranks, strict=True)]  # fmt: skip
            name = f"two-{index}-{layout}"
            injects = [a for spec in specs for a in ("--inject", spec)]
            matrix.train(runs_dir, name, layout, args.steps, "--seed", str(seed), *injects)
            report = matrix.report(runs_dir, name)
            both = all(named(report, r, k) for k, r in zip(kinds, ranks, strict=True))
            hits += both
            found = [(f["rank"] if f["rank"] is not None else f["candidates"], f["kind"],
                      round(f["cost_pct"], 1)) for f in report["stragglers"]]  # fmt: skip
            causes = [(c["cause"], round(c["saved_pct"], 1), c.get("share_pct"))
                      for c in report["slowdown_by_cause"]]  # fmt: skip
            print(f"{name} seed {seed}: {'; '.join(specs)} -> {'both' if both else 'MISSED'}: "
                  f"findings {found}, imbalances "
                  f"{[(i['kind'], i['stage']) for i in report['imbalances']]}, causes {causes}",
                  flush=True)  # fmt: skip
    print(f"both faults named in {hits}/{args.runs} runs (target >= 7 of 8)")


if __name__ == "__main__":
    main()
