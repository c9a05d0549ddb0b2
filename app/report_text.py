"""`ranktrace report` and `ranktrace compare` for people: short sections of aligned tables."""

from __future__ import annotations

from ranktrace.app import units
from ranktrace.app.output import render
from ranktrace.app.probe_text import format_probe_report, probe_lines
from ranktrace.telemetry.names import RUN_KIND_PROBE


def _table(columns: list[str], rows: list[tuple]) -> str:
    return "\n".join(render(columns, rows, "table").splitlines()[:-1])  # no "(n rows)"


def finding_who(finding: dict) -> str:
    """`rank 6 (pp=1 dp=1 tp=0)`, or the candidates of a link no timing can pin down."""
    if finding.get("hosts"):  # a slow node: its ranks
        ranks = finding["candidates"]
        label = "ranks" if len(ranks) > 1 else "rank"
        return f"node {', '.join(finding['hosts'])} ({label} {', '.join(map(str, ranks))})"
    if finding["rank"] is not None:
        return f"rank {finding['rank']} (pp={finding['pp']} dp={finding['dp']} tp={finding['tp']})"
    ranks = "one of ranks " + ", ".join(map(str, finding["candidates"]))
    if finding.get("candidate_hosts"):
        return f"{ranks} (nodes {', '.join(finding['candidate_hosts'])})"
    return ranks


def finding_kind(finding: dict) -> str:
    """`compute`, `host (contention)`, `communication (tp)`: the kind and its cause or axis."""
    detail = finding.get("cause") or finding.get("axis")
    return finding["kind"] + (f" ({detail})" if detail else "")


def straggler_table(findings: list[dict]) -> tuple[list[str], list[tuple]]:
    """(columns, rows) of straggler findings, as people read them."""
    rows = [
        (finding_who(f), finding_kind(f), f["pattern"],
         f"{f['first_step']}-{f['last_step']}", f"{f['slowdown']:.2f}x",
         f"{f['step_time_s']:.4f} -> {f['whatif_step_time_s']:.4f}", f"{f['cost_pct']:.1f}%")
        for f in findings
    ]  # fmt: skip
    return ["who", "kind", "pattern", "steps", "slowdown", "step s (what-if)", "cost"], rows


def imbalance_table(imbalances: list[dict]) -> tuple[list[str], list[tuple]]:
    """(columns, rows) of imbalances, as people read them."""
    rows = [
        (i["kind"], "" if i["stage"] is None else i["stage"], f"+{100 * i['excess']:.0f}%",
         f"{i['whatif_step_time_s']:.4f}", f"{i['cost_pct']:.1f}%")
        for i in imbalances
    ]  # fmt: skip
    return ["kind", "stage", "excess", "what-if step s", "cost"], rows


