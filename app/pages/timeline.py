"""Timeline: one step of a run as a per-rank Gantt chart (phases on one row per rank,
collectives on another), the pipeline schedule visible as the stages' forward/backward bars;
and the export of that step as a Chrome/Perfetto trace JSON file."""

from __future__ import annotations

import json

import dash
import plotly.graph_objects as go
from dash import Input, Output, State, callback, dcc, html

from ranktrace.analysis.store import StoreError
from ranktrace.analysis.trace_export import chrome_trace, event_name
from ranktrace.analysis.views import step_spans
from ranktrace.app import dash_data, dash_ui

dash.register_page(
    __name__, path_template="/timeline/<run_id>", name="Timeline", title="ranktrace: timeline"
)

MAX_RANKS = 64
"""Ranks drawn at once (a window of them is chosen on the page)."""
COLOURS = {
    "data": "#d62728", "forward": "#1f77b4", "backward": "#17becf", "pipeline_wait": "#7f7f7f",
    "grad_sync": "#2ca02c", "optimizer": "#9467bd", "checkpoint": "#8c564b",
    "tp comm": "#ff7f0e", "pp comm": "#bcbd22", "dp comm": "#e377c2", "world comm": "#393b79",
}  # fmt: skip
"""Phases and communication axes in hues far apart (forward and tp communication, data and the
pipeline wait were once two blues and two greys)."""
INPUT_STYLE = {"width": "6em"}


def gantt_figure(run_id: str, step: int, first_rank: int) -> go.Figure:
    """Bars from each span's start to end (ms from the step's first start), two rows per rank."""
    ranks = (first_rank, first_rank + MAX_RANKS - 1)
    with dash_data.run_connection(run_id) as con:
        spans = step_spans(con, run_id, step, ranks)
    figure = go.Figure()
    if spans.empty:
        figure.update_layout(title=f"no spans for step {step}", **dash_ui.FIGURE_LAYOUT)
        return figure
    spans = spans[spans["name"] != "ranktrace.step"]
    is_phase = spans["name"] == "ranktrace.phase"
    spans = spans.assign(
        row=[
            f"r{r} {'phases' if p else 'comm'}"
            for r, p in zip(spans["rank"], is_phase, strict=True)
        ],
        label=[event_name(row) for row in spans.to_dict("records")],
        group=spans["phase"].where(is_phase, spans["axis"] + " comm"),
    )
    for group, rows in spans.groupby("group", sort=True):
        figure.add_trace(
            go.Bar(
                y=rows["row"],
                x=rows["end_ms"] - rows["start_ms"],
                base=rows["start_ms"],
                orientation="h",
                name=group,
                marker_color=COLOURS.get(group),
                hovertext=rows["label"],
                hovertemplate="%{hovertext}<br>%{base:.2f} ms + %{x:.2f} ms<extra>%{y}</extra>",
            )
        )
    shown = sorted(int(r) for r in spans["rank"].unique())
    order = [f"r{r} {kind}" for r in shown for kind in ("phases", "comm")]
    figure.update_layout(
        barmode="overlay",
        height=max(300, 22 * len(order) + 120),
        title=f"step {step}, ranks {shown[0]}-{shown[-1]}"
        if len(shown) > 1
        else f"step {step}, rank {shown[0]}",
        xaxis_title="ms from the step's first start",
        yaxis={"categoryorder": "array", "categoryarray": order[::-1]},
        **dash_ui.FIGURE_LAYOUT,
    )
    return figure


def opening_step(run_id: str) -> int:
    """The step the timeline opens on: the top finding's first (its evidence), else the run's
    slowest step after the warm-up step, else step 1."""
    report = dash_data.run_report(run_id)
    findings = [*report["stragglers"], *report["imbalances"]]
    if findings and findings[0].get("first_step") is not None:
        return int(findings[0]["first_step"])
    with dash_data.run_connection(run_id) as con:
        slowest = con.execute(
            "SELECT step FROM step_stats WHERE run_id = ? AND step >= 1 "
            "ORDER BY max_step_time_s DESC LIMIT 1", [run_id]).fetchone()  # fmt: skip
    return int(slowest[0]) if slowest else 1


def layout(run_id: str = "", step: str | None = None, **_query) -> html.Div:
    try:
        first_step = int(step) if step is not None else opening_step(run_id)
    except ValueError:
        first_step = 1
    except StoreError as error:
        return dash_ui.empty_state(f"No data for run {run_id}", str(error))
    try:
        figure = gantt_figure(run_id, first_step, 0)
    except StoreError as error:
        return dash_ui.empty_state(f"No data for run {run_id}", str(error))
    return html.Div(
        [
            html.H2([f"Timeline of run {run_id} · ", dcc.Link("overview", href=f"/run/{run_id}")]),
            dcc.Store(id="timeline-run-id", data=run_id),
            html.Label(
                [
                    "step ",
                    dcc.Input(
                        id="timeline-step",
                        type="number",
                        value=first_step,
                        min=0,
                        debounce=True,
                        style=INPUT_STYLE,
                    ),
                ]
            ),
            html.Label(
                [
                    f" first rank (shows {MAX_RANKS}) ",
                    dcc.Input(
                        id="timeline-first-rank",
                        type="number",
                        value=0,
                        min=0,
                        debounce=True,
                        style=INPUT_STYLE,
                    ),
                ]
            ),
            html.Button("Export this step as a Perfetto trace", id="timeline-export", n_clicks=0),
            dcc.Download(id="timeline-download"),
            dcc.Graph(id="timeline-gantt", figure=figure),
        ]
    )


@callback(
    Output("timeline-gantt", "figure"),
    Input("timeline-step", "value"),
    Input("timeline-first-rank", "value"),
    State("timeline-run-id", "data"),
    prevent_initial_call=True,
)
def redraw(step: int | None, first_rank: int | None, run_id: str) -> go.Figure:
    return gantt_figure(run_id, int(step or 0), int(first_rank or 0))


@callback(
    Output("timeline-download", "data"),
    Input("timeline-export", "n_clicks"),
    State("timeline-step", "value"),
    State("timeline-run-id", "data"),
    prevent_initial_call=True,
)
def export(_clicks: int, step: int | None, run_id: str) -> dict:
    """The step as a Chrome/Perfetto trace (open it in ui.perfetto.dev or chrome://tracing)."""
    step = int(step or 0)
    with dash_data.run_connection(run_id) as con:
        trace = chrome_trace(con, run_id, step, step)
    return {"content": json.dumps(trace), "filename": f"{run_id}-step{step}.trace.json"}
