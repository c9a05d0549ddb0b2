"""How well `ranktrace report` finds injected stragglers: precision, recall, kind accuracy,
detection delay and false positives over a matrix of real runs, by kind and by position in the
mesh; false findings on healthy runs with fresh seeds; and the time to diagnose the synthetic
1,024-rank store.

    python benchmarks/detection_accuracy.py [--factors 1.3,2] [--repeats 2] [--seed S]
        [--healthy-runs 20] [--steps 30] [--layouts 1x2x2,...] [--kinds compute,...]
        [--skip-runs] [--skip-scale]

Matrix (kept on disk; `--rescore DIR` diagnoses it again with the current analysis): layouts
tp×pp×dp 1×2×2, 2×2×1, 2×2×2, 1×2×4 (tiny model, 30 steps, faults from step 10) × kinds
compute, link, data, pause × the given slowdown factors × `--repeats`, the injected rank drawn
at random for each run (seeded by `--seed`, printed; it is in the run's name), plus one healthy
run per layout to size the faults. `--healthy-runs N` more healthy runs, spread over the
layouts, each with its own `--seed` for the trainer: every finding or imbalance on them is false.
A factor F adds (F - 1) × the healthy step time to the injected rank's step, in its kind's part:
compute slowed by 1 + (F - 1) × step / the rank's healthy compute time (the --inject factor);
a data delay, or link delays spread over the rank's collectives of one step, of (F - 1) × the
healthy step time; pauses of 2 × (F - 1) × the healthy step time every 4 steps. (An earlier
version slowed compute by F itself: with compute ~40% of a step here, a third of the others'
fault, which cost the job 0-8% and the replay priced under the 5% reporting threshold.)
A run is a hit when a finding names the injected rank with the injected kind (recall: hits /
runs). A finding is right when it names the injected rank, or lists it among the candidates of a
link no timing can locate (precision: right / findings). Printed per factor (the target, ≥ 0.95,
is for factors ≥ 1.3).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ranktrace.analysis import stragglers  # noqa: E402
from ranktrace.analysis.ingest import ingest  # noqa: E402
from ranktrace.analysis.store import open_reader  # noqa: E402

LAYOUTS = {
    "1x2x2": ("--pp", "2", "--dp", "2"),  # 2 peers per stage: each rank's reference is 1 rank
    "2x2x1": ("--tp", "2", "--pp", "2"),  # 2 peers per stage, the tp pair
    "2x2x2": ("--tp", "2", "--pp", "2", "--dp", "2"),  # 4 peers per stage
    "1x2x4": ("--pp", "2", "--dp", "4"),  # 4 peers per stage
}
ONSET = 10


def world_size(layout: str) -> int:
    tp, pp, dp = (int(n) for n in layout.split("x"))
    return tp * pp * dp


def ranktrace(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ranktrace.app.cli", *args], cwd=REPO, text=True,
                          capture_output=True, env=env)  # fmt: skip


def train(runs_dir: Path, name: str, layout: str, steps: int, *extra: str) -> None:
    result = ranktrace("train", *LAYOUTS[layout], "--steps", str(steps), "--run-name", name,
                       "--runs-dir", str(runs_dir), *extra)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed: {result.stderr[-500:]}")


def report(runs_dir: Path, name: str) -> dict:
    result = ranktrace("report", name, "--runs-dir", str(runs_dir), "--json")
    return json.loads(result.stdout)


def fault_spec(kind: str, rank: int, factor: float, step_s: float, collectives: int,
               compute_s: float) -> str:  # fmt: skip
    """The --inject spec adding (factor - 1) × the healthy step time `step_s` to `rank`'s step
    in the kind's own part (`compute_s`: the rank's healthy compute time per step)."""
    extra_s = (factor - 1.0) * step_s
    if kind == "compute":
        return f"compute:rank={rank},factor={1.0 + extra_s / compute_s:.3f},from={ONSET}"
    if kind == "data":
        return f"data:rank={rank},delay={extra_s:.4f},from={ONSET}"
    if kind == "link":
        return f"link:rank={rank},delay={extra_s / collectives:.5f},from={ONSET}"
    return f"pause:rank={rank},every=4,duration={2 * extra_s:.4f},from={ONSET}"


KINDS = {"compute": "compute", "link": "communication", "data": "data", "pause": "host"}


def run_matrix(runs_dir: Path, factors: list[float], steps: int, layouts: list[str],
               repeats: int, rng: random.Random, kinds: list[str]) -> None:  # fmt: skip
    """Train the healthy and injected runs of the matrix into `runs_dir`; each injected run's
    rank drawn from `rng` (named `KIND-FACTOR-LAYOUT-rRANK-REPEAT`)."""
    for layout in layouts:
        train(runs_dir, f"healthy-{layout}", layout, steps)
        step_s = report(runs_dir, f"healthy-{layout}")["step_time_s"]
        con = open_reader(runs_dir)
        calls = dict(con.execute(
            "SELECT rank, median(n) FROM (SELECT rank, step, count(*) AS n FROM collectives c "
            "JOIN runs USING (run_id) WHERE name = ? GROUP BY ALL) GROUP BY rank",
            [f"healthy-{layout}"],
        ).fetchall())  # fmt: skip
        compute = dict(con.execute(
            "SELECT rank, median(work_s) FROM step_breakdown JOIN runs USING (run_id) "
            "WHERE name = ? AND step > 0 GROUP BY rank", [f"healthy-{layout}"],
        ).fetchall())  # fmt: skip
        con.close()
        print(f"{layout}: healthy step {step_s * 1e3:.1f} ms", flush=True)
        for kind in kinds:
            for factor in factors:
                for repeat in range(repeats):
                    rank = rng.randrange(world_size(layout))
                    spec = fault_spec(kind, rank, factor, step_s, int(calls[rank]), compute[rank])
                    name = f"{kind}-{factor}-{layout}-r{rank}-{repeat}"
                    train(runs_dir, name, layout, steps, "--inject", spec)
                    print(f"  trained {name}: {spec}", flush=True)


def run_healthy(runs_dir: Path, count: int, steps: int, layouts: list[str],
                rng: random.Random) -> None:  # fmt: skip
    """`count` healthy runs over `layouts` in turn, each with a fresh trainer seed."""
    for index in range(count):
        layout, seed = layouts[index % len(layouts)], rng.randrange(1, 10**6)
        name = f"fresh-{layout}-s{seed}"
        train(runs_dir, name, layout, steps, "--seed", str(seed))
        print(f"  trained {name}", flush=True)


def score(runs_dir: Path) -> None:
    """Diagnose every run of a matrix in `runs_dir` and print the tallies. A finding is right
    when it names the injected rank, or (a link no timing can locate) lists it as a candidate;
    a hit names the injected rank with the injected kind."""
    con = open_reader(runs_dir)
    names = [row[0] for row in con.execute("SELECT name FROM runs ORDER BY started_at").fetchall()]
    con.close()
    by_factor: dict[float, dict] = {}
    by_kind: dict[str, dict] = {}
    by_position: dict[tuple[str, int], dict] = {}
    healthy_runs = false_findings = false_imbalances = 0
    for name in names:
        kind, *rest = name.split("-")
        result = report(runs_dir, name)
        findings = result["stragglers"]
        if kind in ("healthy", "fresh"):
            healthy_runs += 1
            false_findings += len(findings)
            false_imbalances += len(result["imbalances"])
            if findings or result["imbalances"]:
                said = [f"rank {f['rank']} {f['kind']} {f['slowdown']}x {f['cost_pct']}%"
                        for f in findings]  # fmt: skip
                said += [f"{i['kind']} imbalance" for i in result["imbalances"]]
                print(f"  {name:28} -> " + ", ".join(said))
            continue
        factor, layout, rank = float(rest[0]), rest[1], int(rest[2].removeprefix("r"))
        hit = [f for f in findings if f["rank"] == rank and f["kind"] == KINDS[kind]]
        right = sum(f["rank"] == rank or (f["rank"] is None and rank in f["candidates"])
                    for f in findings)  # fmt: skip
        tallies = [by_factor.setdefault(factor, _tally())]
        if factor >= 1.3:
            tallies += [by_kind.setdefault(kind, _tally()),
                        by_position.setdefault((layout, rank), _tally())]  # fmt: skip
        for tally in tallies:
            tally["runs"] += 1
            tally["findings"] += len(findings)
            tally["right"] += right
            tally["right_rank"] += sum(f["rank"] == rank for f in findings)
            if hit:
                tally["hits"] += 1
                tally["delays"].append(hit[0]["first_step"] - ONSET)
        print(f"  {name:28} -> " + (", ".join(
            f"rank {f['rank'] if f['rank'] is not None else f['candidates']} {f['kind']} "
            f"from {f['first_step']}" for f in findings) or "nothing"))  # fmt: skip
    print(f"\n{'factor':>6} {'recall':>7} {'precision':>9} {'kind acc':>8} {'delay':>6} "
          f"{'max delay':>9}")  # fmt: skip
    for factor, t in sorted(by_factor.items()):
        recall, precision = _rates(t)
        kind_accuracy = t["hits"] / t["right_rank"] if t["right_rank"] else 0.0
        delays = t["delays"] or [float("nan")]
        print(f"{factor:>6} {recall:>7.2f} {precision:>9.2f} {kind_accuracy:>8.2f} "
              f"{sum(delays) / len(delays):>6.1f} {max(delays, key=abs):>9}")  # fmt: skip
    print("\nfactors >= 1.3, by kind:")
    for kind, t in by_kind.items():
        recall, precision = _rates(t)
        print(f"  {kind:8} recall {t['hits']}/{t['runs']} = {recall:.2f}, precision "
              f"{t['right']}/{t['findings']} = {precision:.2f}")  # fmt: skip
    print("factors >= 1.3, by position (layout tp x pp x dp, rank): hits/runs, right/findings")
    for (layout, rank), t in sorted(by_position.items()):
        print(f"  {layout} rank {rank}: {t['hits']}/{t['runs']}, {t['right']}/{t['findings']}")
    pooled = [t for factor, t in by_factor.items() if factor >= 1.3]
    hits, runs = sum(t["hits"] for t in pooled), sum(t["runs"] for t in pooled)
    right, found = sum(t["right"] for t in pooled), sum(t["findings"] for t in pooled)
    print(f"factors >= 1.3 pooled: recall {hits}/{runs} = {hits / max(runs, 1):.2f}, precision "
          f"{right}/{found} = {right / max(found, 1):.2f} (target 0.95)")  # fmt: skip
    print(f"healthy runs: {healthy_runs}, false stragglers {false_findings}, false imbalances "
          f"{false_imbalances}")  # fmt: skip


def _tally() -> dict:
    return {"hits": 0, "runs": 0, "findings": 0, "right": 0, "right_rank": 0, "delays": []}


def _rates(tally: dict) -> tuple[float, float]:
    """(recall, precision) of a tally."""
    recall = tally["hits"] / tally["runs"] if tally["runs"] else 0.0
    precision = tally["right"] / tally["findings"] if tally["findings"] else 1.0
    return recall, precision


def scale_detection() -> None:
    """Plant rank 5 at 1.3x from step 500 in the 1,024-rank synthetic store; time the report."""
    from store_scale import write_run

    from ranktrace.analysis.run import report as run_report

    runs_dir = Path(tempfile.mkdtemp(prefix="ranktrace-detect-scale-"))
    write_run(runs_dir / "synthetic-scale", 1024, 1000)
    ingest(runs_dir)
    con = open_reader(runs_dir)
    start = time.perf_counter()
    result = run_report(con, "synthetic-scale")
    elapsed = time.perf_counter() - start
    con.close()
    found = [(f["rank"], f["kind"], f["first_step"]) for f in result["stragglers"]]
    print(f"1,024 ranks × 1,000 steps: report in {elapsed:.2f} s; findings {found} "
          f"(planted: rank 5, compute, from 500)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factors", default="1.3,2")
    parser.add_argument("--repeats", type=int, default=2, help="runs per kind, factor, layout")
    parser.add_argument("--seed", type=int, default=None, help="of the draws (default: random)")
    parser.add_argument("--healthy-runs", type=int, default=0, help="healthy runs, fresh seeds")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="subset of the layouts")
    parser.add_argument("--kinds", default=",".join(KINDS), help="subset of the fault kinds")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip-runs", action="store_true")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument(
        "--rescore", type=Path, default=None, help="only diagnose an earlier matrix's runs dir"
    )
    args = parser.parse_args()
    print(
        f"thresholds: slowdown ≥ {stragglers.MIN_SLOWDOWN}, chronic cost ≥ "
        f"{stragglers.MIN_COST_PCT}%, transient cost ≥ {stragglers.TRANSIENT_MIN_COST_PCT}%"
    )
    if args.rescore:
        score(args.rescore)
    elif not args.skip_runs:
        runs_dir = Path(tempfile.mkdtemp(prefix="ranktrace-detect-"))
        layouts = args.layouts.split(",")
        seed = args.seed if args.seed is not None else random.randrange(10**6)
        print(f"seed {seed}", flush=True)
        rng = random.Random(seed)
        factors = [float(f) for f in args.factors.split(",") if f]
        if factors and args.repeats:
            run_matrix(
                runs_dir, factors, args.steps, layouts, args.repeats, rng, args.kinds.split(",")
            )
        run_healthy(runs_dir, args.healthy_runs, args.steps, layouts, rng)
        score(runs_dir)
        print(f"runs kept in {runs_dir} (--rescore it after changing the analysis)")
    if not args.skip_scale:
        scale_detection()


if __name__ == "__main__":
    main()
