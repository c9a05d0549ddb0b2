"""Which stragglers does ranktrace see? The public ST trace (tests/data/perop-ST, 8 workers,
dp 2 x pp 4) re-timed by the independent re-timer (tests/perop_retime.py, which imports nothing
from analysis/) with one worker's compute, or its point-to-point transfers, x factor at every
position; each re-timed trace imported (`ranktrace import per-op`) and reported.

    python benchmarks/sensitivity.py [--kinds compute,link] [--factors 1.03,1.05,...]
        [--link-factors 1.5,2,...] [--positions 0,1,...]

A link's factors are larger: the trace's point-to-point transfers are a small part of its
steps, so x1.3 of them saves ~0.01%.

Per case: the true saving (the re-timer's: 1 - the steps with that worker at its peers' pace,
or its transfers as recorded, over the slowed steps, the warm-up step left out), whether a
finding of that kind names the worker (a link: among its candidates) and no other rank, its
cost and the cost's error. Then, per bar of true saving (>= 1%, >= 2%, >= 5%), the share of
cases found, and the cases where another rank was named. The trace as recorded (factor 1) is
the healthy case: its stage imbalance is its one finding, no rank is a straggler.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pandas as pd  # noqa: E402

from ranktrace.analysis.run import report  # noqa: E402
from ranktrace.analysis.store import open_reader  # noqa: E402
from ranktrace.app.cli import main as cli  # noqa: E402
from tests.perop_retime import link_saving, recorded, retime, saving  # noqa: E402

ST = REPO / "tests/data/perop-ST/trace.parquet"
PP, DP = 4, 2
FACTORS = (1.03, 1.05, 1.08, 1.10, 1.15, 1.3)
LINK_FACTORS = (1.5, 2.0, 4.0, 8.0, 16.0)
KIND_OF = {"compute": "compute", "link": "communication"}
BARS_PCT = (1.0, 2.0, 5.0)


def trace() -> pd.DataFrame:
    table = pd.read_parquet(ST)
    return table[table["optype"] != "first-op"].astype({"optype": str})


def reported(slowed: pd.DataFrame, workdir: Path, name: str) -> dict:
    """The report of `slowed` imported as a per-op trace of dp 2 x pp 4."""
    path, runs_dir = workdir / f"{name}.parquet", workdir / name
    slowed.to_parquet(path, index=False)
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli(["import", "per-op", str(path), "--pp", str(PP), "--dp", str(DP), "--name",
                    name, "--runs-dir", str(runs_dir)])  # fmt: skip
    if code:
        raise RuntimeError(f"import of {name} exited {code}")
    con = open_reader(runs_dir)
    try:
        return report(con, name)
    finally:
        con.close()


def verdict(result: dict, kind: str, rank: int) -> tuple[bool, float | None, list[int]]:
    """(found: a finding of `kind` names `rank` and no other rank is named, its cost, the other
    ranks named)."""
    findings = result["stragglers"]
    mine = [f for f in findings if f["kind"] == KIND_OF[kind]
            and (f["rank"] == rank or (f["rank"] is None and rank in f["candidates"]))]  # fmt: skip
    named = {r for f in findings
             for r in ([f["rank"]] if f["rank"] is not None else f["candidates"])}  # fmt: skip
    others = sorted(named - {rank})
    cost = max((f["cost_pct"] for f in mine), default=None)
    return bool(mine) and not others, cost, others


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="compute,link")
    parser.add_argument("--factors", default=",".join(str(f) for f in FACTORS))
    parser.add_argument("--link-factors", default=",".join(str(f) for f in LINK_FACTORS))
    parser.add_argument("--positions", default=",".join(str(r) for r in range(PP * DP)))
    args = parser.parse_args()
    table = trace()
    steps = sorted(table["step"].unique())[1:]  # the first is the warm-up step
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        healthy = reported(retime(table, recorded), workdir, "healthy")
        print(
            f"healthy (re-timed as recorded): stragglers {healthy['stragglers']}, "
            f"imbalances {[i.get('kind') for i in healthy.get('imbalances', [])]}"
        )
        for kind in args.kinds.split(","):
            factors = args.factors if kind == "compute" else args.link_factors
            for factor in (float(f) for f in factors.split(",")):
                for rank in (int(r) for r in args.positions.split(",")):
                    worker = (rank % DP, rank // DP)  # (dp_rank, stage): rank = stage x dp + dp
                    how = saving if kind == "compute" else link_saving
                    true, slowed = how(table, factor, worker, steps)
                    result = reported(slowed, workdir, f"{kind}-{factor}-{rank}")
                    found, cost, others = verdict(result, kind, rank)
                    rows.append({"kind": kind, "factor": factor, "rank": rank,
                                 "true_pct": 100 * true, "found": found, "cost_pct": cost,
                                 "others": others})  # fmt: skip
                    shown = "" if cost is None else f"{cost:6.2f} ({cost - 100 * true:+.2f})"
                    print(f"{kind:8} x{factor:<5} rank {rank}  true {100 * true:6.2f}%  "
                          f"{'found' if found else '-----'}  cost {shown:>15}  others {others}",
                          flush=True)  # fmt: skip
    frame = pd.DataFrame(rows)
    print("\nfound, by true saving:")
    for kind, cases in frame.groupby("kind"):
        for bar in BARS_PCT:
            above = cases[cases["true_pct"] >= bar]
            print(f"  {kind:8} >= {bar:3.0f}%: {int(above['found'].sum())} of {len(above)}")
        wrong = cases[cases["others"].map(bool)]
        print(f"  {kind:8} another rank named: {len(wrong)} of {len(cases)}")


if __name__ == "__main__":
    main()
