"""First meaningful paint of each dashboard page in headless Chromium, on the synthetic 1,024-rank
× 1,000-step store of benchmarks/store_scale.py (rank 5 30% slower from step 500).

    python benchmarks/dashboard_paint.py [--runs-dir DIR] [--repeats 3] [--screenshots DIR]

Builds the store (unless --runs-dir points at one), serves `ranktrace dash` on a free port,
and times, per page, from navigation to its main element being drawn (a table, a heatmap, a
chart). The first visit of a run page also computes the run's report (cached afterwards):
both the cold and the warm times are printed. Target: ≤ 2 s per page. With --screenshots, saves
a PNG of every page (of the first run in the store) into DIR.
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
sys.path.insert(0, str(REPO / "benchmarks"))

from playwright.sync_api import sync_playwright  # noqa: E402

from ranktrace.analysis.ingest import ingest  # noqa: E402
from ranktrace.analysis.store import open_reader  # noqa: E402
from tests.browser import CHROMIUM, LAUNCH_ARGS, start_dashboard  # noqa: E402

PAGES = {  # name: (path, selector of its main element)
    "runs": ("/", "#runs-table td"),
    "run": ("/run/{run}", "#run-breakdown .main-svg"),
    "ranks": ("/ranks/{run}", "#ranks-heatmap .heatmaplayer"),
    "timeline": ("/timeline/{run}?step={step}", "#timeline-gantt .bars"),
    "compare": ("/compare?a={run}&b={run}", "#compare-table td"),
    "sql": ("/sql", "#sql-query"),
}


def build_store() -> Path:
    from store_scale import write_run

    runs_dir = Path(tempfile.mkdtemp(prefix="ranktrace-paint-"))
    write_run(runs_dir / "synthetic-scale", 1024, 1000)
    ingest(runs_dir)
    return runs_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--screenshots", type=Path, default=None)
    parser.add_argument("--run", default=None, help="run id or name to show (default: first)")
    args = parser.parse_args()
    runs_dir = args.runs_dir or build_store()
    con = open_reader(runs_dir)
    run, last = con.execute(
        "SELECT run_id, max(step) FROM runs JOIN steps USING (run_id) "
        "WHERE $1 IS NULL OR run_id = $1 OR name = $1 GROUP BY ALL "
        "ORDER BY any_value(started_at) LIMIT 1",
        [args.run],
    ).fetchone()
    con.close()
    proc, base = start_dashboard(runs_dir)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=LAUNCH_ARGS)  # fmt: skip
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            print(f"store {runs_dir}, run {run}; seconds to the main element of each page")
            for name, (path, selector) in PAGES.items():
                url = base + path.format(run=run, step=last // 2)
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    page.goto(url)
                    page.wait_for_selector(selector, timeout=120_000)
                    times.append(time.perf_counter() - start)
                print(f"  {name:9} first {times[0]:.2f} s, then median "
                      f"{statistics.median(times[1:] or times):.2f} s")  # fmt: skip
                if args.screenshots:
                    args.screenshots.mkdir(parents=True, exist_ok=True)
                    page.wait_for_timeout(500)  # let transitions settle
                    page.screenshot(path=str(args.screenshots / f"{name}.png"), full_page=True)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