def format_report(report: dict) -> str:
    """The human summary of `analysis.run.report`."""
    if report.get("kind") == RUN_KIND_PROBE:
        return format_probe_report(report)
    layout = report["layout"]
    imported = report.get("imported")
    if imported:
        origin = f", imported from a {imported['format']} trace ({imported['ops']} ops)"
    elif report.get("command"):
        origin = f", recorded by ranktrace run: {' '.join(report['command'])}"
    elif report.get("launcher"):
        origin = f", recorded by {report['launcher']}()"
    else:
        origin = f", model {report['settings']['model']}"
    throughput = ""
    if not imported:
        throughput = f", MFU {100 * (report['mfu'] or 0):.2f}%"
        if report["tokens_per_s"] is not None:
            throughput += f", {report['tokens_per_s']:.0f} tokens/s"
    lines = [
        f"run {report['run_id']} ({report['name']}): {report['status']}, "
        + " ".join(f"{k}={v}" for k, v in layout.items() if v is not None)
        + origin,
    ]
    if report["steps"]:  # a run with no step after the warm-up step has no step time to show
        lines.append(f"median step {report['step_time_s']:.4f} s over {report['steps']} steps"
                     + throughput)  # fmt: skip
    lines.append("")
    lines.extend(finding_lines(report))
    remedies = remedy_lines(report)
    lines.extend(["\nremedies, best first:", *remedies] if remedies else [])
    lines.extend(slowdown_lines(report))
    lines.extend(gpu_time_lines(report))
    if report["efficiency_drops"]:
        lines.append("\nefficiency drops:")
        rows = [
            (d["step"], f"{100 * d['mfu_before']:.2f}% -> {100 * d['mfu_after']:.2f}%",
             f"-{d['drop_pct']:.0f}%", d.get("explained_by") or "-",
             f"{d['cause']} {100 * d['share_before']:.0f}% -> {100 * d['share_after']:.0f}%")
            for d in report["efficiency_drops"]
        ]  # fmt: skip
        lines.append(_table(["step", "MFU", "drop", "explained by", "symptom (its share)"], rows))
    if report["memory"]:
        lines.append("\nmemory per rank (MiB; predicted state = params + grads + optimizer):")
        rows = [
            (m["rank"], m["stage"], f"{m['predicted_state_bytes'] / units.MIB:.2f}",
             f"{(m['measured_state_bytes'] or 0) / units.MIB:.2f}",
             f"{m['activation_bytes'] / units.MIB:.2f}",
             f"{(m['measured_rss_peak_bytes'] or 0) / units.MIB:.0f}")
            for m in report["memory"]
        ]  # fmt: skip
        columns = ["rank", "stage", "state pred", "state meas", "activ. pred", "peak RSS"]
        lines.append(_table(columns, rows))
    for note in report["notes"]:
        lines.append(f"note: {note}")
    lines.extend("\n" + block for block in topology_blocks(report.get("topology")))
    lines.extend("\n" + line for line in probe_lines(report))  # `ranktrace probe --for`
    lines.extend("\n" + block for block in resilience_blocks(report))
    faults = [e for e in report["events"] if e["kind"] in ("fault_injected", "crash", "hang")]
    if faults:
        lines.append("\nevents: " + "; ".join(f"rank {e['rank']} {e['detail']}" for e in faults))
    return "\n".join(lines)


def finding_lines(report: dict) -> list[str]:
    """The stragglers and imbalances; where the report has no verdict (no step recorded, too
    few), the line saying so instead: an empty capture never reads as "none found"."""
    if report.get("verdict") in ("no_data", "too_few_steps"):
        return [report["verdict_detail"]]
    lines = list((report.get("capture") or {}).get("lines", []))  # what the findings are about
    findings = report["stragglers"]
    if findings:
        lines.append(f"stragglers ({len(findings)}):")
        lines.append(_table(*straggler_table(findings)))
        dedicated = [f"{finding_who(f)} {f['dedicated_core_cost_pct']:.1f}%" for f in findings
                     if f.get("dedicated_core_cost_pct") is not None]  # fmt: skip
        if dedicated:
            lines.append("(costs with the cores shared as in the run's steps without the finding; "
                         "with a core per rank: " + ", ".join(dedicated) + ")")  # fmt: skip
        for finding in findings:
            lines += [f"  {finding_who(finding)}: {line}" for line in finding.get("evidence", [])]
            hidden = finding.get("cost_once_others_fixed_pct")
            if hidden is not None and hidden >= finding["cost_pct"] + HIDDEN_MARGIN_PCT:
                lines.append(f"  {finding_who(finding)}: hidden behind the other findings: "
                             f"fixing it alone saves {finding['cost_pct']:.1f}%, once they are "
                             f"fixed {hidden:.1f}%")  # fmt: skip
    else:
        lines.append("stragglers: none")
    if report["imbalances"]:
        lines.append("\nimbalances:")
        lines.append(_table(*imbalance_table(report["imbalances"])))
        for imbalance in report["imbalances"]:
            lines += [f"  {imbalance['kind']}: {line}" for line in imbalance.get("evidence", [])]
    else:
        lines.append("imbalances: none")
    if report.get("verdict_detail"):  # a verdict with a caveat (the replay's costs withheld)
        lines.append(f"note: {report['verdict_detail']}")
    return lines


