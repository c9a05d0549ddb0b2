"""The `ranktrace` command line."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

from ranktrace.analysis.windows import DEFAULT_WINDOW_STEPS
from ranktrace.app.jobs import launch_and_ingest, runs_dir_problem
from ranktrace.app.output import FORMATS, document_output, wants_document
from ranktrace.app.probe_cmd import add_probe_parser
from ranktrace.app.remedy_cmd import add_remedy_parser
from ranktrace.app.run_cmd import add_run_parser
from ranktrace.app.sweep import SWEEP_AXES
from ranktrace.app.watch_cmd import add_watch_parser
from ranktrace.telemetry.names import RUN_KIND_PROBE
from ranktrace.trainer.cli_args import add_train_arguments, config_from_args
from ranktrace.trainer.config import MODELS, ConfigError
from ranktrace.trainer.rank_server import start_rank_server


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage mistakes end in one line naming the problem and where to look, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _check_devices(cfg, parser: argparse.ArgumentParser) -> None:
    if cfg.device != "cuda":
        return
    import torch  # only for a job asking for GPUs: torch takes ~2 s to import

    if torch.cuda.device_count() < cfg.world_size:
        parser.error(
            f"--device cuda needs {cfg.world_size} GPUs on this machine but torch sees "
            f"{torch.cuda.device_count()}; use --device cpu (or auto), or fewer ranks"
        )


def _writable_runs_dir(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A --runs-dir that a run can be written into (created if missing), else a usage error."""
    problem = runs_dir_problem(Path(args.runs_dir))
    if problem:
        parser.error(problem)


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.resume:
        cfg = _resume_config(args, parser)
    else:
        try:
            cfg = config_from_args(args)
            cfg.validate()
        except ConfigError as err:
            parser.error(str(err))
    _check_devices(cfg, parser)
    _writable_runs_dir(args, parser)
    start_rank_server()  # its imports overlap this process's import of torch
    return launch_and_ingest(cfg)


