"""Run the timing-judging tests (`pytest -m timing`) again and again beside a training job, and
print each check's closest approach to its bound.

    .venv/bin/python tools/timing_loop.py [--runs 10] [--out DIR] [-- PYTEST ARGS]

A 2-rank `ranktrace train` runs in the background the whole time (restarted when it ends), as
another job on a shared CI machine would: the tests must pass beside it. Each pytest run logs
every check of tests/margins.py (value against bound) to DIR/run-N.jsonl; at the end a table
gives, per test and check, how many runs passed it, its closest approach (the smallest headroom
left, as a share of the bound) and the value there. Exit status 1 when any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BACKGROUND = ["train", "--dp", "2", "--steps", "20000", "--seq-len", "32", "--telemetry", "off",
              "--run-name", "background"]  # fmt: skip
"""The neighbour job: 2 ranks of the tiny model, ~10-20 ms steps, no telemetry written."""


def _background(stop: threading.Event, runs_dir: Path) -> None:
    """Keep BACKGROUND training until `stop` is set."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    while not stop.is_set():
        job = subprocess.Popen([sys.executable, "-m", "ranktrace.app.cli", *BACKGROUND,
                                "--runs-dir", str(runs_dir)], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        while job.poll() is None and not stop.is_set():
            time.sleep(0.5)
        if job.poll() is None:
            job.terminate()
            try:
                job.wait(timeout=30)
            except subprocess.TimeoutExpired:
                job.kill()


def headroom(check: dict) -> float:
    """How far `value` stays inside `bound`, as a share of |bound| (negative: it failed)."""
    value, bound = check["value"], check["bound"]
    gap = bound - value if check["op"] == "<=" else value - bound
    return gap / abs(bound) if bound else gap


def closest_approaches(logs: list[Path]) -> list[dict]:
    """Per (test, check) over every log: runs, passes, the smallest headroom and its value."""
    worst: dict[tuple[str, str], dict] = {}
    for log in logs:
        for line in log.read_text().splitlines() if log.exists() else []:
            check = json.loads(line)
            key = (check["test"], check["check"])
            entry = worst.setdefault(key, {"test": key[0], "check": key[1], "runs": 0,
                                           "passed": 0, "headroom": float("inf")})  # fmt: skip
            entry["runs"] += 1
            entry["passed"] += check["ok"]
            if headroom(check) < entry["headroom"]:
                entry.update(headroom=headroom(check), value=check["value"],
                             bound=check["bound"], op=check["op"])  # fmt: skip
    return sorted(worst.values(), key=lambda e: (e["test"], e["check"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="pytest runs in a row")
    parser.add_argument("--out", default="", help="folder for the logs (default: a new one)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="timing-loop-"))
    out.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as background_runs:
        neighbour = threading.Thread(target=_background, args=(stop, Path(background_runs)))
        neighbour.start()
        time.sleep(5)  # the neighbour is training before the first test starts
        outcomes = []
        try:
            for run in range(1, args.runs + 1):
                log = out / f"run-{run}.jsonl"
                started = time.monotonic()
                result = subprocess.run(
                    [sys.executable, "-m", "pytest", "-m", "timing", "-q", "-p",
                     "no:cacheprovider", *args.pytest_args], cwd=REPO,
                    env={**os.environ, "RANKTRACE_MARGINS": str(log)},
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                )  # fmt: skip
                (out / f"run-{run}.txt").write_text(result.stdout)
                summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
                outcomes.append(result.returncode == 0)
                print(f"run {run}/{args.runs}: {'green' if outcomes[-1] else 'RED'} in "
                      f"{time.monotonic() - started:.0f} s: {summary}", flush=True)  # fmt: skip
        finally:
            stop.set()
            neighbour.join()
    print(f"\n{sum(outcomes)} of {len(outcomes)} runs green; logs in {out}\n")
    print("| test | check | passed | closest approach (value vs bound) | headroom |")
    print("| --- | --- | --- | --- | --- |")
    for entry in closest_approaches(sorted(out.glob("run-*.jsonl"))):
        print(f"| {entry['test'].split('::', 1)[-1]} | {entry['check']} | "
              f"{entry['passed']}/{entry['runs']} | {entry['value']:.4g} {entry['op']} "
              f"{entry['bound']:.4g} | {100 * entry['headroom']:.1f}% |")  # fmt: skip
    return 0 if all(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
