"""The analysis facade: one run's report (stragglers, imbalances, efficiency drops, memory) and
the comparison of two runs, as plain dicts ready for JSON, tables or the dashboard.

Every function takes an open store connection (`analysis.store.open_reader` or `open_live`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd

from ranktrace.analysis import (
    capture,
    efficiency,
    imbalances,
    memory,
    resilience,
    self_check,
    stragglers,
    topology,
    verdict,
    window_report,
)
from ranktrace.analysis import layout_remedy as layouts
from ranktrace.analysis.peers import WARMUP_STEPS
from ranktrace.analysis.probe import linked_probes, probe_report
from ranktrace.analysis.remedies import RunShape
from ranktrace.analysis.run_part import Part
from ranktrace.analysis.store import StoreError
from ranktrace.telemetry.names import EVENT_CAPTURE_LIMITED, RUN_KIND_PROBE

LAYOUT_AXES = ("tp", "pp", "dp", "zero", "micro_batches")
"""Axes a layout comparison varies one at a time (columns of `runs`)..."""
PLACEMENT_AXES = ("rank_order",)
"""...and where the mesh puts them (the trainer's --rank-order; TP-inside vs TP-across nodes)."""
DEFAULT_RANK_ORDER = "tp-dp-pp"
"""The trainer's default rank order (runs recorded before --rank-order existed used it)."""
OTHER_SETTINGS = ("model", "global_batch", "seq_len", "precision", "schedule",
                  "sequence_parallel", "stage_layers")  # fmt: skip
"""Settings that also make two runs incomparable when they differ (the world size follows from
the axes; `stage_layers` is the explicit split, None for the default even one)."""


def resolve_run(con: duckdb.DuckDBPyConnection, run: str) -> dict:
    """The `runs` row (plus its parsed run.json as `record`) of a run id or name; the latest
    run of that name when several share it."""
    rows = con.execute(
        "SELECT * FROM runs WHERE run_id = $1 OR name = $1 ORDER BY started_at DESC", [run]
    ).df()
    if rows.empty:
        known = [
            r[0] for r in con.execute("SELECT name FROM runs ORDER BY started_at DESC").fetchall()
        ]
        hint = f"known runs: {', '.join(known[:5])}" if known else "the store has no runs"
        raise StoreError(f"no run with id or name '{run}' ({hint})")
    row = rows.iloc[0].to_dict()
    row["record"] = json.loads(row["run_json"]) if row.get("run_json") else {}
    return row


def run_settings(row: dict) -> dict:
    """The settings two runs must share to be compared (LAYOUT_AXES and OTHER_SETTINGS)."""
    record = row["record"]
    config = record.get("config", {})
    return {
        "tp": row["tp"], "pp": row["pp"], "dp": row["dp"], "zero": row["zero"],
        "micro_batches": row["micro_batches"], "model": row["model"],
        "global_batch": row["global_batch"], "seq_len": row["seq_len"],
        "precision": row["precision"], "schedule": row["schedule"],
        "sequence_parallel": bool(record.get("sequence_parallel", False)),
        "stage_layers": config.get("stage_layers") or None,
        "rank_order": config.get("rank_order") or DEFAULT_RANK_ORDER,
        "world_size": row["world_size"],
    }  # fmt: skip


SWEEP_SETTINGS = ("steps", "faults", "data")
"""Besides run_settings, what a sweep's points must share: the same length of run, the same
injected faults (none, or the same), the same data (source, length distribution, buckets)."""


def sweep_settings(row: dict) -> dict:
    """run_settings and SWEEP_SETTINGS: everything two points of a one-axis sweep must share
    but the axis. Seeds are not compared: runs of one value with different seeds are repeats."""
    record = row["record"]
    config = record.get("config", {})
    data = [config.get("data") or record.get("data"), config.get("seq_len_dist") or None,
            config.get("length_buckets") or None]  # fmt: skip
    return {**run_settings(row), "steps": config.get("steps", record.get("steps")),
            "faults": ", ".join(config.get("inject") or []) or "none",
            "data": " ".join(str(part) for part in data if part) or None}  # fmt: skip


def sweep_runs(con: duckdb.DuckDBPyConnection, run_a: str, axis: str) -> tuple[list, list]:
    """(points, near misses) of the one-axis sweep through run A: points are (axis value, run
    row) of every run equal to A in sweep_settings but `axis` (world_size follows the axes);
    near misses (run row, {setting: (A's, its)}) the runs that differ from A in `axis` and in
    one to three other settings: listed, never plotted."""
    base_row = resolve_run(con, run_a)
    base = sweep_settings(base_row)
    points, misses = [], []
    for (run_id,) in con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall():
        row = resolve_run(con, run_id)
        settings = sweep_settings(row)
        differ = {k: (base[k], settings[k]) for k in settings
                  if k not in (axis, "world_size") and settings[k] != base[k]}  # fmt: skip
        if not differ:
            points.append((settings[axis], row))
        elif len(differ) <= 3 and settings[axis] != base[axis]:
            misses.append((row, differ))
    return points, misses


def memory_by_rank(con: duckdb.DuckDBPyConnection, row: dict) -> list[dict]:
    """Predicted bytes per rank (memory.py, as the reference trainer holds them) next to the
    measured buffer sizes, peak RSS and USS (medians over steps)."""
    record = row["record"]
    shape = record.get("model_config")
    if not shape:
        return []  # a run recorded before run.json carried the model's dimensions
    model = memory.ModelShape.of(shape)
    s = run_settings(row)
    predicted = memory.predict(
        model, s["tp"], s["pp"], s["dp"], s["zero"], s["precision"], record.get("stage_layers"),
        micro_batch=s["global_batch"] // (s["dp"] * s["micro_batches"]), seq_len=s["seq_len"],
        micro_batches=s["micro_batches"], schedule=s["schedule"], grads_sharded=False,
    )  # fmt: skip
    measured = con.execute(
        "SELECT rank, any_value(pp) AS pp, median(mem_params_bytes + mem_grads_bytes "
        "+ mem_optimizer_bytes) AS state, max(mem_rss_peak_bytes) AS rss, "
        "median(mem_uss_bytes) AS uss FROM steps WHERE run_id = ? GROUP BY rank ORDER BY rank",
        [row["run_id"]],
    ).fetchall()
    out = []
    for rank, stage, state, rss, uss in measured:
        entry = memory.RankMemory(**{**predicted[stage].__dict__, "rank": int(rank)})
        entry.measured_state_bytes = int(state) if state is not None else None
        entry.measured_rss_peak_bytes = int(rss) if rss is not None else None
        entry.measured_uss_bytes = int(uss) if uss is not None and not np.isnan(uss) else None
        out.append(entry.to_dict())
    return out


def _events(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict]:
    return (
        con.execute(
            "SELECT rank, step, kind, detail FROM events WHERE run_id = ? ORDER BY time_ns",
            [run_id],
        )
        .df()
        .to_dict("records")
    )


def capture_notes(events: list[dict]) -> list[str]:
    """One note per hook `ranktrace run` could not install (so recorded less), with its ranks."""
    ranks: dict[str, list[int]] = {}
    for event in events:
        if event["kind"] == EVENT_CAPTURE_LIMITED:
            ranks.setdefault(event["detail"], []).append(int(event["rank"]))
    return [f"capture, rank{'s' if len(r) > 1 else ''} {', '.join(map(str, sorted(set(r))))}: "
            f"{detail}" for detail, r in ranks.items()]  # fmt: skip


def _number(value) -> float | None:
    """A stored number, None where it is missing (NULL or NaN: never NaN in the JSON)."""
    return None if value is None or pd.isna(value) else float(value)


def _median(series: pd.Series) -> float | None:
    value = series.median()
    return None if pd.isna(value) else float(value)


def report(con: duckdb.DuckDBPyConnection, run: str, workers: int = 1,
           ray_address: str | None = None) -> dict:  # fmt: skip
    """Everything ranktrace concludes about one run (`ranktrace report --json` prints this).

    A run longer than one analysis window is diagnosed window by window, each window reading
    only its own files, in this process, in `workers` local processes or on the Ray cluster at
    `ray_address` (analysis/window_report.py), and the windows' findings and replays merged
    (analysis/window_merge.py); a shorter one, and a live run, in one piece."""
    row = resolve_run(con, run)
    if row.get("kind") == RUN_KIND_PROBE:  # a measurement of the network: no steps
        return probe_report(row)
    return _assembled(con, row, window_report.run_part(con, row, workers, ray_address))


def _assembled(con: duckdb.DuckDBPyConnection, row: dict, part: Part) -> dict:
    """The report of `row`'s run from its diagnosed part (or the windows' parts merged) and
    what is read over the whole run at once (events, memory, topology: small)."""
    run_id = row["run_id"]
    job_step, per_step = part.job_step, part.per_step
    drops = efficiency.efficiency_drops(per_step)
    efficiency.explain(drops, part.stragglers)
    replayed = part.replayed
    events = _events(con, run_id)
    folded = row["record"].get("folded")  # an imported trace's workers (analysis/capture.py)
    partial = capture.partial_capture(con, run_id, row["world_size"], row["status"], folded)
    notes = [*capture_notes(events), *capture.folded_note(folded), *part.notes,
             *capture.unreplayed_note(partial, replayed.get("slowdown"))]  # fmt: skip
    result = {
        "run_id": run_id,
        "name": row["name"],
        "status": row["status"],
        "layout": {axis: row[axis] for axis in LAYOUT_AXES},
        "settings": run_settings(row),
        "steps": int(job_step.size),
        "step_time_s": _median(job_step),
        "mfu": _median(per_step["mfu"]) if not per_step.empty else None,
        "tokens_per_s": _number(row["tokens_per_s"]),
        "stragglers": [f.to_dict() for f in part.stragglers],
        "imbalances": [i.to_dict() for i in part.imbalances],
        "efficiency_drops": [d.to_dict() for d in drops],
        "memory": memory_by_rank(con, row),
        "events": events,
        "restarts": [r.to_dict() for r in resilience.restarts(con, run_id)],
        "checkpoints": resilience.checkpoint_summary(
            con, run_id, row["record"].get("config", {}), _median(job_step)
        ),
        "hangs": [h.to_dict() for h in resilience.hangs(con, run_id)],
        "topology": topology.topology(con, run_id, _communication_axes(part.stragglers)),
        **replayed,
        "imported": row["record"].get("imported"),
        "command": row["record"].get("command"),  # a job recorded by `ranktrace run`
        "launcher": row["record"].get("launcher"),  # ranktrace run, ranktrace.init
        "gpu_time": row["record"].get("gpu_time"),  # imported GPU traces: per-rank time split
        "remedy_applied": row["record"].get("remedy_applied"),  # ranktrace remedy --apply
        "notes": notes,
        "capture": partial,
        "probes": linked_probes(con, run_id),  # `ranktrace probe --for` this run
        "thresholds": {
            "min_slowdown": stragglers.MIN_SLOWDOWN,
            "min_cost_pct": stragglers.MIN_COST_PCT,
            "transient_chance": stragglers.TRANSIENT_CHANCE,
            "stage_min_excess": imbalances.STAGE_MIN_EXCESS,
            "random_min_cost_pct": imbalances.RANDOM_MIN_COST_PCT,
            "min_drop": efficiency.MIN_DROP,
            "min_verdict_steps": verdict.MIN_VERDICT_STEPS,
        },
    }
    verdict.apply_verdict(result, verdict.recorded_steps(con, run_id))
    _judged_by_probes(result)
    result["layout_remedy"] = _layout_remedy(con, row, result)
    result["self_check"] = self_check.contradictions(result)
    if result["self_check"] and os.environ.get("RANKTRACE_SELF_CHECK") == "strict":
        raise self_check.SelfCheckError(f"report of {row['name']}: " +
                                        "; ".join(result["self_check"]))  # fmt: skip
    return result


def _layout_remedy(con: duckdb.DuckDBPyConnection, row: dict, result: dict) -> dict | None:
    """A healthy trainer run's layout remedy (analysis/layout_remedy.py), or None."""
    shape = RunShape.of(row["record"])
    if shape is None or result["verdict"] != verdict.HEALTHY or not result["step_time_s"]:
        return None
    if result["topology"]["inter_node_unjudged"] or any(
        p["slow_senders"] or p["slow_receivers"] or p["slow_ranks"] for p in result["probes"]
    ):  # its network may be, or is, what is slow
        return None
    parts = layouts.measured_parts(con, row["run_id"])
    if parts is None:
        return None
    s = result["settings"]
    job = layouts.Job(memory.ModelShape.of(shape.model), int(s["global_batch"]),
                      int(s["seq_len"]), int(s["zero"]), s["precision"],
                      layouts.ring_rate(con, row["run_id"]))  # fmt: skip
    now = layouts.Layout(int(s["tp"]), int(s["pp"]), int(s["dp"]), int(s["micro_batches"]))
    return layouts.layout_remedy(parts, job, now, result["step_time_s"], result["mfu"])


def _communication_axes(findings: list) -> set[str]:
    """Axes on which a communication straggler was found."""
    return {
        axis for f in findings if f.kind == "communication" for axis in (f.axis, *f.axes) if axis
    }


@functools.cache
def analysis_version() -> str:
    """A digest of the analysis code (modules and SQL): a stored report made by other code is
    computed afresh."""
    package = Path(__file__).parent
    digest = hashlib.sha1()
    for path in sorted([*package.glob("*.py"), *package.glob("sql/*.sql")]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cached_report(con: duckdb.DuckDBPyConnection, run: str, workers: int = 1,
                  ray_address: str | None = None) -> dict:  # fmt: skip
    """The report ingest stored for this run when the analysis code is the same, else
    `report(con, run, workers, ray_address)` afresh (a live run, an older store, newer
    code)."""
    run_id = resolve_run(con, run)["run_id"]
    try:
        stored = con.execute(
            "SELECT report FROM reports WHERE run_id = ? AND analysis_version = ? "
            "AND report IS NOT NULL",
            [run_id, analysis_version()],
        ).fetchone()
    except duckdb.CatalogException:  # no reports table: a live run, or a store from before
        stored = None
    if not stored:
        return report(con, run_id, workers, ray_address)
    result = json.loads(stored[0])
    if result.get("kind") != RUN_KIND_PROBE:  # probes made for the run since it was stored
        result["probes"] = linked_probes(con, run_id)
        _judged_by_probes(result)
    return result


def _judged_by_probes(result: dict) -> None:
    """Clear `topology.inter_node_unjudged` of a run a probe was made for: the probe measured
    its network (its verdict is in `probes`)."""
    if result["probes"] and (result.get("topology") or {}).get("inter_node_unjudged"):
        result["topology"]["inter_node_unjudged"] = None


COMPARED_METRICS = {
    "step_time_s": "max(step_time_s)",
    "compute_s": "avg(work_s)",
    "tp_comm_s": "avg(coalesce(tp_transfer_s, 0) + coalesce(tp_blocking_s, 0))",
    "pp_comm_s": "avg(pipeline_wait_s)",
    "dp_comm_s": "avg(coalesce(dp_transfer_s, 0) + coalesce(dp_blocking_s, 0))",
    "data_s": "avg(data_s)",
    "optimizer_s": "avg(optimizer_s)",
    "mfu": "median(mfu)",
}
"""Per step over the ranks (the job's step time is its slowest rank's), then the median over
steps: seconds per step unless named."""


def run_metrics(con: duckdb.DuckDBPyConnection, row: dict) -> dict:
    """Medians a layout comparison puts side by side (COMPARED_METRICS, tokens/s, memory)."""
    per_step = ", ".join(f"{sql} AS {name}" for name, sql in COMPARED_METRICS.items())
    medians = ", ".join(f"median({name})" for name in COMPARED_METRICS)
    values = con.execute(
        f"SELECT {medians}, count(*) FROM (SELECT {per_step} FROM step_breakdown "
        "WHERE run_id = ? AND step >= ? GROUP BY step)",
        [row["run_id"], WARMUP_STEPS],
    ).fetchone()
    if not values[-1]:
        return {}
    metrics = dict(zip(COMPARED_METRICS, values[:-1], strict=True))
    metrics["tokens_per_s"] = row["tokens_per_s"]
    if con.execute(
        "SELECT count(DISTINCT host) > 1 FROM ranks WHERE run_id = ?", [row["run_id"]]
    ).fetchone()[0]:
        metrics.update(topology.transfer_by_locality(con, row["run_id"]))
    mem = memory_by_rank(con, row)
    if mem:
        metrics["state_bytes_per_rank"] = max(m["predicted_state_bytes"] for m in mem)
        measured = [m["measured_rss_peak_bytes"] for m in mem if m["measured_rss_peak_bytes"]]
        metrics["rss_peak_bytes_per_rank"] = max(measured) if measured else None
    return metrics


NOISE_SIGMAS = 3.0
"""A difference is beyond the noise when it exceeds this many standard errors of the two
medians together (each from its run's step-to-step spread: 1.2533 × 1.4826 × MAD / √n)."""


def metric_noise(con: duckdb.DuckDBPyConnection, run_id: str) -> dict:
    """Per COMPARED_METRICS metric: the standard error of the run's median over its steps,
    from the spread of its steps on this machine (a robust sigma, 1.4826 × MAD)."""
    per_step = ", ".join(f"{sql} AS {name}" for name, sql in COMPARED_METRICS.items())
    frame = con.execute(f"SELECT {per_step} FROM step_breakdown WHERE run_id = ? AND step >= ? "
                        "GROUP BY step", [run_id, WARMUP_STEPS]).df()  # fmt: skip
    noise = {}
    for name in COMPARED_METRICS:
        values = frame[name].dropna()
        if len(values) >= 3:
            mad = (values - values.median()).abs().median()
            noise[name] = 1.2533 * 1.4826 * float(mad) / len(values) ** 0.5
    return noise


def compare(con: duckdb.DuckDBPyConnection, run_a: str, run_b: str) -> dict:
    """Two runs side by side: which axes differ, and (confounded when more than one setting
    differs) each metric with B / A."""
    a, b = resolve_run(con, run_a), resolve_run(con, run_b)
    settings_a, settings_b = run_settings(a), run_settings(b)
    compared = (*LAYOUT_AXES, *PLACEMENT_AXES, *OTHER_SETTINGS)
    differing = [k for k in compared if settings_a[k] != settings_b[k]]
    differing_axes = [k for k in differing if k in (*LAYOUT_AXES, *PLACEMENT_AXES)]
    metrics_a, metrics_b = run_metrics(con, a), run_metrics(con, b)
    noise_a, noise_b = metric_noise(con, a["run_id"]), metric_noise(con, b["run_id"])
    rows = []
    for name in metrics_a.keys() | metrics_b.keys():
        value_a, value_b = metrics_a.get(name), metrics_b.get(name)
        ratio = value_b / value_a if value_a and value_b is not None else None
        beyond = None
        if value_a is not None and value_b is not None and name in noise_a and name in noise_b:
            band = NOISE_SIGMAS * (noise_a[name] ** 2 + noise_b[name] ** 2) ** 0.5
            beyond = bool(abs(value_b - value_a) > band)
        rows.append({"metric": name, "a": value_a, "b": value_b, "ratio": ratio,
                     "beyond_noise": beyond})  # fmt: skip
    order = list(metrics_a) + [k for k in metrics_b if k not in metrics_a]
    rows.sort(key=lambda r: order.index(r["metric"]))
    confounded = len(differing) > 1
    peaks = {"a": _host_peak(con, a["run_id"]), "b": _host_peak(con, b["run_id"])}
    warning = None
    if confounded:
        warning = (
            f"these runs differ in {len(differing)} settings ({', '.join(differing)}): the "
            f"comparison is confounded; change one axis at a time"
        )
    return {
        "run_a": a["run_id"], "run_b": b["run_id"], "name_a": a["name"], "name_b": b["name"],
        "settings_a": settings_a, "settings_b": settings_b,
        "differing_axes": differing_axes, "differing_settings": differing,
        "confounded": confounded, "warning": warning, "metrics": rows,
        "peaks": peaks, "peak_note": _peak_note(peaks["a"], peaks["b"]),
    }  # fmt: skip


PEAKS_DIFFER = 0.01
"""Two runs' host peaks more than 1% apart divide their MFU by different figures."""


def _host_peak(con: duckdb.DuckDBPyConnection, run_id: str) -> dict | None:
    """The peak FLOP/s a run's MFU divides by, per host (its ranks' shares summed; the median
    over hosts: a run with more ranks on a host gives each a smaller share of the same peak),
    and where it comes from (telemetry/peaks.py); None where the run recorded none."""
    row = con.execute(
        "SELECT median(flops), any_value(source) FROM (SELECT host, sum(peak) AS flops, "
        "any_value(source) AS source FROM (SELECT rank, host, max(peak_flops) AS peak, "
        "any_value(peak_flops_source) AS source FROM ranks WHERE run_id = ? AND peak_flops > 0 "
        "GROUP BY rank, host) GROUP BY host)", [run_id],
    ).fetchone()  # fmt: skip
    return None if row is None or row[0] is None else {"flops": float(row[0]), "source": row[1]}


def _peak_note(a: dict | None, b: dict | None) -> str | None:
    """Where two runs' MFU divide by different peaks, in words (the MFU ratio holds theirs)."""
    if a is None or b is None or abs(b["flops"] / a["flops"] - 1.0) <= PEAKS_DIFFER:
        return None
    return (f"MFU divides by different peaks: A {a['flops']:.3g} FLOP/s a host ({a['source']}), "
            f"B {b['flops']:.3g} ({b['source']}): B/A of MFU holds their ratio, "
            f"{a['flops'] / b['flops']:.3f}, beside the work's")  # fmt: skip
