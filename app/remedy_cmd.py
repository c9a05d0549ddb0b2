"""`ranktrace remedy RUN [--apply] [--json]`: what to change for each finding of a run and what the
replay says it should give (analysis/remedies.py), best first.

`--apply` re-runs a trainer run with the top remedy and measures what it gives on this machine:
the run as it was (A) and with the remedy (B), trained alternately A B A B (runs
`<name>-baseline`, `<name>-remedy`, `<name>-baseline-2`, `<name>-remedy-2`), so that drift of
the machine falls on both alike; the measured gain is 1 - the median time per training token of
B's steps over A's (steps after the warm-up step). The result is kept in the run's run.json
(`remedy_applied`), which its report and run page show.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ranktrace.telemetry.run_record import read_run_json
from ranktrace.trainer.config import ConfigError, TrainConfig
from ranktrace.trainer.faults import parse_fault

APPLICABLE = ("stage_layers", "length_buckets", "replace_rank", "tp", "pp", "dp")
"""Remedy settings `--apply` can carry out by training again on this machine."""


def add_remedy_parser(commands: argparse._SubParsersAction) -> None:
    """The `remedy` command and its options."""
    remedy = commands.add_parser(
        "remedy",
        help="what to change for each finding, what it should give; --apply measures it",
        description="Print each finding's remedy (rebalanced --stage-layers, length-bucketed "
        "batches, a slow host replaced, ...) with the step time and gain the replay predicts, "
        "best first. --apply re-runs a trainer run with the top remedy and the run itself, "
        "alternately (A B A B), and prints the measured gain beside the predicted one.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    remedy.add_argument("run", help="run id or name")
    remedy.add_argument("--apply", action="store_true",
                        help="train with the top remedy and measure its gain")  # fmt: skip
    remedy.add_argument("--json", action="store_true", help="print JSON")
    remedy.add_argument("--runs-dir", default="runs", help="directory holding the runs and store")
    remedy.set_defaults(handler=remedy_command, command_parser=remedy)


def remedy_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The command (module docstring)."""
    from ranktrace.analysis.run import cached_report
    from ranktrace.analysis.store import StoreError, open_reader
    from ranktrace.app.output import to_json
    from ranktrace.app.report_text import ranked_remedies, remedy_lines

    try:
        con = open_reader(Path(args.runs_dir))
        try:
            report = cached_report(con, args.run)
        finally:
            con.close()
    except StoreError as error:
        parser.error(str(error))
    remedies = ranked_remedies(report)
    if not args.apply:
        if args.json:
            text = to_json({"run_id": report["run_id"], "remedies": remedies})
        elif remedies:
            text = "\n".join([f"remedies for {report['name']} ({report['run_id']}), best first:",
                              *remedy_lines(report)])  # fmt: skip
        else:
            text = f"{report['name']}: no remedy: {_no_remedy(report)}"
        args.command_result.print(text)
        return 0
    if not remedies:
        parser.error(f"run {args.run} has no remedy to apply: {_no_remedy(report)}")
    top = remedies[0]
    base = _trainer_config(Path(args.runs_dir), report, parser)
    changed = _with_remedy(base, top["settings"], parser)
    result = _apply(Path(args.runs_dir), report, base, changed, top, args.json)
    args.command_result.print(to_json(result) if args.json else _applied_lines(top, result))
    return 0


def _no_remedy(report: dict) -> str:
    if report.get("verdict") in ("no_data", "too_few_steps"):
        return report["verdict_detail"]
    return "it has no finding with one" if report["verdict"] == "findings" else "it is healthy"


def _trainer_config(runs_dir: Path, report: dict,
                    parser: argparse.ArgumentParser) -> TrainConfig:  # fmt: skip
    """The run's own configuration, from its run.json; a one-line error for a run the trainer
    did not make."""
    record = read_run_json(runs_dir / report["run_id"])
    config = record.get("config")
    if not config:
        how = report.get("launcher") or ("an import" if report.get("imported") else "another tool")
        parser.error(f"--apply re-runs trainer runs (`ranktrace train`); {report['name']} was "
                     f"recorded by {how}: apply the remedy to the job yourself")  # fmt: skip
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in config.items() if k in fields})


