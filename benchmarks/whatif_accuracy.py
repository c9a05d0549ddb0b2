"""Is a finding's what-if step what the job really does without the fault? Each case trains the
same run three times on this machine, interleaved: healthy, with one fault injected, healthy
again; the finding's what-if step (`whatif_step_time_s`, from the replay) is compared with the
healthy runs' measured median step (all their steps after the warm-up step, pooled: the two
runs bracket the faulty one, so a drift of the machine between them is shared).

    python benchmarks/whatif_accuracy.py [--kinds compute,data,pause] [--positions 3]
        [--layout 2x2x2] [--model tiny|small] [--seed S] [--steps 24] [--rescore DIR]

Faults start at step 8 (as the demo's) and add about one healthy step to the faulty rank's
step in their kind's part (a compute factor sized from the first healthy run's compute, a data
delay, a pause of two steps every 4 steps); the faulty rank of each case is drawn with `--seed`
(printed; it is in the run's name). The trainer's seed is drawn too, so every case is a fresh
run. Prints, per case, the healthy runs' median step (their steps after the warm-up step), the
faulty run's median step over the finding's steps, the what-if step, their ratio, the
finding's cost, and the noise between runs of the same job here ("A/A": the second healthy
run's median step over the first's; "own": the faulty run's own steps without the fault over
the healthy runs'); then the cases within 10% (the target), the median |error| and the median
|A/A - 1|, the error two runs of one healthy job show here. `--rescore` of a directory from
before the bracketing (one healthy run per case) compares with that one run."""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from detection_accuracy import KINDS, LAYOUTS, report, train, world_size  # noqa: E402

from ranktrace.analysis.store import open_reader  # noqa: E402

ONSET = 8
TARGET = 0.10


def fault(kind: str, rank: int, healthy: dict, runs_dir: Path, name: str) -> str:
    """The --inject spec adding about one healthy step to `rank`'s step, in the kind's part."""
    step_s = healthy["step_time_s"]
    if kind == "compute":
        con = open_reader(runs_dir)
        (compute_s,) = con.execute(
            "SELECT median(work_s) FROM step_breakdown JOIN runs USING (run_id) WHERE name = ? "
            "AND rank = ? AND step > 0", [name, rank]).fetchone()  # fmt: skip
        con.close()
        return f"compute:rank={rank},factor={1 + step_s / compute_s:.3f},from={ONSET}"
    if kind == "data":
        return f"data:rank={rank},delay={step_s:.4f},from={ONSET}"
    return f"pause:rank={rank},every=4,duration={2 * step_s:.4f},from={ONSET}"


def fresh_report(runs_dir: Path, name: str) -> dict:
    """The run's report computed now by this code (not the one stored at ingest)."""
    from ranktrace.analysis.run import report as run_report

    con = open_reader(runs_dir)
    try:
        return run_report(con, name)
    finally:
        con.close()


def measured_steps(runs_dir: Path, name: str) -> dict[int, float]:
    """{step: the job's step time} of a run (the slowest rank's)."""
    con = open_reader(runs_dir)
    rows = con.execute(
        "SELECT step, max(step_time_s) FROM steps JOIN runs USING (run_id) WHERE name = ? "
        "GROUP BY step", [name]).fetchall()  # fmt: skip
    con.close()
    return dict(rows)


def compare(runs_dir: Path, healthy: list[str], faulty: str, kind: str, rank: int) -> dict:
    """The faulty run's finding on `rank` of `kind` against the healthy runs' measured steps
    (pooled)."""
    result = fresh_report(runs_dir, faulty)
    found = [f for f in result["stragglers"] if f["rank"] == rank and f["kind"] == KINDS[kind]]
    if not found:
        return {"found": False, "said": [(f["rank"], f["kind"]) for f in result["stragglers"]]}
    finding = found[0]
    steps = set(finding["steps"] or range(finding["first_step"], finding["last_step"] + 1))
    per_run = [[t for s, t in measured_steps(runs_dir, name).items() if s] for name in healthy]
    per_run = [times for times in per_run if times]  # a --rescore of one healthy run per case
    healthy_s = statistics.median(t for times in per_run for t in times)
    a_over_a = (statistics.median(per_run[1]) / statistics.median(per_run[0])
                if len(per_run) == 2 else float("nan"))  # fmt: skip
    own = [t for s, t in measured_steps(runs_dir, faulty).items() if s and s not in steps]
    whatif = finding["whatif_step_time_s"]
    return {"found": True, "healthy_s": healthy_s, "step_s": finding["step_time_s"],
            "whatif_s": whatif, "error": whatif / healthy_s - 1,
            "own_ratio": statistics.median(own) / healthy_s if own else float("nan"),
            "a_over_a": a_over_a,
            "cost_pct": finding["cost_pct"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="compute,data,pause")
    parser.add_argument("--positions", type=int, default=3)
    parser.add_argument("--layout", default="2x2x2", choices=sorted(LAYOUTS))
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--model", default="tiny", help="the trainer's model (the demo's: small)")
    parser.add_argument("--rescore", type=Path, default=None, help="a runs dir of an earlier run")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    rng = random.Random(seed)
    runs_dir = args.rescore or Path(tempfile.mkdtemp(prefix="whatif-")) / "runs"
    print(f"seed {seed}, runs in {runs_dir}", flush=True)
    cases = []
    for kind in args.kinds.split(","):
        for position in range(args.positions):
            rank, trainer_seed = rng.randrange(world_size(args.layout)), rng.randrange(1, 10**6)
            faulty = f"{kind}-r{rank}-{position}"
            healthy = [f"healthy-{faulty}", f"healthy-{faulty}-after"]
            if args.rescore is None:
                common = ("--seed", str(trainer_seed), "--model", args.model)
                train(runs_dir, healthy[0], args.layout, args.steps, *common)
                spec = fault(kind, rank, report(runs_dir, healthy[0]), runs_dir, healthy[0])
                train(runs_dir, faulty, args.layout, args.steps, *common, "--inject", spec)
                train(runs_dir, healthy[1], args.layout, args.steps, *common)
                print(f"  trained {healthy[0]}, {faulty}, {healthy[1]}: {spec}", flush=True)
            cases.append((kind, rank, healthy, faulty))
    errors, noise = [], []
    print(f"\n{'case':<22} {'healthy s':>9} {'faulty s':>9} {'what-if s':>9} {'ratio':>6} "
          f"{'cost':>6} {'A/A':>6} {'own':>6}")  # fmt: skip
    for kind, rank, healthy, faulty in cases:
        result = compare(runs_dir, healthy, faulty, kind, rank)
        if not result["found"]:
            print(f"{faulty:<22} not found (said {result['said']})")
            continue
        errors.append(result["error"])
        if not math.isnan(result["a_over_a"]):  # NaN: one healthy run (--rescore)
            noise.append(abs(result["a_over_a"] - 1))
        print(f"{faulty:<22} {result['healthy_s']:>9.4f} {result['step_s']:>9.4f} "
              f"{result['whatif_s']:>9.4f} {1 + result['error']:>6.3f} "
              f"{result['cost_pct']:>5.1f}% {result['a_over_a']:>6.3f} "
              f"{result['own_ratio']:>6.3f}")  # fmt: skip
    within = sum(abs(e) <= TARGET for e in errors)
    median = statistics.median(abs(e) for e in errors) if errors else float("nan")
    a_a = statistics.median(noise) if noise else float("nan")
    print(f"\nwithin {TARGET:.0%} of the healthy step: {within}/{len(cases)} "
          f"(found {len(errors)}); median |error| {median:.1%}; median |A/A - 1| "
          f"{a_a:.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
