"""The `ranktrace` command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from app.output import FORMATS
from app.sweep import SWEEP_AXES
from trainer.cli_args import add_train_arguments, config_from_args
from trainer.config import ConfigError


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage mistakes end in one line naming the problem and where to look, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _check_devices(cfg, parser: argparse.ArgumentParser) -> None:
    import torch  # imported only once a job is really going to start

    if cfg.device == "cuda" and torch.cuda.device_count() < cfg.world_size:
        parser.error(
            f"--device cuda needs {cfg.world_size} GPUs on this machine but torch sees "
            f"{torch.cuda.device_count()}; use --device cpu (or auto), or fewer ranks"
        )


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from trainer.checkpoint import CheckpointError
    from trainer.resume import explicit_train_arguments, resume_config

    try:
        if args.resume:
            explicit = explicit_train_arguments(args.argv)
            cfg = resume_config(args.runs_dir, args.resume, explicit)
        else:
            cfg = config_from_args(args)
            cfg.validate()
    except (ConfigError, CheckpointError) as err:
        parser.error(str(err))
    _check_devices(cfg, parser)
    return _launch_and_ingest(cfg)


def _launch_and_ingest(cfg) -> int:
    """Train `cfg`, then make the run (finished or failed) queryable; the launcher's code."""
    from analysis.store import ingest
    from trainer.launch import launch

    code = launch(cfg)
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
            _print_hangs(Path(cfg.runs_dir), cfg.run_id)
    return code


def _print_hangs(runs_dir: Path, run_id: str) -> None:
    """After a failed run: the hung rank(s), if a collective timeout ended it."""
    from analysis.run import cached_report
    from analysis.store import open_reader
    from app.report_text import hang_lines

    con = open_reader(runs_dir)
    try:
        lines = hang_lines(cached_report(con, run_id))
    finally:
        con.close()
    for line in lines:
        print(f"ranktrace train: {line}")