def _with_remedy(base: TrainConfig, settings: dict, parser: argparse.ArgumentParser) -> TrainConfig:
    """The configuration with the remedy's settings; a one-line error where `--apply` cannot
    carry it out here."""
    unknown = [key for key in settings if key not in APPLICABLE]
    if unknown:
        parser.error(f"the top remedy ({', '.join(unknown)}) cannot be carried out by training "
                     "again on this machine; do it on the cluster and compare the runs "
                     "(`ranktrace compare`)")  # fmt: skip
    changes = {}
    if "stage_layers" in settings:
        changes["stage_layers"] = settings["stage_layers"]
    if "length_buckets" in settings:
        changes["length_buckets"] = settings["length_buckets"]
    layout = {k: settings[k] for k in ("tp", "pp", "dp") if k in settings}
    changes.update(layout)
    if "pp" in layout:  # a split of the old pipeline does not fit the new one
        changes["stage_layers"] = ""
    if "replace_rank" in settings:  # the injected fault stands for the bad host: a good one
        rank = settings["replace_rank"]
        changes["inject"] = [s for s in base.inject if parse_fault(s).rank != rank]
    changed = dataclasses.replace(base, **changes)
    try:
        changed.validate()
    except ConfigError as error:
        parser.error(f"the top remedy does not make a valid run: {error}")
    return changed


def _apply(runs_dir: Path, report: dict, base: TrainConfig, changed: TrainConfig,
           remedy: dict, as_document: bool) -> dict:  # fmt: skip
    """Train A B A B (module docstring); the measured gain against the predicted. Progress
    goes where stdout points (stderr while a document is printed, app/output.py), and so do
    the ranks' step lines for a document (`as_document`)."""
    from ranktrace.analysis.ingest import ingest
    from ranktrace.app.jobs import launch_and_ingest
    from ranktrace.telemetry.run_record import update_run_json

    name = report["name"]
    plan = [(base, f"{name}-baseline"), (changed, f"{name}-remedy"),
            (base, f"{name}-baseline-2"), (changed, f"{name}-remedy-2")]  # fmt: skip
    runs = {}
    for cfg, run_name in plan:
        cfg = dataclasses.replace(cfg, run_name=run_name, run_id="", runs_dir=str(runs_dir),
                                  resume="", attempt=0, nproc=0)  # fmt: skip
        print(f"== ranktrace remedy: training {run_name}", flush=True)
        if launch_and_ingest(cfg, ranks_to_stderr=as_document) != 0:
            raise SystemExit(f"ranktrace remedy: error: the {run_name} run failed")
        runs[run_name] = cfg.run_id
    before = _seconds_per_token(runs_dir, [runs[f"{name}-baseline"], runs[f"{name}-baseline-2"]])
    after = _seconds_per_token(runs_dir, [runs[f"{name}-remedy"], runs[f"{name}-remedy-2"]])
    result = {
        "run_id": report["run_id"],
        "action": remedy["action"],
        "settings": remedy["settings"],
        "predicted_gain_pct": remedy["predicted_gain_pct"],
        "measured_gain_pct": round(100 * (1 - after / before), 2),
        "run": f"{name}-remedy",
        "runs": runs,
    }
    update_run_json(runs_dir / report["run_id"], remedy_applied=result)
    ingest(runs_dir, [report["run_id"]], force=True)  # the report shows it
    return result


def _seconds_per_token(runs_dir: Path, run_ids: list[str]) -> float:
    """The median over the runs' steps after the warm-up step of step time per token."""
    from ranktrace.analysis.store import open_reader

    con = open_reader(runs_dir)
    try:
        (value,) = con.execute(
            "SELECT median(seconds / tokens) FROM (SELECT run_id, step, max(step_time_s) AS "
            "seconds, sum(tokens) / count(*) AS tokens FROM steps WHERE run_id IN "
            "(SELECT unnest(?)) AND step >= 1 GROUP BY ALL) WHERE tokens > 0", [run_ids],
        ).fetchone()  # fmt: skip
    finally:
        con.close()
    return float(value)


def _applied_lines(remedy: dict, result: dict) -> str:
    return (f"remedy applied: {remedy['action']}\n"
            f"predicted gain {result['predicted_gain_pct']:.1f}%, measured "
            f"{result['measured_gain_pct']:.1f}% (time per token, A B A B: runs "
            f"{', '.join(result['runs'])})")  # fmt: skip
