"""Run overview: loss, MFU and tokens/s over steps with efficiency drops marked, the stacked
step-time breakdown, straggler findings with links to their evidence, imbalances, the remedies
with their predicted gains (and, once applied, the measured one), and memory per rank (measured
vs predicted). Refreshes every --refresh-s (2 s) while the run trains: from its segments until
its first window of steps is complete, then from the windows the dashboard's ingester stores as
they complete."""

from __future__ import annotations

import dash
import pandas as pd
from dash import Input, Output, State, callback, dcc, html

from ranktrace.analysis.store import StoreError
from ranktrace.app import dash_data, dash_ui, units
from ranktrace.app.figures import evidence_figures, memory_figure
from ranktrace.app.report_text import (
    imbalance_table,
    ranked_remedies,
    remedy_lines,
    resilience_blocks,
    slowdown_lines,
    straggler_table,
    top_factors,
    topology_blocks,
)

dash.register_page(__name__, path_template="/run/<run_id>", name="Run", title="ranktrace: run")


def findings_table(run_id: str, findings: list[dict]) -> html.Div:
    """The straggler table of the text report, with links to each finding's evidence."""
    if not findings:
        return html.P("No stragglers.", id="run-no-stragglers")
    columns, rows = straggler_table(findings)
    frame = pd.DataFrame(rows, columns=columns)
    frame["evidence"] = [
        f"[heatmap](/ranks/{run_id}) · [timeline](/timeline/{run_id}?step={f['first_step']})"
        for f in findings
    ]
    return dash_ui.table(frame, "run-stragglers", markdown=["evidence"])


def imbalances_table(imbalances: list[dict]) -> html.Div:
    """The imbalance table of the text report."""
    if not imbalances:
        return html.P("No imbalances.")
    columns, rows = imbalance_table(imbalances)
    return dash_ui.table(pd.DataFrame(rows, columns=columns), "run-imbalances")


def run_content(run_id: str) -> html.Div:
    """Everything the page shows about one run, from the store or its live segments."""
    try:
        report = dash_data.run_report(run_id)
        with dash_data.run_connection(run_id) as con:
            series, breakdown = evidence_figures(con, run_id, report)
    except StoreError as error:
        return dash_ui.empty_state(f"No data for run {run_id} yet", str(error))
    layout = " ".join(f"{k}={v}" for k, v in report["layout"].items())
    summary = (
        f"{report['status']} · {report['steps']} steps · {layout} · model "
        f"{report['settings']['model']} · median step {dash_ui.seconds(report['step_time_s'])} "
        f"s · MFU {units.formatted('mfu', report['mfu'])}"
    )
    live = dash_data.live_windows(run_id)
    if live is not None:
        summary += (f" · live: steps 0-{live[1] - 1}, the {live[0]} window(s) every rank has "
                    "finished, analysed as each completes")  # fmt: skip
    return html.Div(
        [
            html.H2(f"Run {report['name']}"),
            html.P(
                [
                    summary,
                    " · ",
                    dcc.Link("ranks heatmap", href=f"/ranks/{run_id}"),
                    " · ",
                    dcc.Link("timeline", href=f"/timeline/{run_id}"),
                ],
                className="summary",
            ),
            html.H3("Stragglers"),
            findings_table(run_id, report["stragglers"]),
            html.H3("Imbalances"),
            imbalances_table(report["imbalances"]),
            *remedies_section(report),
            *slowdown_section(report),
            dcc.Graph(id="run-series", figure=series),
            dcc.Graph(id="run-breakdown", figure=breakdown),
            dcc.Graph(id="run-memory", figure=memory_figure(report["memory"]))
            if report["memory"]
            else html.P("No memory model for this run."),
            *text_section("Fault tolerance", resilience_blocks(report), "run-resilience"),
            *text_section("Topology", topology_blocks(report.get("topology")), "run-topology"),
            *(html.P(f"note: {note}") for note in report["notes"]),
        ]
    )


def layout(run_id: str = "", **_query) -> html.Div:
    return html.Div(
        [
            dcc.Store(id="run-id", data=run_id),
            dash_ui.refresh_timer(
                "run-refresh", dash_data.refreshes(run_id), dash_data.refresh_s()
            ),
            html.Div(run_content(run_id), id="run-content"),
        ]
    )


@callback(
    Output("run-content", "children"),
    Output("run-refresh", "max_intervals"),
    Input("run-refresh", "n_intervals"),
    State("run-id", "data"),
    prevent_initial_call=True,
)
def refresh(n_intervals: int, run_id: str):
    """While the run trains: re-read its segments; stop once the store holds it."""
    # Asked before reading: a run stored while its segments are read gets one more refresh
    # (asked after, the page kept the stale segments' view and stopped refreshing).
    again = dash_data.refreshes(run_id)
    content = run_content(run_id)
    return content, dash_ui.next_tick(n_intervals, again)


def slowdown_section(report: dict) -> list:
    """S in one line, then what each cause saves and the factors that matter most, as tables
    (the text report's lines, app/report_text.py, in rows)."""
    detail = report.get("slowdown_detail")
    if not detail:
        return []
    summary = slowdown_lines(report)[0].strip()
    causes = [{"cause": c["cause"], "saves": f"{c['saved_pct']:.1f}%",
               "S without it": f"{c['slowdown_without']:.3f}x",
               "share of S - 1": "" if c.get("share_pct") is None else f"{c['share_pct']:.0f}%"}
              for c in report["slowdown_by_cause"]]  # fmt: skip
    remainder = report.get("slowdown_remainder")
    if remainder and causes:
        causes.append({"cause": "what the causes leave", "saves": "",
                       "S without it": f"{remainder['slowdown_left']:.3f}x",
                       "share of S - 1": f"{remainder['share_pct']:.0f}%"})  # fmt: skip
    factors = [{"S by": axis, "largest factors": ", ".join(
        f"{label} {key} {value:.3f}x".strip() for key, value in top)}
        for axis, (label, top) in top_factors(report.get("slowdown_by") or {}).items()]  # fmt: skip
    return [
        html.H3("Slowdown and its causes"),
        html.Div(
            [
                html.P(summary, className="summary"),
                *([dash_ui.table(pd.DataFrame(causes), "run-causes")] if causes else []),
                *([dash_ui.table(pd.DataFrame(factors), "run-factors")] if factors else []),
            ],
            id="run-slowdown",
        ),
    ]


def remedies_section(report: dict) -> list:
    """What to change, best first, with the step and gain the replay predicts, as a table."""
    rows = [{"for": r["for"], "change": r["action"],
             "predicted step": "" if r["predicted_step_s"] is None
             else f"{r['predicted_step_s']:.4f} s",
             "predicted gain": "not priced" if r["predicted_step_s"] is None
             else f"{r['predicted_gain_pct']:.1f}%",
             "predicted MFU": units.formatted("mfu", r.get("predicted_mfu"))}
            for r in ranked_remedies(report)]  # fmt: skip
    if not rows:
        return []
    applied = report.get("remedy_applied")
    return [html.H3("Remedies"), dash_ui.table(pd.DataFrame(rows), "run-remedies"),
            *([html.P(remedy_lines(report)[-1])] if applied else [])]  # fmt: skip


def text_section(title: str | None, blocks: list[str], element_id: str, joiner: str = "\n\n"):
    """Blocks of the text report (app/report_text.py) as a heading and one <pre>; nothing when
    there are none."""
    if not blocks:
        return []
    return [*([html.H3(title)] if title else []), html.Pre(joiner.join(blocks), id=element_id)]