def ranked_remedies(report: dict) -> list[dict]:
    """Every finding's and imbalance's remedy (analysis/remedies.py) with what it is `for`,
    the best predicted gain first."""
    out = []
    for finding in report["stragglers"]:
        if finding.get("remedy"):
            out.append({"for": f"{finding_who(finding)} {finding['kind']}", **finding["remedy"]})
    for imbalance in report["imbalances"]:
        if imbalance.get("remedy"):
            where = f"stage {imbalance['stage']} " if imbalance["stage"] is not None else ""
            out.append({"for": f"{where}{imbalance['kind']} imbalance", **imbalance["remedy"]})
    if report.get("layout_remedy"):
        out.append({"for": "the layout", **report["layout_remedy"]})
    return sorted(out, key=lambda r: -(r["predicted_gain_pct"] or 0.0))


def remedy_lines(report: dict) -> list[str]:
    """What to change, best first, each with the step time and gain the replay predicts; and,
    once `ranktrace remedy --apply` ran, the measured gain beside the predicted one."""
    lines = []
    for remedy in ranked_remedies(report):
        lines.append(f"- {remedy['for']}: {remedy['action']}")
        step, gain = remedy["predicted_step_s"], remedy["predicted_gain_pct"]
        mfu = (f", MFU {100 * remedy['predicted_mfu']:.2f}%"
               if remedy.get("predicted_mfu") is not None else "")  # fmt: skip
        lines.append(f"  predicted: step {step:.4f} s, {gain:.1f}% faster{mfu}" if step is not None
                     else "  predicted: not priced")  # fmt: skip
    applied = report.get("remedy_applied")
    if applied:
        lines.append(f"remedy applied ({applied['action']}): predicted "
                     f"{applied['predicted_gain_pct']:.1f}%, measured "
                     f"{applied['measured_gain_pct']:.1f}% faster per token (A B A B: runs "
                     f"{', '.join(applied['runs'])})")  # fmt: skip
    return lines


def slowdown_lines(report: dict) -> list[str]:
    """S, the launch slowdown, the S_X factors that matter most, and what each finding's
    what-if saves."""
    detail = report.get("slowdown_detail")
    if not detail:
        return []
    steps = detail["steps"]
    error = detail["replay_error_pct"]
    worst = detail.get("replay_error_abs_pct_max")
    lines = [
        f"\nslowdown S = {report['slowdown']:.3f}x: the replayed steps take "
        f"{detail['replayed_s'] / steps:.4f} s, {detail['ideal_s'] / steps:.4f} s with every "
        f"operation at its mean ({steps} steps; the replay of the recorded steps is "
        f"{'' if error is None else f'{error:+.1f}% '}off the measured time"
        f"{'' if worst is None else f', {worst:.1f}% at worst'}); launch slowdown "
        f"{detail.get('launch_slowdown', 1.0):.3f}x"
    ]
    for axis, (label, factors) in top_factors(report.get("slowdown_by") or {}).items():
        parts = [f"{label} {key} {value:.3f}x".strip() for key, value in factors]
        lines.append(f"S by {axis}: {', '.join(parts)}")
    causes = [f"{c['cause']} saves {c['saved_pct']:.1f}% (S {c['slowdown_without']:.3f}x "
              f"without it{_share(c)})" for c in report["slowdown_by_cause"]]  # fmt: skip
    if causes:
        lines.append(f"by cause: {'; '.join(causes)}")
    remainder = report.get("slowdown_remainder")
    if remainder and report["slowdown_by_cause"]:
        below = (": fixed, they go below the ideal, whose means hold their excess"
                 if remainder["share_pct"] < 0 else "")  # fmt: skip
        left = remainder["slowdown_left"]
        lines.append(f"what the causes leave: {remainder['share_pct']:.0f}% of S - 1 (S "
                     f"{left:.3f}x with every cause fixed{below})")  # fmt: skip
    return lines


def _share(cause: dict) -> str:
    """`; 48% of S - 1`, a cause's part of the decomposition (a link has none)."""
    share = cause.get("share_pct")
    return "" if share is None else f"; {share:.0f}% of S - 1"


GPU_TIME_ROWS = 16
"""Ranks in the GPU time table; of a larger job, those with the most idle time."""


