"""Probe results for people: a probe run's report (verdict and pairs table), and the lines a
training run's report gives the probes linked to it."""

from __future__ import annotations

import statistics

from ranktrace.app.output import render


def _table(columns: list[str], rows: list[tuple]) -> str:
    return "\n".join(render(columns, rows, "table").splitlines()[:-1])  # no "(n rows)"


def format_probe_report(report: dict) -> str:
    """The human summary of a probe run's report (analysis.probe.probe_report)."""
    probe = report["probe"]
    nodes = "; ".join(f"{n['host']}: ranks {', '.join(map(str, n['ranks']))}"
                      for n in probe["nodes"])  # fmt: skip
    linked = f", for run {report['for']}" if report.get("for") else ""
    max_bytes = probe.get("max_bytes") or 0
    lines = [
        f"probe {report['run_id']} ({report['name']}): {report['status']}{linked}; "
        f"{probe['world_size']} ranks on {len(probe['nodes'])} node(s) ({nodes})",
        f"{len(probe['pairs'])} pairs, each alone: {probe['repeats']} timed samples of "
        f"~{probe['pair_seconds'] / probe['repeats']:.2g} s (messages of up to "
        f"{max_bytes / 2**20:.2f} MiB), {probe['backend']}, "
        f"{probe['duration_s'] or 0:.1f} s in all",
        f"verdict: {probe['verdict']}",
    ]
    lines += [f"note: {note}" for note in probe["notes"]]
    lines.append("\npairs (bytes/s measured on the receiver, median of the samples):")
    lines.append(_table(*pairs_table(probe["pairs"])))
    return "\n".join(lines)


def pairs_table(pairs: list[dict]) -> tuple[list[str], list[tuple]]:
    """(columns, rows) of a probe's pairs, each beside the median of its locality's pairs."""
    medians = {}
    for intra in (True, False):
        rates = [p["bytes_per_s"] for p in pairs if p["intra_node"] is intra]
        medians[intra] = statistics.median(rates) if rates else None
    rows = [
        (p["src"], p["dst"], p["src_host"], p["dst_host"],
         "intra-node" if p["intra_node"] else "inter-node", f"{p['bytes'] / 1024:.0f}",
         p["messages"],
         f"{p['bytes_per_s'] / 1e6:.3g}", f"{p['bytes_per_s'] / medians[p['intra_node']]:.2g}x")
        for p in pairs
    ]  # fmt: skip
    columns = ["src", "dst", "src host", "dst host", "locality", "KiB", "msgs", "MB/s",
               "vs median"]  # fmt: skip
    return columns, rows


def probe_lines(report: dict) -> list[str]:
    """A training run's linked probes (`ranktrace probe --for RUN`), one line each."""
    return [f"probe {p['run_id']} ({p['name']}): {p['verdict']}"
            + "".join(f"\n  note: {note}" for note in p["notes"])
            for p in report.get("probes") or []]  # fmt: skip
