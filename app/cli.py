"""The `ranktrace` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.output import FORMATS
from trainer.cli_args import add_train_arguments, config_from_args
from trainer.config import ConfigError


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage mistakes end in one line naming the problem and where to look, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cfg = config_from_args(args)
    try:
        cfg.validate()
    except ConfigError as err:
        parser.error(str(err))
    import torch  # imported only once a job is really going to start

    if cfg.device == "cuda" and torch.cuda.device_count() < cfg.world_size:
        parser.error(
            f"--device cuda needs {cfg.world_size} GPUs on this machine but torch sees "
            f"{torch.cuda.device_count()}; use --device cpu (or auto), or fewer ranks"
        )
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
    return code


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
    sql.add_argument("--runs-dir", default="runs", help="directory holding the runs and store")
    sql.add_argument("--format", default="table", choices=FORMATS, help="output format")
    sql.add_argument("--max-rows", type=int, default=1000, help="print at most this many rows")
    sql.add_argument(
        "--live",
        metavar="RUN",
        default="",
        help="query this run's segments directly (works while it trains)",
    )
    sql.set_defaults(handler=_sql, command_parser=sql)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.handler(args, args.command_parser)


if __name__ == "__main__":
    sys.exit(main())