def gpu_time_lines(report: dict) -> list[str]:
    """The GPU time split per rank of an imported GPU trace (`gpu_time`); nothing without."""
    split = report.get("gpu_time")
    if not split:
        return []
    ranks = sorted(split, key=int)
    if len(ranks) > GPU_TIME_ROWS:
        ranks = sorted(ranks, key=lambda r: -split[r]["idle_pct"])[:GPU_TIME_ROWS]
    rows = [
        (rank, f"{s['span_s']:.3f}", *(f"{s[key]:.1f}%" for key in (
            "compute_pct", "communication_pct", "memory_pct", "idle_pct", "idle_host_wait_pct",
            "idle_kernel_wait_pct", "idle_other_pct")))
        for rank, s in ((r, split[r]) for r in ranks)
    ]  # fmt: skip
    columns = ["rank", "span s", "compute", "communication", "memory", "idle", "host wait",
               "kernel wait", "other"]  # fmt: skip
    lines = ["\nGPU time per rank: compute / communication / memory / idle (host wait, kernel "
             "wait, other), % of its span from first to last kernel:",
             _table(columns, rows)]  # fmt: skip
    if len(ranks) < len(split):
        lines.append(f"({len(split) - len(ranks)} ranks with less idle time left out; "
                     "report --json has every rank)")  # fmt: skip
    return lines


TOP_FACTORS = 4
"""S_X factors printed per axis, the largest first."""


def top_factors(slowdown_by: dict) -> dict[str, tuple[str, list[tuple[str, float]]]]:
    """Per axis of `slowdown_by` (rank, stage, phase), its TOP_FACTORS largest factors."""
    names = {"stage": "stage", "rank": "rank", "phase": ""}
    top = {}
    for axis in ("stage", "rank", "phase"):
        factors = sorted(slowdown_by.get(axis, {}).items(), key=lambda item: -item[1])
        if factors:
            top[axis] = (names[axis], factors[:TOP_FACTORS])
    return top


def topology_blocks(topology: dict | None) -> list[str]:
    """Nodes, groups crossing nodes, layout flags, the inter-node bandwidth finding and the
    bandwidth table of a multi-node run; one line when the hosts are unknown; nothing for a run
    on one host."""
    if topology and topology.get("hosts_known") is False:
        return ["topology: hosts unknown (the trace names no host): no per-node findings or "
                "layout advice"]  # fmt: skip
    if not topology or len(topology["nodes"]) < 2:
        return []
    nodes = "; ".join(
        f"{n['host']}: ranks {', '.join(map(str, n['ranks']))}" for n in topology["nodes"]
    )
    crossing = ", ".join(
        f"{axis} {g['crossing_nodes']}/{g['groups']}" for axis, g in topology["groups"].items()
    )
    head = [f"topology: {len(topology['nodes'])} nodes ({nodes})",
            f"groups crossing nodes: {crossing}"]  # fmt: skip
    head += topology["flags"]
    if topology["inter_node_bandwidth"]:
        head.append(topology["inter_node_bandwidth"]["text"])
    if topology.get("inter_node_unjudged"):
        head.append(topology["inter_node_unjudged"])
    blocks = ["\n".join(head)]
    if topology["bandwidth"]:
        rows = [
            (b["locality"], b["axis"], b["op"], b["calls"], f"{b['median_bytes'] / 1024:.0f}",
             f"{b['transfer_s']:.3f}", f"{(b['bus_bytes_per_s'] or 0) / 1e6:.1f}")
            for b in topology["bandwidth"]
        ]  # fmt: skip
        columns = ["locality", "axis", "op", "calls", "median KiB", "transfer s", "bus MB/s"]
        blocks.append("collective bandwidth by locality:\n" + _table(columns, rows))
    return blocks


def hang_lines(report: dict) -> list[str]:
    """One line per hung rank: where it was and who waited for it."""
    lines = []
    for hang in report.get("hangs", []):
        waits = "; ".join(f"rank {b['rank']} waited {b['waited_s']:.1f} s in {b['op']} on "
                          f"{b['axis']} {b['group']}" for b in hang["blocked"])  # fmt: skip
        lines.append(f"HUNG: rank {hang['rank']} at step {hang['step']}, {hang['state']} "
                     f"({waits})")  # fmt: skip
    return lines