def _ingest(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from analysis.store import StoreError, ingest

    try:
        report = ingest(Path(args.runs_dir), args.runs or None, force=args.force)
    except StoreError as err:
        parser.error(str(err))
    for table, count in report.rows.items():
        print(f"{table:12} {count:>10} rows")
    print(f"ingested {len(report.runs)} run(s), {len(report.skipped)} unchanged")
    return 0


def _sql(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from analysis.store import StoreError, open_live, open_reader, query
    from app.output import render

    try:
        if args.live:
            con = open_live(Path(args.runs_dir), args.live)
        else:
            con = open_reader(Path(args.runs_dir))
        try:
            columns, rows = query(con, args.query, args.max_rows)
        finally:
            con.close()
    except StoreError as err:
        parser.error(str(err))
    print(render(columns, rows, args.format))
    return 0


def _analysis(args: argparse.Namespace, parser: argparse.ArgumentParser, analyze) -> dict:
    """Run `analyze(con)` on the store; StoreErrors become one-line usage errors."""
    from analysis.store import StoreError, open_reader

    try:
        con = open_reader(Path(args.runs_dir))
        try:
            return analyze(con)
        finally:
            con.close()
    except StoreError as err:
        parser.error(str(err))


def _sweep(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from analysis.store import open_reader
    from app.output import render
    from app.sweep import parse_values, sweep_configs, sweep_table

    try:
        configs = sweep_configs(config_from_args(args), args.axis, parse_values(args.values))
    except ConfigError as err:
        parser.error(str(err))
    for cfg in configs:
        _check_devices(cfg, parser)
    run_ids = []
    for cfg in configs:
        print(f"sweep: {args.axis}={getattr(cfg, args.axis.replace('-', '_'))}", flush=True)
        if _launch_and_ingest(cfg) != 0:
            print(f"ranktrace sweep: error: the {cfg.run_name} run failed; sweep stopped")
            return 1
        run_ids.append(cfg.run_id)
    con = open_reader(Path(configs[0].runs_dir))
    try:
        columns, rows = sweep_table(con, run_ids, args.axis)
    finally:
        con.close()
    print(f"\none-axis sweep of {args.axis} (everything else fixed):")
    print(render(columns, rows, "table"))
    return 0


def _dash(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from app.dashboard import serve

    runs_dir = Path(args.runs_dir)
    if runs_dir.exists() and not runs_dir.is_dir():
        parser.error(f"--runs-dir {runs_dir} is a file, not a directory of runs")
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port} is not a TCP port; choose one in 1..65535")
    print(f"ranktrace dashboard of {runs_dir.resolve()} on http://{args.host}:{args.port}/ "
          "(Ctrl-C stops it)", flush=True)  # fmt: skip
    try:
        serve(runs_dir, args.host, args.port)
    except OSError as error:  # the port is taken, or the address is not this machine's
        parser.error(f"cannot serve on {args.host}:{args.port} ({error.strerror or error}); "
                     "choose another --port or --host")  # fmt: skip
    return 0


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from analysis.run import cached_report
    from app.output import to_json
    from app.report_text import format_report

    result = _analysis(args, parser, lambda con: cached_report(con, args.run))
    print(to_json(result) if args.json else format_report(result))
    return 0


def _compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from analysis.run import compare
    from app.output import to_json
    from app.report_text import format_comparison

    result = _analysis(args, parser, lambda con: compare(con, args.run_a, args.run_b))
    print(to_json(result) if args.json else format_comparison(result))
    return 0


def _add_runs_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs-dir", default="runs", help="directory holding the runs and store")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="ranktrace",
        description="Profiling and straggler diagnosis for distributed training, "
        "with a reference 3D-parallel trainer.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    train = commands.add_parser(
        "train",
        help="train with tp x pp x dp local processes",
        description="Spawn tp*pp*dp local rank processes and train. Under torchrun, use "
        "`python -m trainer` with the same options.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_train_arguments(train)
    train.set_defaults(handler=_train, command_parser=train)

    ingest = commands.add_parser(
        "ingest",
        help="compact runs' telemetry segments into the DuckDB store",
        description="Compact every run's Parquet segments under the runs dir into "
        "<runs-dir>/ranktrace.duckdb. Idempotent: unchanged runs are skipped, changed ones "
        "replaced.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ingest.add_argument("runs", nargs="*", help="run ids to ingest (default: all)")
    ingest.add_argument("--runs-dir", default="runs", help="directory holding the runs")
    ingest.add_argument("--force", action="store_true", help="re-ingest unchanged runs too")
    ingest.set_defaults(handler=_ingest, command_parser=ingest)

    sql = commands.add_parser(
        "sql",
        help="run one read-only SQL query over the store",
        description="Run one SELECT over the store (tables runs, ranks, steps, collectives, "
        "spans, events; view step_stats). See docs/schema.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sql.add_argument("query", help="one SELECT statement")
    _add_runs_dir(sql)
    sql.add_argument("--format", default="table", choices=FORMATS, help="output format")
    sql.add_argument("--max-rows", type=int, default=1000, help="print at most this many rows")
    sql.add_argument(
        "--live",
        metavar="RUN",
        default="",
        help="query this run's segments directly (works while it trains)",
    )
    sql.set_defaults(handler=_sql, command_parser=sql)

    sweep = commands.add_parser(
        "sweep",
        help="train at several values of one layout axis and compare them",
        description="Run the same training once per value of one axis (everything else "
        "fixed), then print one table comparing the runs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sweep.add_argument("--axis", required=True, choices=list(SWEEP_AXES), help="axis to vary")
    sweep.add_argument("--values", required=True, help="comma-separated values, e.g. 1,2,4")
    add_train_arguments(sweep)
    sweep.set_defaults(handler=_sweep, command_parser=sweep)

    dash = commands.add_parser(
        "dash",
        help="serve the web dashboard over the runs dir (localhost)",
        description="Serve the Dash dashboard: runs, run overview, rank heatmaps, step "
        "timelines, comparisons and a read-only SQL page, over the store and live runs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_runs_dir(dash)
    dash.add_argument(
        "--host", default="127.0.0.1", help="address to bind; the default serves this machine only"
    )
    dash.add_argument("--port", type=int, default=8050, help="TCP port")
    dash.set_defaults(handler=_dash, command_parser=dash)

    report = commands.add_parser(
        "report",
        help="stragglers, imbalances, efficiency drops and memory of one run",
        description="Diagnose one run from the store: stragglers (rank, kind, onset, slowdown, "
        "cost), imbalances, MFU drops and memory per rank, predicted vs measured.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    report.add_argument("run", help="run id or name (the latest run of that name)")
    _add_runs_dir(report)
    report.add_argument("--json", action="store_true", help="print JSON instead of tables")
    report.set_defaults(handler=_report, command_parser=report)

    compare = commands.add_parser(
        "compare",
        help="compare two runs phase by phase (warns when more than one axis differs)",
        description="Put two runs side by side: the settings that differ, and step time, "
        "compute, tp/pp/dp communication, MFU, memory and tokens/s with their ratio B/A.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    compare.add_argument("run_a", metavar="RUN_A", help="run id or name")
    compare.add_argument("run_b", metavar="RUN_B", help="run id or name")
    _add_runs_dir(compare)
    compare.add_argument("--json", action="store_true", help="print JSON instead of a table")
    compare.set_defaults(handler=_compare, command_parser=compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    try:
        return args.handler(args, args.command_parser)
    except BrokenPipeError:  # `ranktrace report RUN | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
