"""Compare: two runs side by side, the settings that differ stated, a warning when more than one
does (change one axis at a time), each metric in words with its unit and whether B - A is beyond
the runs' step-to-step noise; and a sweep view: a metric against one axis over the runs equal to
run A in everything else (analysis.run.sweep_runs: layout, model, steps, precision, faults,
data; seeds may differ, runs of one value are repeats, drawn with their spread), the runs that
differ elsewhere listed beside it with what differs, never plotted."""

from __future__ import annotations

import dash
import pandas as pd
import plotly.graph_objects as go
from dash import Input, Output, callback, dcc, html

from ranktrace.analysis.run import LAYOUT_AXES, compare, run_metrics, sweep_runs
from ranktrace.analysis.store import StoreError
from ranktrace.analysis.views import runs_overview
from ranktrace.app import dash_data, dash_ui, units
from ranktrace.app.report_text import COMPARISON_COLUMNS, comparison_rows

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
    note = [html.P(result["peak_note"], id="compare-peaks", className="hint")]
    table = pd.DataFrame(comparison_rows(result), columns=COMPARISON_COLUMNS)
    return html.Div([verdict, dash_ui.table(table, "compare-table"),
                     *(note if result["peak_note"] else [])])  # fmt: skip


def sweep_view(run_a: str, axis: str, metric: str) -> tuple[go.Figure, list]:
    """(`metric` against `axis` over the runs equal to run A in everything else, the list of
    runs that differ elsewhere with what differs)."""
    with dash_data.store() as con:
        points, misses = sweep_runs(con, run_a, axis)
        values = {}  # axis value -> [metric of each repeat]
        for value, row in points:
            metric_value = units.scaled(metric, run_metrics(con, row).get(metric))
            if metric_value is not None:
                values.setdefault(value, []).append(metric_value)
    xs = sorted(values)
    means = [sum(values[x]) / len(values[x]) for x in xs]
    spread = [max(values[x]) - m for x, m in zip(xs, means, strict=True)]
    below = [m - min(values[x]) for x, m in zip(xs, means, strict=True)]
    repeats = any(len(v) > 1 for v in values.values())
    error = dict(type="data", array=spread, arrayminus=below, visible=True) if repeats else None
    figure = go.Figure(go.Scatter(x=xs, y=means, mode="lines+markers", error_y=error,
                                  name="mean of the repeats" if repeats else metric))  # fmt: skip
    integer = all(isinstance(x, int | float) and float(x).is_integer() for x in xs)
    figure.update_layout(
        title=f"{units.label(metric)} vs {axis}: runs equal to A but in {axis}"
        + (" (bars: min-max of the repeats)" if repeats else ""),
        xaxis={"title": axis, **({"tickmode": "array", "tickvals": xs} if integer else {})},
        yaxis_title=units.label(metric),
        height=320,
        **dash_ui.FIGURE_LAYOUT,
    )
    listed = [html.Li(f"{row['name']} ({row['run_id']}): {axis} {row[axis]}; also "
                      + "; ".join(f"{k} {a} → {b}" for k, (a, b) in differ.items()))
              for row, differ in misses]  # fmt: skip
    excluded = [html.P(f"Not plotted: runs that differ from A in {axis} and elsewhere "
                       "(seeds are not compared)", className="hint"),
                html.Ul(listed)] if listed else []  # fmt: skip
    return figure, excluded


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
                        id="compare-metric",
                        options=[{"label": units.label(m), "value": m} for m in SWEEP_METRICS],
                        value="step_time_s",
                    ),
                ],
                className="pair",
            ),
            dcc.Graph(id="compare-sweep"),
            html.Div(id="compare-sweep-excluded"),
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
    Output("compare-sweep-excluded", "children"),
    Input("compare-a", "value"),
    Input("compare-axis", "value"),
    Input("compare-metric", "value"),
)
def on_sweep(run_a: str | None, axis: str, metric: str) -> tuple[go.Figure, list]:
    if not run_a:
        empty = go.Figure(layout={"title": "Pick run A to see its sweep", **dash_ui.FIGURE_LAYOUT})
        return empty, []
    return sweep_view(run_a, axis, metric)
