"""Ranks: a rank × step heatmap (step time, compute, or blocking), ranks ordered by pipeline
stage, then dp, then tp, so a straggler is a band; and per-axis collective duration boxes.
Refreshes every --refresh-s (2 s) while the run trains."""

from __future__ import annotations

import dash
import plotly.graph_objects as go
from dash import Input, Output, State, callback, dcc, html

from ranktrace.analysis.store import StoreError
from ranktrace.analysis.views import HEATMAP_METRICS, collective_quantiles
from ranktrace.app import dash_data, dash_ui
from ranktrace.app.figures import rank_step_heatmap

dash.register_page(
    __name__, path_template="/ranks/<run_id>", name="Ranks", title="ranktrace: ranks"
)


def heatmap_figure(run_id: str, metric: str) -> go.Figure:
    """Rank × step heatmap of `metric` (steps binned to at most 300 columns)."""
    with dash_data.run_connection(run_id) as con:
        return rank_step_heatmap(con, run_id, metric)


def collectives_figure(run_id: str) -> go.Figure:
    """Per axis and op, a box of collective durations (drawn from quantiles)."""
    with dash_data.run_connection(run_id) as con:
        quantiles = collective_quantiles(con, run_id)
    figure = go.Figure()
    for row in quantiles.to_dict("records"):
        q = row["duration_s"]
        label = f"{row['axis']} {row['op']} ({row['calls']})"
        figure.add_trace(
            go.Box(x=[label], name=label, lowerfence=[q[1]], q1=[q[2]], median=[q[3]],
                   q3=[q[4]], upperfence=[q[5]])
        )  # fmt: skip
    figure.update_layout(
        title="collective duration by axis (s; whiskers 5-95%)",
        height=360,
        showlegend=False,
        **dash_ui.FIGURE_LAYOUT,
    )
    return figure


def layout(run_id: str = "", metric: str = "own_s", **_query) -> html.Div:
    metric = metric if metric in HEATMAP_METRICS else "own_s"
    try:
        heat, boxes = heatmap_figure(run_id, metric), collectives_figure(run_id)
    except StoreError as error:
        return dash_ui.empty_state(f"No data for run {run_id}", str(error))
    options = [{"label": label, "value": key} for key, label in HEATMAP_METRICS.items()]
    return html.Div(
        [
            html.H2([f"Ranks of run {run_id} · ", dcc.Link("overview", href=f"/run/{run_id}")]),
            dcc.Store(id="ranks-run-id", data=run_id),
            dcc.RadioItems(id="ranks-metric", options=options, value=metric, inline=True),
            dcc.Graph(id="ranks-heatmap", figure=heat),
            dcc.Graph(id="ranks-collectives", figure=boxes),
            dash_ui.refresh_timer(
                "ranks-refresh", dash_data.refreshes(run_id), dash_data.refresh_s()
            ),
        ]
    )


@callback(
    Output("ranks-heatmap", "figure"),
    Output("ranks-collectives", "figure"),
    Output("ranks-refresh", "max_intervals"),
    Input("ranks-metric", "value"),
    Input("ranks-refresh", "n_intervals"),
    State("ranks-run-id", "data"),
    prevent_initial_call=True,
)
def redraw(metric: str, n_intervals: int, run_id: str):
    """The heatmap of the chosen metric; while the run trains, both figures re-read."""
    again = dash_data.refreshes(run_id)  # asked before reading (see pages/run.py)
    refreshing = dash.ctx.triggered_id == "ranks-refresh"
    boxes = collectives_figure(run_id) if refreshing else dash.no_update
    return heatmap_figure(run_id, metric), boxes, dash_ui.next_tick(n_intervals, again)
