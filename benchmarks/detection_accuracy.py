"""How well `ranktrace report` finds injected stragglers: precision, recall, kind accuracy,
detection delay and false positives over a matrix of real runs, and the time to diagnose the
synthetic 1,024-rank store.

    python benchmarks/detection_accuracy.py [--factors 1.2,1.3,2,3] [--steps 30] [--skip-runs]
                                            [--skip-scale]

Matrix (kept on disk; `--rescore DIR` diagnoses it again with the current analysis): layouts
tp×pp×dp 2×2×2, 1×2×4, 1×2×2 (tiny model, 30 steps, faults from step 10) × kinds
compute, link, data, pause × the given slowdown factors, plus one healthy run per layout.
A factor F means: compute F× (the --inject factor); data and link delays of (F - 1) × the
healthy step time (link: spread over the rank's collectives of one step); pauses of
2 × (F - 1) × the healthy step time every 4 steps. A run is a hit when a finding names the
injected rank with the injected kind (recall: hits / runs). A finding is right when it names the
injected rank, or lists it among the candidates of a link no timing can locate (precision:
right / findings). Printed per factor (the target, ≥ 0.95, is for factors ≥ 1.3).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from analysis import stragglers  # noqa: E402
from analysis.store import ingest, open_reader  # noqa: E402

LAYOUTS = {
    "2x2x2": ("--tp", "2", "--pp", "2", "--dp", "2"),  # 4 peers per stage
    "1x2x4": ("--pp", "2", "--dp", "4"),  # 4 peers per stage
    "1x2x2": ("--pp", "2", "--dp", "2"),  # 2 peers per stage: each rank's reference is 1 rank
}
TARGETS = {"2x2x2": 6, "1x2x4": 5, "1x2x2": 2}  # injected rank (in the last pipeline stage)
ONSET = 10


def ranktrace(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=REPO, text=True,
                          capture_output=True, env=env)  # fmt: skip


def train(runs_dir: Path, name: str, layout: str, steps: int, *extra: str) -> None:
    result = ranktrace("train", *LAYOUTS[layout], "--steps", str(steps), "--run-name", name,
                       "--runs-dir", str(runs_dir), *extra)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed: {result.stderr[-500:]}")


def report(runs_dir: Path, name: str) -> dict:
    result = ranktrace("report", name, "--runs-dir", str(runs_dir), "--json")
    return json.loads(result.stdout)


def fault_spec(kind: str, rank: int, factor: float, step_s: float, collectives: int) -> str:
    extra_s = (factor - 1.0) * step_s
    if kind == "compute":
        return f"compute:rank={rank},factor={factor},from={ONSET}"
    if kind == "data":
        return f"data:rank={rank},delay={extra_s:.4f},from={ONSET}"
    if kind == "link":
        return f"link:rank={rank},delay={extra_s / collectives:.5f},from={ONSET}"
    return f"pause:rank={rank},every=4,duration={2 * extra_s:.4f},from={ONSET}"


KINDS = {"compute": "compute", "link": "communication", "data": "data", "pause": "host"}


def run_matrix(runs_dir: Path, factors: list[float], steps: int, layouts: list[str]) -> None:
    """Train the healthy and injected runs of the matrix into `runs_dir`."""
    for layout in layouts:
        train(runs_dir, f"healthy-{layout}", layout, steps)
        healthy = report(runs_dir, f"healthy-{layout}")
        step_s = healthy["step_time_s"]
        rank = TARGETS[layout]
        con = open_reader(runs_dir)
        (calls,) = con.execute(
            "SELECT median(n) FROM (SELECT step, count(*) AS n FROM collectives c JOIN runs "
            "USING (run_id) WHERE name = ? AND rank = ? GROUP BY step)",
            [f"healthy-{layout}", rank],
        ).fetchone()
        con.close()
        print(f"{layout}: healthy step {step_s * 1e3:.1f} ms, {calls:.0f} collectives/step on "
              f"rank {rank}", flush=True)  # fmt: skip
        for kind in KINDS:
            for factor in factors:
                spec = fault_spec(kind, rank, factor, step_s, int(calls))
                train(runs_dir, f"{kind}-{factor}-{layout}", layout, steps, "--inject", spec)
                print(f"  trained {kind}-{factor}-{layout}: {spec}", flush=True)


def score(runs_dir: Path) -> None:
    """Diagnose every run of a matrix in `runs_dir` and print the tallies. A finding is right
    when it names the injected rank, or (a link no timing can locate) lists it as a candidate;
    a hit names the injected rank with the injected kind."""
    con = open_reader(runs_dir)
    names = [row[0] for row in con.execute("SELECT name FROM runs ORDER BY started_at").fetchall()]
    con.close()
    tallies: dict[float, dict] = {}
    false_positives = healthy_runs = 0
    for name in names:
        kind, *rest = name.split("-")
        findings = report(runs_dir, name)["stragglers"]
        if kind == "healthy":
            healthy_runs += 1
            false_positives += len(findings)
            continue
        factor, layout = float(rest[0]), rest[1]
        rank = TARGETS[layout]
        tally = tallies.setdefault(factor, {"hits": 0, "runs": 0, "findings": 0, "right": 0,
                                            "right_rank": 0, "delays": []})  # fmt: skip
        hit = [f for f in findings if f["rank"] == rank and f["kind"] == KINDS[kind]]
        tally["runs"] += 1
        tally["findings"] += len(findings)
        tally["right"] += sum(f["rank"] == rank or (f["rank"] is None and rank in f["candidates"])
                              for f in findings)  # fmt: skip
        tally["right_rank"] += sum(f["rank"] == rank for f in findings)
        if hit:
            tally["hits"] += 1
            tally["delays"].append(hit[0]["first_step"] - ONSET)
        print(f"  {name:22} -> " + (", ".join(
            f"rank {f['rank'] if f['rank'] is not None else f['candidates']} {f['kind']} "
            f"from {f['first_step']}" for f in findings) or "nothing"))  # fmt: skip
    print(f"\n{'factor':>6} {'recall':>7} {'precision':>9} {'kind acc':>8} {'delay':>6} "
          f"{'max delay':>9}")  # fmt: skip
    for factor, t in sorted(tallies.items()):
        recall = t["hits"] / t["runs"]
        precision = t["right"] / t["findings"] if t["findings"] else 1.0
        kind_accuracy = t["hits"] / t["right_rank"] if t["right_rank"] else 0.0
        delays = t["delays"] or [float("nan")]
        print(f"{factor:>6} {recall:>7.2f} {precision:>9.2f} {kind_accuracy:>8.2f} "
              f"{sum(delays) / len(delays):>6.1f} {max(delays, key=abs):>9}")  # fmt: skip
    pooled = [t for factor, t in tallies.items() if factor >= 1.3]
    hits, runs = sum(t["hits"] for t in pooled), sum(t["runs"] for t in pooled)
    right, found = sum(t["right"] for t in pooled), sum(t["findings"] for t in pooled)
    print(f"factors >= 1.3 pooled: recall {hits}/{runs} = {hits / max(runs, 1):.2f}, precision "
          f"{right}/{found} = {right / max(found, 1):.2f} (target 0.95)")  # fmt: skip
    print(f"false positives on {healthy_runs} healthy runs: {false_positives}")


def scale_detection() -> None:
    """Plant rank 5 at 1.3x from step 500 in the 1,024-rank synthetic store; time the report."""
    from store_scale import write_run

    from analysis.run import report as run_report

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
    parser.add_argument("--factors", default="1.2,1.3,2,3")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="subset of the layouts")
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
        run_matrix(runs_dir, [float(f) for f in args.factors.split(",")], args.steps, layouts)
        score(runs_dir)
        print(f"runs kept in {runs_dir} (--rescore it after changing the analysis)")
    if not args.skip_scale:
        scale_detection()


if __name__ == "__main__":
    main()
