"""`ranktrace report RUN --html FILE`: one self-contained HTML file of a run's diagnosis, to
attach to a bug report or a chat. Plotly's JavaScript is inlined once; nothing is fetched, no
server is needed. It holds the findings, the rank × step heatmap, the step-time breakdown, the
loss/MFU series, memory per rank, and the full text report.
"""

from __future__ import annotations

import html

import duckdb
import plotly.io as pio

from ranktrace.app.figures import evidence_figures, memory_figure, rank_step_heatmap
from ranktrace.app.report_text import (
    format_report,
    imbalance_table,
    resilience_blocks,
    straggler_table,
    topology_blocks,
)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: left; }
th { background: #f3f3f3; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; }
.summary { color: #555; }
"""


def _table(columns: list[str], rows: list[tuple], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows
    )
    return f'<table id="{table_id}"><tr>{head}</tr>{body}</table>'


def _findings(report: dict) -> str:
    if not report["stragglers"]:
        return '<p id="no-stragglers">No stragglers.</p>'
    return _table(*straggler_table(report["stragglers"]), "stragglers")


def _imbalances(report: dict) -> str:
    if not report["imbalances"]:
        return "<p>No imbalances.</p>"
    return _table(*imbalance_table(report["imbalances"]), "imbalances")


def html_report(con: duckdb.DuckDBPyConnection, report: dict) -> str:
    """The whole page for `report` (analysis.run.report) of a run in the store behind `con`."""
    run_id = report["run_id"]
    series, breakdown = evidence_figures(con, run_id, report)
    figures = [rank_step_heatmap(con, run_id, "own_s"), breakdown, series]
    if report["memory"]:
        figures.append(memory_figure(report["memory"]))
    plots = "\n".join(
        pio.to_html(figure, include_plotlyjs=index == 0, full_html=False,
                    config={"displaylogo": False})
        for index, figure in enumerate(figures)
    )  # fmt: skip
    layout = " ".join(f"{k}={v}" for k, v in report["layout"].items())
    mfu = f"{100 * report['mfu']:.2f}%" if report["mfu"] is not None else "n/a"
    step = f"{report['step_time_s']:.4f} s" if report["step_time_s"] is not None else "n/a"
    summary = (f"{report['status']} · {report['steps']} steps · {layout} · model "
               f"{report['settings']['model']} · median step {step} · MFU {mfu}")  # fmt: skip
    resilience = "\n\n".join(resilience_blocks(report))
    topology = "\n\n".join(topology_blocks(report.get("topology")))
    title = f"ranktrace report: {report['name']}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p class="summary">run {html.escape(run_id)} · {html.escape(summary)}</p>
<h2>Stragglers</h2>
{_findings(report)}
<h2>Imbalances</h2>
{_imbalances(report)}
{f"<h2>Fault tolerance</h2><pre>{html.escape(resilience)}</pre>" if resilience else ""}
{f"<h2>Topology</h2><pre>{html.escape(topology)}</pre>" if topology else ""}
<h2>Ranks, steps, memory</h2>
{plots}
<h2>Full report</h2>
<pre id="text-report">{html.escape(format_report(report))}</pre>
</body></html>
"""
