"""`ranktrace watch RUN`: diagnose a run while it trains, one window of steps at a time.

Every `--interval` seconds it ingests the windows every rank has finished (analysis/ingest.py,
`complete_only`: the one catalog writer), and when one was added reads the report ingest
computed over the windows so far. Each finding that is new, or whose kind or cost changed, is
printed in one line (who, kind, steps, cost, remedy) and, with `--otlp-endpoint`, exported as
the gauge `ranktrace.straggler.slowdown` (app/finding_gauge.py). It returns when the run has
ended and its last window is in the store, after the run's hung ranks (where a collective
timeout ended it) and its verdict where it has none. Works on whatever writes segments under
the runs directory: `ranktrace train`, `ranktrace run`, torchrun jobs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ranktrace.analysis.windows import DEFAULT_WINDOW_STEPS
from ranktrace.app.report_text import finding_kind, finding_who, hang_lines
from ranktrace.telemetry.run_record import FINISHED_STATUSES, latest_run_id, read_run_json

WATCH_WINDOW_STEPS = 10
"""Steps per window while watching (the store's default, 100, would wait ~100 steps)."""
STALL_LEAST_S = 60.0
STALL_GAPS = 5
"""A run still training that completes no window for STALL_GAPS times the longest wait for one
so far (and at least --stall seconds) is said to look stalled, once: a hung rank stops every
synchronous step, and no window completes until a collective timeout ends the job (then the
closing lines name the rank)."""


def add_watch_parser(commands: argparse._SubParsersAction) -> None:
    """The `watch` command and its options."""
    watch = commands.add_parser(
        "watch",
        help="diagnose a run while it trains, window by window",
        description="Ingest the run's windows as every rank finishes them and print each "
        "finding (who, kind, steps, cost, remedy) within one window of its onset; with "
        "--otlp-endpoint also export them as the OpenTelemetry gauge "
        "ranktrace.straggler.slowdown. Returns once the run ended and its last window is in.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    watch.add_argument("run", help="run id or name (its folder under the runs dir)")
    watch.add_argument("--runs-dir", default="runs", help="directory holding the runs and store")
    watch.add_argument(
        "--window", type=int, default=None, metavar="STEPS",
        help=f"steps per window (default: a run already in the store keeps its own, another "
        f"gets {WATCH_WINDOW_STEPS}; `ranktrace ingest` defaults to {DEFAULT_WINDOW_STEPS})",
    )  # fmt: skip
    watch.add_argument("--interval", type=float, default=0.5, help="seconds between looks")
    watch.add_argument(
        "--otlp-endpoint", default="",
        help="an OTLP/HTTP endpoint (e.g. http://collector:4318) to export findings to",
    )  # fmt: skip
    watch.add_argument(
        "--timeout", type=float, default=0.0,
        help="give up after this many seconds without a new window (0: never)",
    )  # fmt: skip
    watch.add_argument(
        "--stall", type=float, default=STALL_LEAST_S, metavar="SECONDS",
        help=f"say the run looks stalled (a rank hung?) after this many seconds without a new "
        f"window, and at least {STALL_GAPS} times the longest wait for one so far",
    )  # fmt: skip
    watch.set_defaults(handler=_watch, command_parser=watch)


def _watch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ranktrace.analysis.store import StoreError
    from ranktrace.app.finding_gauge import FindingGauge

    runs_dir = Path(args.runs_dir)
    if (args.window is not None and args.window < 1) or args.interval <= 0 or args.stall <= 0:
        parser.error(f"--window must be >= 1, --interval and --stall > 0 (got {args.window}, "
                     f"{args.interval}, {args.stall})")  # fmt: skip
    run_id = latest_run_id(runs_dir, args.run)
    if run_id is None:
        parser.error(f"no run '{args.run}' under {runs_dir}: give a run id or name there")
    run_dir = runs_dir / run_id
    gauge = FindingGauge(args.otlp_endpoint, run_dir.name) if args.otlp_endpoint else None
    watcher = _Watcher(runs_dir, run_dir, args.window)
    stall = _Stall(args.stall)
    last_news = time.monotonic()
    try:
        while True:
            look_began = time.monotonic()
            ended = _ended(run_dir)  # read before ingesting: the windows then hold every step
            try:
                added, held = watcher.ingest()
            except StoreError as error:
                parser.error(str(error))
            done = ended and not held
            if added or done:  # the run's own ingest may have written its last window
                stall.window_came(time.monotonic() - last_news)
                last_news = time.monotonic()
                try:
                    news = watcher.news()
                except Exception as failure:  # an analyzer's bug: said, and the watch goes on
                    news = []
                    print(f"ranktrace watch: no report over the windows so far "
                          f"({type(failure).__name__}: {failure})", flush=True)  # fmt: skip
                for line, finding in news:
                    print(line, flush=True)
                    if gauge is not None:
                        gauge.record(finding, watcher.rank_hosts)
                watcher.longest_look_s = max(watcher.longest_look_s,
                                             time.monotonic() - look_began)  # fmt: skip
            if done:
                for line in watcher.closing_lines():
                    print(line, flush=True)
                return 0
            notice = stall.notice(time.monotonic() - last_news, watcher.last_step)
            if notice:
                print(notice, flush=True)
            if args.timeout and time.monotonic() - last_news > args.timeout:
                print(f"ranktrace watch: no new window in {args.timeout:.0f} s; stopped "
                      f"({watcher.summary()})", flush=True)  # fmt: skip
                return 1
            time.sleep(args.interval)
    except KeyboardInterrupt:  # Ctrl-C is how a watch is stopped: not an error
        return 0
    finally:
        if gauge is not None:
            gauge.close()


def _stored_window_steps(runs_dir: Path, run_id: str) -> int | None:
    """The steps per window of the run's earlier ingest; None where the store lacks it."""
    from ranktrace.analysis.store import read_store, store_path

    if not store_path(runs_dir).exists():
        return None
    row = read_store(runs_dir, lambda con: con.execute(
        "SELECT window_steps FROM runs WHERE run_id = ?", [run_id]).fetchone())  # fmt: skip
    return row[0] if row else None


def _ended(run_dir: Path) -> bool:
    try:
        return read_run_json(run_dir).get("status") in FINISHED_STATUSES
    except (OSError, ValueError):  # being replaced this instant: look again next time
        return False


class _Stall:
    """Whether the run looks stalled: STALL_GAPS."""

    def __init__(self, least_s: float) -> None:
        self.least_s, self.longest_s, self.said = least_s, 0.0, False
        self.first = True

    def window_came(self, waited_s: float) -> None:
        """A window came after `waited_s` (the first look's is no wait between windows: the
        watch may begin at any point of the run)."""
        if not self.first:
            self.longest_s = max(self.longest_s, waited_s)
        self.first, self.said = False, False

    def notice(self, waiting_s: float, last_step: int | None) -> str | None:
        """The line to print, once per stall, when the run has waited too long."""
        if self.said or waiting_s < max(self.least_s, STALL_GAPS * self.longest_s):
            return None
        self.said = True
        after = "" if last_step is None else f" after step {last_step}"
        return (f"ranktrace watch: no window completed in {waiting_s:.3g} s{after} (the "
                f"longest wait before was {self.longest_s:.3g} s): the job looks stalled, a rank "
                "may be hung; a collective timeout will end it, and then the hung rank is "
                "named")  # fmt: skip


class _Watcher:
    """One run's windows and the findings already printed."""

    def __init__(self, runs_dir: Path, run_dir: Path, window_steps: int | None) -> None:
        self.runs_dir, self.run_id, self.explicit = runs_dir, run_dir.name, window_steps
        self.window_steps = window_steps or WATCH_WINDOW_STEPS
        """The stored run's steps per window, once it is stored."""
        self.stored = False
        self.looked = False
        self.last_step: int | None = None
        """The last step of the windows stored."""
        self.printed: dict[tuple, tuple] = {}
        self.steps, self.windows = 0, 0
        self.rank_hosts: dict[int, str] = {}
        self.last: dict = {}
        """The report of the last look."""
        self.longest_look_s = 0.0
        """The longest look that found windows, ingest and report: how far behind the job the
        watch's findings may be printed (a window's analysis waits for the look before it)."""

    def ingest(self) -> tuple[int, bool]:
        """(windows added, whether a window is still held back); at the first look, a run
        already stored counts as added."""
        from ranktrace.analysis.ingest import ingest

        if not self.stored:  # (whoever stored it, whenever)
            self.stored = _stored_window_steps(self.runs_dir, self.run_id) is not None
        size = self.explicit or (None if self.stored else WATCH_WINDOW_STEPS)  # else its own
        done = ingest(self.runs_dir, [self.run_id], window_steps=size, complete_only=True)
        added = done.windows
        if not self.looked:  # a run stored before the watch: its findings so far, at once
            self.looked = True
            added = added or int(self.stored)
        return added, bool(done.incomplete)

    def report(self) -> dict:
        """The report over the windows stored so far (read again where the run's own ingest
        was ending: analysis/store.py `read_store`), and the run's hosts and windows."""
        from ranktrace.analysis.store import read_store

        return read_store(self.runs_dir, self._read_report)

    def _read_report(self, con) -> dict:
        from ranktrace.analysis.run import cached_report

        hosts = con.execute("SELECT rank, host FROM ranks WHERE run_id = ?", [self.run_id])
        self.rank_hosts = {int(rank): host or "" for rank, host in hosts.fetchall()}
        windows = con.execute(
            "SELECT count(*), any_value(r.window_steps), max(end_step) FROM windows "
            "JOIN runs r USING (run_id) WHERE run_id = ?", [self.run_id],
        )  # fmt: skip
        self.windows, stored_size, end = windows.fetchone()
        self.window_steps = stored_size or self.window_steps
        self.last_step = None if end is None else end - 1
        return cached_report(con, self.run_id)

    def news(self) -> list[tuple[str, dict]]:
        """(line, finding) for every finding new since the last call, or changed in kind,
        pattern or cost (by a point or more); the findings of the report so far."""
        self.last = {}  # a look whose report fails leaves no earlier one to close with
        report = self.last = self.report()
        self.steps = report.get("steps") or 0
        out = []
        for finding in report.get("stragglers", []):
            key = (finding["rank"], tuple(finding.get("candidates") or ()), finding["kind"],
                   finding.get("axis"), finding.get("cause"))  # fmt: skip
            state = (finding["pattern"], round(finding["cost_pct"]))
            if self.printed.get(key) != state:
                self.printed[key] = state
                out.append((finding_line(finding), finding))
        return out

    def summary(self) -> str:
        """`run ID[ STATUS]: W window(s) of N steps analysed, S steps, F finding(s); the longest
        look took L s`, and the reason where the run has no verdict (too few steps, none
        recorded): never read as an all-clear."""
        from ranktrace.analysis.verdict import NO_DATA, TOO_FEW_STEPS  # (loads DuckDB)

        status = f" {self.last['status']}" if self.last.get("status") else ""
        line = (f"run {self.run_id}{status}: {self.windows} window(s) of {self.window_steps} "
                f"steps analysed, {self.steps} steps, {len(self.printed)} finding(s); the "
                f"longest look took {self.longest_look_s:.1f} s")  # fmt: skip
        if self.last.get("verdict") in (NO_DATA, TOO_FEW_STEPS):
            line += f"; {self.last['verdict_detail']}"
        return line

    def closing_lines(self) -> list[str]:
        """Once the run is in: its hung ranks (analysis/resilience.py: who its peers waited
        for when the collective timeout ended it), a partial capture, then the summary."""
        capture = (self.last.get("capture") or {}).get("lines") or []
        return [*hang_lines(self.last), *capture, self.summary()]


def finding_line(finding: dict) -> str:
    """One finding in one line: who, kind, steps, slowdown, cost and the remedy."""
    remedy = (finding.get("remedy") or {}).get("action") or "no remedy priced"
    return (f"step {finding['first_step']}-{finding['last_step']}: {finding_who(finding)} "
            f"{finding_kind(finding)}, {finding['pattern']}, {finding['slowdown']:.2f}x, cost "
            f"{finding['cost_pct']:.1f}%; remedy: {remedy}")  # fmt: skip
