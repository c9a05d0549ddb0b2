"""Compare: two runs side by side, the settings that differ stated, a warning when more than one
does (change one axis at a time); and a sweep view: a metric against one axis over the runs that
differ from run A only in that axis."""

from __future__ import annotations

import dash
import pandas as pd
import plotly.graph_objects as go
from dash import Input, Output, callback, dcc, html

from ranktrace.analysis.run import LAYOUT_AXES, compare, resolve_run, run_metrics, run_settings
from ranktrace.analysis.store import StoreError
from ranktrace.analysis.views import runs_overview
from ranktrace.app import dash_data, dash_ui
from ranktrace.app.output import number

dash.register_page(__name__, path="/compare", name="Compare", title="ranktrace: compare")

SWEEP_METRICS = (
    "step_time_s",
    "compute_s",
    "tp_comm_s",
    "pp_comm_s",
    "dp_comm_s",
    "mfu",
    "tokens_per_s",
)


def comparison(run_a: str, run_b: str) -> html.Div:
    """The side-by-side of two runs (analysis.run.compare)."""
    with dash_data.store() as con:
        result = compare(con, run_a, run_b)
    if result["warning"]:
        verdict = html.Div(
            f"Warning: {result['warning']}", id="compare-warning", className="warning"
        )
    elif result["differing_settings"]:
        (axis,) = result["differing_settings"]
        verdict = html.P(
            f"One axis differs: {axis} {result['settings_a'][axis]} → "
            f"{result['settings_b'][axis]}.",
            id="compare-verdict",
        )
    else:
        verdict = html.P("Same settings: a repeat; differences are noise.", id="compare-verdict")
    rows = [
        {
            "metric": m["metric"],
            "A": number(m["a"]),
            "B": number(m["b"]),
            "B/A": "" if m["ratio"] is None else f"{m['ratio']:.3f}",
        }
        for m in result["metrics"]
    ]
    return html.Div([verdict, dash_ui.table(pd.DataFrame(rows), "compare-table")])


def sweep_figure(run_a: str, axis: str, metric: str) -> go.Figure:
    """`metric` against `axis` over the runs equal to run A in every other setting."""
    with dash_data.store() as con:
        base = run_settings(resolve_run(con, run_a))
        points = []
        for run_id in runs_overview(con)["run_id"]:
            row = resolve_run(con, run_id)
            settings = run_settings(row)
            if all(settings[k] == base[k] for k in settings if k not in (axis, "world_size")):
                points.append((settings[axis], run_metrics(con, row).get(metric)))
    points.sort(key=lambda point: point[0])
    figure = go.Figure(
        go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers")
    )
    figure.update_layout(
        title=f"{metric} vs {axis} (runs differing from A only in {axis})",
        xaxis_title=axis,
        yaxis_title=metric,
        height=320,
        **dash_ui.FIGURE_LAYOUT,
    )
    return figure


def layout(a: str = "", b: str = "", **_query) -> html.Div:
    if not dash_data.has_store():
        return dash_ui.no_runs_state(str(dash_data.runs_dir()))
    with dash_data.store() as con:
        overview = runs_overview(con)
    options = [
        {"label": f"{r['name']} ({r['run_id']})", "value": r["run_id"]}
        for r in overview.to_dict("records")
    ]
    return html.Div(
        [
            html.H2("Compare two runs"),
            html.Div(
                [
                    dcc.Dropdown(
                        id="compare-a", options=options, value=a or None, placeholder="run A"
                    ),
                    dcc.Dropdown(
                        id="compare-b", options=options, value=b or None, placeholder="run B"
                    ),
                ],
                className="pair",
            ),
            html.Div(id="compare-result"),
            html.H3("Sweep: one axis at a time"),
            html.Div(
                [
                    dcc.Dropdown(id="compare-axis", options=list(LAYOUT_AXES), value="tp"),
                    dcc.Dropdown(
                        id="compare-metric", options=list(SWEEP_METRICS), value="step_time_s"
                    ),
                ],
                className="pair",
            ),
            dcc.Graph(id="compare-sweep"),
        ]
    )


@callback(
    Output("compare-result", "children"),
    Input("compare-a", "value"),
    Input("compare-b", "value"),
)
def on_pick(run_a: str | None, run_b: str | None):
    if not run_a or not run_b:
        return html.P("Pick two runs.", className="hint")
    try:
        return comparison(run_a, run_b)
    except StoreError as error:
        return html.P(str(error), className="warning")


@callback(
    Output("compare-sweep", "figure"),
    Input("compare-a", "value"),
    Input("compare-axis", "value"),
    Input("compare-metric", "value"),
)
def on_sweep(run_a: str | None, axis: str, metric: str) -> go.Figure:
    if not run_a:
        return go.Figure(layout={"title": "Pick run A to see its sweep", **dash_ui.FIGURE_LAYOUT})
    return sweep_figure(run_a, axis, metric)