def resilience_blocks(report: dict) -> list[str]:
    """Hangs, restarts and checkpoints, one text block each (reports stored by older versions
    have none of them)."""
    blocks = hang_lines(report)
    restarts = report.get("restarts", [])
    if restarts:
        lines = [f"restarts ({len(restarts)}):"]
        rows = [
            (r["attempt"], r["how"], r["cause"] or "", r["resumed_from_step"], r["steps_redone"],
             f"{r['redone_s']:.2f}", "" if r["downtime_s"] is None else f"{r['downtime_s']:.1f}")
            for r in restarts
        ]  # fmt: skip
        columns = ["attempt", "how", "after", "from step", "redone", "redone s", "down s"]
        lines.append(_table(columns, rows))
        blocks.append("\n".join(lines))
    if report.get("checkpoints"):
        blocks.append("\n".join(_checkpoint_lines(report["checkpoints"])))
    return blocks


def _checkpoint_lines(ckpt: dict) -> list[str]:
    cadence = " and ".join(
        part
        for part in (
            f"every {ckpt['every_steps']} steps" if ckpt["every_steps"] else "",
            f"every {ckpt['every_minutes']:g} min" if ckpt["every_minutes"] else "",
        )
        if part
    )
    mode = "sync" if ckpt["sync"] else "async"
    lines = [
        f"checkpoints ({mode}, {cadence or 'no cadence'}): {ckpt['complete']} complete, "
        f"{ckpt['failed']} failed, latest before step {ckpt['last_complete_step']}"
    ]
    if ckpt["blocking_s"] is not None:
        lines.append(
            f"  per save: {ckpt['blocking_s'] * 1e3:.1f} ms blocking + "
            f"{(ckpt['async_s'] or 0) * 1e3:.1f} ms in the background, "
            f"{(ckpt['bytes'] or 0) / units.MIB:.1f} MiB"
        )
    if ckpt["interval_s"]:
        lines.append(
            f"  cadence: one every {ckpt['interval_s']:.1f} s of training, "
            f"{ckpt['overhead_pct'] or 0:.2f}% of it blocked saving; expected work lost "
            f"per failure {ckpt['expected_lost_work_s']:.1f} s (half an interval + a save)"
        )
    return lines


def format_comparison(result: dict) -> str:
    """The human summary of `analysis.run.compare`."""
    lines = [f"A = {result['run_a']} ({result['name_a']}), B = {result['run_b']} "
             f"({result['name_b']})"]  # fmt: skip
    if result["warning"]:
        lines.append(f"WARNING: {result['warning']}")
    elif result["differing_settings"]:
        (axis,) = result["differing_settings"]
        lines.append(
            f"one axis differs: {axis} {result['settings_a'][axis]} -> {result['settings_b'][axis]}"
        )
    else:
        lines.append("the runs have the same settings (a repeat: differences are noise)")
    lines.append(_table(COMPARISON_COLUMNS,
                        [tuple(row.values()) for row in comparison_rows(result)]))  # fmt: skip
    if result.get("peak_note"):
        lines.append(f"note: {result['peak_note']}")
    return "\n".join(lines)


NOISE_WORDS = {True: "beyond noise", False: "within noise", None: ""}
"""A compared metric's difference against its runs' step-to-step noise (analysis.run)."""
COMPARISON_COLUMNS = ["metric", "A", "B", "B/A", "B - A"]


def comparison_rows(result: dict) -> list[dict]:
    """The metrics of `analysis.run.compare` for people, one dict (COMPARISON_COLUMNS) each:
    named in words, each value in its unit, B/A, and B - A against the noise; the CLI's and the
    dashboard's compare tables."""
    return [dict(zip(COMPARISON_COLUMNS, (
        units.name(m["metric"]), units.formatted(m["metric"], m["a"]),
        units.formatted(m["metric"], m["b"]), "" if m["ratio"] is None else f"{m['ratio']:.3f}",
        NOISE_WORDS[m.get("beyond_noise")]), strict=True)) for m in result["metrics"]]  # fmt: skip


HIDDEN_MARGIN_PCT = 1.0
"""A finding's saving once the others are fixed is said when it exceeds its own by this."""