def _resume_config(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The configuration that continues run `--resume`, its checkpoint checked (imports torch)."""
    from ranktrace.trainer.checkpoint import CheckpointError
    from ranktrace.trainer.resume import explicit_train_arguments, resume_config

    try:
        return resume_config(args.runs_dir, args.resume, explicit_train_arguments(args.argv))
    except (ConfigError, CheckpointError) as err:
        parser.error(str(err))


def _ingest(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ranktrace.analysis.ingest import ingest
    from ranktrace.analysis.store import StoreError

    try:
        report = ingest(Path(args.runs_dir), args.runs or None, force=args.force,
                        window_steps=args.window, complete_only=args.complete_windows,
                        workers=args.workers, ray_address=args.ray)  # fmt: skip
    except StoreError as err:
        parser.error(str(err))
    for table, count in report.rows.items():
        print(f"{table:15} {count:>10} rows")
    print(f"ingested {len(report.runs)} run(s) ({report.windows} window(s) written), "
          f"{len(report.skipped)} unchanged")  # fmt: skip
    if report.incomplete:
        print(f"last window held back (ranks still in it): {', '.join(report.incomplete)}")
    return 0


def _sql(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ranktrace.analysis.store import StoreError, open_live, open_reader, query
    from ranktrace.app.output import render

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
    args.command_result.print(render(columns, rows, args.format))
    return 0


def _ingest_finished(runs_dir: Path, runs: list[str], workers: int = 1,
                     ray_address: str | None = None) -> None:  # fmt: skip
    """Ingest the finished runs named (id or name) `runs` whose segments the store does not
    hold yet: a torchrun job of the trainer, a job recorded by `ranktrace.init()` (in `workers`
    processes, or on a Ray cluster). An ingest of a run already stored and unchanged is a cheap
    no-op."""
    from ranktrace.analysis.ingest import ingest
    from ranktrace.analysis.store import StoreError
    from ranktrace.telemetry.run_record import FINISHED_STATUSES, runs_named

    ids = [record["run_id"] for run in runs for record in runs_named(runs_dir, run)
           if record.get("status") in FINISHED_STATUSES]  # fmt: skip
    if ids:  # a store being written meanwhile: the report says what it holds
        with contextlib.suppress(StoreError):
            ingest(runs_dir, ids, workers=workers, ray_address=ray_address)


def _analysis(args: argparse.Namespace, parser: argparse.ArgumentParser, analyze) -> dict:
    """Run `analyze(con)` on the store; StoreErrors become one-line usage errors."""
    from ranktrace.analysis.store import StoreError, open_reader

    try:
        con = open_reader(Path(args.runs_dir))
        try:
            return analyze(con)
        finally:
            con.close()
    except StoreError as err:
        parser.error(str(err))


def _sweep(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ranktrace.analysis.store import open_reader
    from ranktrace.app.output import render
    from ranktrace.app.sweep import parse_values, sweep_configs, sweep_table

    try:
        configs = sweep_configs(config_from_args(args), args.axis, parse_values(args.values))
    except ConfigError as err:
        parser.error(str(err))
    _writable_runs_dir(args, parser)
    for cfg in configs:
        _check_devices(cfg, parser)
    start_rank_server()
    run_ids = []
    for cfg in configs:
        print(f"sweep: {args.axis}={getattr(cfg, args.axis.replace('-', '_'))}", flush=True)
        if launch_and_ingest(cfg) != 0:
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


DASH_REFRESH_S = 2.0
"""Seconds from one re-read of a dashboard page whose run may still change to the next."""


def _dash(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    runs_dir = Path(args.runs_dir)
    if runs_dir.exists() and not runs_dir.is_dir():
        parser.error(f"--runs-dir {runs_dir} is a file, not a directory of runs")
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port} is not a TCP port; choose one in 1..65535")
    refresh_s = getattr(args, "refresh_s", DASH_REFRESH_S)  # `ranktrace demo` has no flag
    if not 0.05 <= refresh_s <= 3600:
        parser.error(f"--refresh-s {refresh_s:g} is out of range; choose 0.05..3600 seconds")

    def serving() -> None:
        print(f"ranktrace dashboard of {runs_dir.resolve()} on http://{args.host}:{args.port}/ "
              "(Ctrl-C stops it)", flush=True)  # fmt: skip

    try:  # Ctrl-C while it starts stops it too
        from ranktrace.app.dashboard import serve

        serve(runs_dir, args.host, args.port, serving, refresh_s=refresh_s)
    except OSError as error:  # the port is taken, or the address is not this machine's
        parser.error(f"cannot serve on {args.host}:{args.port} ({error.strerror or error}); "
                     "choose another --port or --host")  # fmt: skip
    except KeyboardInterrupt:  # Ctrl-C is how a dashboard is stopped: not an error
        pass
    print("ranktrace dashboard stopped", flush=True)
    return 0


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ranktrace.analysis.run import cached_report
    from ranktrace.app.output import to_json
    from ranktrace.app.report_text import format_report

    if args.workers < 1:
        parser.error(f"--workers must be at least 1, not {args.workers}")
    _ingest_finished(Path(args.runs_dir), [args.run], args.workers, args.ray)

    def report_of(con) -> dict:
        return cached_report(con, args.run, args.workers, args.ray)

    if args.html:
        from ranktrace.app.html_report import html_report

        def page_of(con) -> str:
            result = report_of(con)
            if result.get("kind") == RUN_KIND_PROBE:
                parser.error(f"run {args.run} is a probe: it has no HTML report; drop --html")
            return html_report(con, result)

        page = _analysis(args, parser, page_of)
        _write_output(parser, "--html", args.html, page)
        print(f"wrote {args.html} ({len(page) / 1e6:.1f} MB, self-contained: open it in a browser)")
        return 0
    result = _analysis(args, parser, report_of)
    args.command_result.print(to_json(result) if args.json else format_report(result))
    return 0


def _import(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ranktrace.app.report_text import format_report
    from ranktrace.importers.importing import import_ops
    from ranktrace.importers.kineto import read_profiler
    from ranktrace.importers.ops import TraceError
    from ranktrace.importers.perop import REPLAY_MODEL as PEROP_REPLAY_MODEL
    from ranktrace.importers.perop import folding, read_perop

    started = time.perf_counter()  # the work, after Python's start and the imports
    try:
        if args.format == "per-op":
            for axis in ("tp", "pp", "dp"):
                if getattr(args, axis) < 1:
                    parser.error(f"--{axis} {getattr(args, axis)} must be at least 1")
            ops, workers = read_perop(Path(args.trace), args.pp, args.dp)
            layout = {"tp": args.tp, "pp": args.pp, "dp": args.dp}
            model = PEROP_REPLAY_MODEL
            extra = {"folded": folding(workers, args.tp, args.pp, args.dp),
                     "world_size": args.pp * args.dp}  # fmt: skip
        else:
            trace = read_profiler(Path(args.trace))
            ops, workers, model = trace.ops, trace.workers, trace.replay_model
            layout = {axis: int(workers[axis].max()) + 1 for axis in ("tp", "pp", "dp")}
            extra = {"gpu_time": trace.gpu_time_record()} if trace.gpu_time else {}
        source = {"format": args.format, "path": str(Path(args.trace).resolve()),
                  "replay_model": model}  # fmt: skip
        read_s = time.perf_counter() - started
        imported = import_ops(Path(args.runs_dir), ops, workers, args.name, layout, source,
                              extra)  # fmt: skip
    except TraceError as err:
        parser.error(str(err))
    steps = imported.report["imported"]
    print(f"imported {imported.ops} ops of {imported.workers} workers (steps "
          f"{steps['first_step']}-{steps['last_step']}) as run {imported.run_id} in "
          f"{read_s + imported.seconds:.2f} s (read {read_s:.2f} s; write, ingest and report "
          f"{imported.seconds:.2f} s)\n")  # fmt: skip
    print(format_report(imported.report))
    return 0


def _compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ranktrace.analysis.run import compare
    from ranktrace.app.output import to_json
    from ranktrace.app.report_text import format_comparison

    _ingest_finished(Path(args.runs_dir), [args.run_a, args.run_b])
    result = _analysis(args, parser, lambda con: compare(con, args.run_a, args.run_b))
    args.command_result.print(to_json(result) if args.json else format_comparison(result))
    return 0


def _write_output(parser: argparse.ArgumentParser, flag: str, path: str, text: str) -> None:
    """Write a file the user named; an unwritable path is a one-line usage error."""
    try:
        Path(path).write_text(text)
    except OSError as error:
        parser.error(f"{flag} {path}: cannot write it ({error.strerror or error})")


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ranktrace.analysis.memory import ModelShape
    from ranktrace.analysis.planner import HEADROOM, MATMUL_EFFICIENCY, Cluster, PlanError, plan
    from ranktrace.app.output import render, to_json
    from ranktrace.trainer.config import MODELS

    for name in ("gpus", "gpus_per_node", "gpu_mem", "seq_len", "global_batch", "gpu_tflops",
                 "intra_node_gbps", "inter_node_gbps", "top"):  # fmt: skip
        value = getattr(args, name)
        if value < 0 or (value == 0 and name != "global_batch"):
            parser.error(f"--{name.replace('_', '-')}={value} must be positive")
    m = MODELS[args.model]
    shape = ModelShape(m.vocab_size, m.hidden, m.n_layers, m.n_heads, m.ffn_hidden)
    cluster = Cluster(args.gpus, args.gpu_mem, args.gpus_per_node, args.gpu_tflops,
                      args.intra_node_gbps, args.inter_node_gbps)  # fmt: skip
    global_batch = args.global_batch or max(1, 128 * args.gpus // args.gpus_per_node)
    try:
        fits, reasons = plan(shape, m.n_params(), cluster, args.seq_len, global_batch)
    except PlanError as error:
        parser.error(str(error))
    if args.json:
        document = {"model": args.model, "n_params": m.n_params(), "global_batch": global_batch,
                    "seq_len": args.seq_len, "cluster": cluster.__dict__,
                    "plans": [p.to_dict() for p in fits], "not_fitting": reasons}  # fmt: skip
        args.command_result.print(to_json(document))
        return 0 if fits else 1
    print(f"model {args.model} ({m.n_params() / 1e9:.2f}B params), {args.gpus} GPUs of "
          f"{args.gpu_mem:g} GB ({args.gpus_per_node} per node), sequence {args.seq_len}, "
          f"global batch {global_batch} sequences (micro-batch 1)")  # fmt: skip
    for reason in reasons:
        print(f"does not fit: {reason}")
    if not fits:
        return 1
    rows = [
        (p.tp, p.pp, p.dp, p.zero, p.micro_batches, f"{p.memory_gb:.1f}", f"{p.step_s:.2f}",
         f"{100 * p.mfu:.1f}%", f"{p.compute_s:.2f}", f"{p.bubble_s:.2f}", f"{p.tp_comm_s:.2f}",
         f"{p.dp_comm_s:.2f}", f"{p.pp_comm_s:.3f}")
        for p in fits[: args.top]
    ]  # fmt: skip
    columns = ["tp", "pp", "dp", "zero", "M", "GB/GPU", "step s", "MFU", "compute", "bubble",
               "tp comm", "dp comm", "pp comm"]  # fmt: skip
    print(f"\n{len(fits)} layouts fit; the {min(args.top, len(fits))} fastest by estimated "
          f"step time:")  # fmt: skip
    print(render(columns, rows, "table"))
    print(f"model: compute at {MATMUL_EFFICIENCY:.0%} of {args.gpu_tflops:g} TFLOP/s peak, "
          f"1F1B bubble (pp-1)/M, ring all-reduces at {args.intra_node_gbps:g} GB/s in a node "
          f"and {args.inter_node_gbps:g} GB/s between nodes, no overlap; memory leaves "
          f"{HEADROOM:.0%} free, activations without recomputation "
          f"(analysis/planner.py)")  # fmt: skip
    return 0


DEFAULT_EXPORT_STEPS = 3
"""`export-trace` without --steps: this many of the run's last traced steps."""


def _export_trace(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import json

    from ranktrace.analysis.run import resolve_run
    from ranktrace.analysis.trace_export import chrome_trace

    steps: list[int] = []
    if args.steps is not None:
        first, sep, last = args.steps.partition("-")
        if not (first.isdigit() and (not sep or last.isdigit())):
            parser.error(f"--steps {args.steps} is not a step range; give A-B (e.g. 10-12) or A")
        steps = [int(first), int(last) if sep else int(first)]
        if steps[1] < steps[0]:
            parser.error(f"--steps {args.steps}: the range ends before it starts")

    def export(con) -> dict:
        run_id = resolve_run(con, args.run)["run_id"]
        if not steps:  # the last DEFAULT_EXPORT_STEPS steps with traced collectives, or steps
            (last,) = con.execute(
                "SELECT coalesce((SELECT max(step) FROM collectives WHERE run_id = $run), "
                "(SELECT max(step) FROM steps WHERE run_id = $run))", {"run": run_id},
            ).fetchone()  # fmt: skip
            steps.extend([max(0, (last or 0) - DEFAULT_EXPORT_STEPS + 1), last or 0])
        return chrome_trace(con, run_id, steps[0], steps[1])

    trace = _analysis(args, parser, export)
    first_step, last_step = steps
    if not trace["traceEvents"]:
        parser.error(f"run {args.run} has no spans in steps {first_step}-{last_step}")
    _write_output(parser, "--output", args.output, json.dumps(trace))
    ranks = {e["pid"] for e in trace["traceEvents"]}
    print(f"wrote {args.output}: steps {first_step}-{last_step} of {len(ranks)} ranks, "
          f"{len(trace['traceEvents'])} events; open it in https://ui.perfetto.dev "
          f"or chrome://tracing")  # fmt: skip
    return 0


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ranktrace.app.demo import print_results, run_demo

    _writable_runs_dir(args, parser)
    runs_dir = Path(args.runs_dir)
    start_rank_server()
    code, sweep_ids, straggler_id = run_demo(str(runs_dir))
    if code != 0:
        return code
    print_results(runs_dir, sweep_ids, straggler_id)
    print(f"\nexplore: ranktrace sql --runs-dir {runs_dir} \"SELECT * FROM step_stats\" · "
          f"ranktrace report {straggler_id} --runs-dir {runs_dir} --html report.html")  # fmt: skip
    if args.no_dash:
        return 0
    print(f"\n== the dashboard (run {straggler_id} has the straggler):")
    args.host = "127.0.0.1"
    return _dash(args, parser)


def _add_runs_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs-dir", default="runs", help="directory holding the runs and store")


def _add_workers_and_ray(parser: argparse.ArgumentParser, work: str) -> None:
    """--workers N and --ray ADDRESS: where `work` runs (windows are independent)."""
    parser.add_argument("--workers", type=int, default=1,
                        help=f"{work} in this many local processes")  # fmt: skip
    parser.add_argument(
        "--ray", default=None, metavar="ADDRESS",
        help=f"{work} as tasks on the Ray cluster at ADDRESS (e.g. 10.0.0.1:6379; its nodes "
        "must read the same runs directory); needs `pip install 'ranktrace[ray]'`",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="ranktrace",
        description="Profiling and straggler diagnosis for distributed training, "
        "with a reference 3D-parallel trainer.",
        epilog="With --json (or --format csv|json) a command prints exactly one document on "
        "stdout, for a program to read whole; its progress and the trainer's log lines go to "
        "stderr.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    demo = commands.add_parser(
        "demo",
        help="the main job on embedded defaults: a sweep, a straggler run, report, dashboard",
        description="Train a one-axis sweep (tp 1 -> 2 at pp=2, dp=2) and a tp=2 pp=2 dp=2 run "
        "with an injected compute straggler (`small` model, a few minutes on 2 CPU cores), "
        "print the sweep table and the straggler run's report, then serve the dashboard.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_runs_dir(demo)
    demo.add_argument("--no-dash", action="store_true", help="stop after the report")
    demo.add_argument("--port", type=int, default=8050, help="the dashboard's TCP port")
    demo.set_defaults(handler=_demo, command_parser=demo)

    train = commands.add_parser(
        "train",
        help="train with tp x pp x dp local processes",
        description="Spawn tp*pp*dp local rank processes and train. Under torchrun, use "
        "`python -m ranktrace.trainer` with the same options.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_train_arguments(train)
    train.set_defaults(handler=_train, command_parser=train)

    ingest = commands.add_parser(
        "ingest",
        help="compact runs' telemetry segments into the store",
        description="Compact every run's Parquet segments under the runs dir into the store: "
        "windows of steps under <runs-dir>/ranktrace.windows/, listed by the catalog "
        "<runs-dir>/ranktrace.duckdb. Incremental and idempotent: a window is written again "
        "only when its segments changed, unchanged runs are skipped.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ingest.add_argument("runs", nargs="*", help="run ids to ingest (default: all)")
    ingest.add_argument("--runs-dir", default="runs", help="directory holding the runs")
    ingest.add_argument("--force", action="store_true", help="re-ingest unchanged runs too")
    ingest.add_argument(
        "--window", type=int, default=None, metavar="STEPS",
        help="steps per window (default: the run's earlier ingest's, else "
        f"{DEFAULT_WINDOW_STEPS}); a new size writes the run's windows again",
    )  # fmt: skip
    ingest.add_argument(
        "--complete-windows", action="store_true",
        help="of a run still training, write only the windows every rank has finished (what "
        "`ranktrace watch` and the dashboard do); its last window waits for a later ingest",
    )  # fmt: skip
    _add_workers_and_ray(ingest, "derive the windows, and diagnose the report's analysis windows,")
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
    dash.add_argument(
        "--refresh-s",
        type=float,
        default=DASH_REFRESH_S,
        help="seconds from one re-read of a page whose run may still change to the next (each "
        "starts once the one before has returned)",
    )
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
    report.add_argument(
        "--html",
        metavar="FILE",
        default="",
        help="write one self-contained offline HTML file (findings, heatmap, breakdown, memory)",
    )
    _add_workers_and_ray(report, "diagnose a long run's analysis windows (for a report computed "
                         "afresh: one the store holds is read as it is)")  # fmt: skip
    report.set_defaults(handler=_report, command_parser=report)

    importer = commands.add_parser(
        "import",
        help="bring a trace of a job ranktrace did not run (per-op Parquet, torch profiler)",
        description="Import a training job's trace into the store as a run and report it: "
        "stragglers, imbalances, slowdown and its causes. `per-op TRACE.parquet --tp T --pp P "
        "--dp D`: one row per operation of each (dp_rank, stage) worker; `torch-profiler DIR`: "
        "one PyTorch profiler (Kineto) JSON trace per rank. Nothing is kept when it fails.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    importer.add_argument("format", choices=("per-op", "torch-profiler"), help="trace format")
    importer.add_argument("trace", help="per-op: the Parquet file; torch-profiler: the folder")
    importer.add_argument("--tp", type=int, default=1, help="per-op: tensor-parallel degree")
    importer.add_argument("--pp", type=int, default=1, help="per-op: pipeline stages")
    importer.add_argument("--dp", type=int, default=1, help="per-op: data-parallel degree")
    importer.add_argument("--name", default="", help="run name (default: the run id)")
    _add_runs_dir(importer)
    importer.set_defaults(handler=_import, command_parser=importer)

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

    planner = commands.add_parser(
        "plan",
        help="layouts of a model on a cluster that fit in memory, fastest first",
        description="Enumerate (tp, pp, dp, zero) layouts of a named model on N GPUs, keep those "
        "that fit in memory (the analysis memory model), rank them by an estimated step time, "
        "and say why the others do not fit. TP stays within a node.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    planner.add_argument("--model", required=True, choices=sorted(MODELS), help="model config")
    planner.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    planner.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU, GB")
    planner.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    planner.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    planner.add_argument(
        "--global-batch",
        type=int,
        default=0,
        help="sequences per step (0: 128 per node)",
    )
    planner.add_argument("--gpu-tflops", type=float, default=989.0, help="peak bf16 TFLOP/s")
    planner.add_argument(
        "--intra-node-gbps", type=float, default=450.0, help="GB/s per GPU inside a node"
    )
    planner.add_argument(
        "--inter-node-gbps", type=float, default=50.0, help="GB/s per GPU between nodes"
    )
    planner.add_argument("--top", type=int, default=10, help="print this many layouts")
    planner.add_argument("--json", action="store_true", help="print JSON (every layout that fits)")
    planner.set_defaults(handler=_plan, command_parser=planner)

    export = commands.add_parser(
        "export-trace",
        help="a Chrome/Perfetto trace of all ranks for a range of steps",
        description="Write the spans of steps A-B of every rank as a Chrome trace-event JSON "
        "file (one process per rank; threads step, phases, collectives), for ui.perfetto.dev.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    export.add_argument("run", help="run id or name")
    export.add_argument(
        "--steps", default=None, metavar="A-B",
        help=f"steps, both included (default: the last {DEFAULT_EXPORT_STEPS} traced steps)",
    )  # fmt: skip
    export.add_argument("-o", "--output", required=True, help="the trace file to write")
    _add_runs_dir(export)
    export.set_defaults(handler=_export_trace, command_parser=export)

    add_probe_parser(commands)
    add_remedy_parser(commands)
    add_run_parser(commands)
    add_watch_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    try:
        with document_output(wants_document(args)) as args.command_result:
            return args.handler(args, args.command_parser)
    except BrokenPipeError:  # `ranktrace report RUN | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as error:  # the catalog file met in a query, after it opened
        if "duckdb" not in type(error).__module__:
            raise
        from ranktrace.analysis.store import store_problem

        problem = store_problem(error)
        if problem is None:
            raise
        args.command_parser.error(str(problem))


if __name__ == "__main__":
    sys.exit(main())
