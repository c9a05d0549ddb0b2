"""Running a training job from the command line: launch it, then make it queryable."""

from __future__ import annotations

import signal
from pathlib import Path

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""The signals whose handlers a launch puts back as they were."""


def runs_dir_problem(runs_dir: Path) -> str | None:
    """Why a run cannot be written into `runs_dir` (created here when missing), or None."""
    if runs_dir.exists() and not runs_dir.is_dir():
        return f"--runs-dir {runs_dir} is a file, not a directory of runs"
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return (
            f"--runs-dir {runs_dir} cannot be created ({error.strerror}); pass a writable directory"
        )
    return None


def launch_and_ingest(cfg, ranks_to_stderr: bool = False) -> int:
    """Train `cfg`, then make the run (finished or failed) queryable; the launcher's code.
    `ranks_to_stderr`: the ranks' step lines go to stderr (a command printing a document)."""
    from ranktrace.analysis.ingest import ingest
    from ranktrace.trainer.launch import launch

    handlers = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}
    try:
        code = launch(cfg, ranks_to_stderr)
    finally:  # torch's elastic agent leaves its own handlers (Ctrl-C then raised its
        for sig, handler in handlers.items():  # SignalException in the dashboard served after)
            signal.signal(sig, handler)
    store = Path(cfg.runs_dir) / "ranktrace.duckdb"
    try:  # the finished (or failed) run becomes queryable
        report = ingest(Path(cfg.runs_dir), [cfg.run_id], force=True)
    except Exception as error:  # the run itself is safe in its segments
        print(
            f"ranktrace train: warning: could not ingest into {store} ({error}); "
            f"run `ranktrace ingest --runs-dir {cfg.runs_dir}` later"
        )
    else:
        print(
            f"ingested run {cfg.run_id} into {store} "
            f"({report.rows['steps']} step rows, {report.rows['collectives']} collectives)"
        )
        if code != 0:
            try:
                _print_hangs(Path(cfg.runs_dir), cfg.run_id)
            except Exception as error:  # the diagnosis is a bonus; the failure is reported
                print(f"ranktrace train: warning: no diagnosis of the failed run ({error})")
    return code


def _print_hangs(runs_dir: Path, run_id: str) -> None:
    """After a failed run: the hung rank(s), if a collective timeout ended it."""
    from ranktrace.analysis.run import cached_report
    from ranktrace.analysis.store import open_reader
    from ranktrace.app.report_text import hang_lines

    con = open_reader(runs_dir)
    try:
        lines = hang_lines(cached_report(con, run_id))
    finally:
        con.close()
    for line in lines:
        print(f"ranktrace train: {line}")
