"""The Plotly figures of a run, shared by the dashboard pages and the offline HTML report."""

from __future__ import annotations

import duckdb
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ranktrace.analysis.views import (
    BREAKDOWN_PARTS,
    HEATMAP_METRICS,
    heatmap,
    host_noise_steps,
    rank_against_peers,
    rank_labels,
    step_breakdown_by_part,
    step_series,
)
from ranktrace.app import dash_ui, units


def evidence_figures(con: duckdb.DuckDBPyConnection, run_id: str,
                     report: dict) -> tuple[go.Figure, go.Figure]:  # fmt: skip
    """(the series, the step breakdown) of a run, evidence first: the top located straggler's
    step against its peers' median (else the mean rank's), its steps shaded and the host-noise
    steps marked; the run page's and the HTML report's alike."""
    top = next((f for f in report["stragglers"] if f.get("rank") is not None), None)
    if top is not None:
        own, peers = rank_against_peers(con, run_id, top["rank"])
        breakdown = rank_breakdown_figure(top["rank"], own, peers)
    else:
        breakdown = breakdown_figure(step_breakdown_by_part(con, run_id))
    series = series_figure(step_series(con, run_id), report["efficiency_drops"],
                           report["stragglers"],
                           host_noise_steps(con, run_id, report["stragglers"]))  # fmt: skip
    return series, breakdown


def series_figure(series: pd.DataFrame, drops: list[dict], findings: list[dict],
                  noise_steps: list[int]) -> go.Figure:  # fmt: skip
    """Loss, MFU (%) and tokens/s over steps; each efficiency drop a dashed line at its step;
    the top finding's steps shaded, and the steps slow on every rank (host noise) apart."""
    figure = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        subplot_titles=("loss", "MFU", "tokens/s"),
    )
    for row, column in enumerate(("loss", "mfu", "tokens_per_s"), start=1):
        values = series[column] * (100.0 if column == "mfu" else 1.0)
        figure.add_trace(
            go.Scatter(x=series["step"], y=values, name=column, mode="lines"),
            row=row,
            col=1,
        )
    figure.update_yaxes(title_text="MFU (%)", row=2, col=1)
    if findings:
        top = findings[0]
        who = f"rank {top['rank']}" if top.get("rank") is not None else "candidates"
        figure.add_vrect(x0=top["first_step"] - 0.5, x1=top["last_step"] + 0.5, opacity=0.12,
                         fillcolor="crimson", line_width=0,
                         annotation_text=f"{who} {top['kind']}")  # fmt: skip
    for step in noise_steps:
        figure.add_vrect(x0=step - 0.5, x1=step + 0.5, opacity=0.25, fillcolor="grey",
                         line_width=0)  # fmt: skip
    if noise_steps:
        figure.add_annotation(text=f"grey: every rank slow (host noise): steps "
                                   f"{', '.join(map(str, noise_steps))}", xref="paper",
                              yref="paper", x=0, y=-0.08, showarrow=False)  # fmt: skip
    for drop in drops:
        figure.add_vline(
            x=drop["step"],
            line_dash="dash",
            line_color="crimson",
            annotation_text=f"-{drop['drop_pct']:.0f}%: "
            f"{drop.get('explained_by') or drop['cause']}",
        )
    figure.update_layout(height=520, showlegend=False, **dash_ui.FIGURE_LAYOUT)
    return figure


def rank_breakdown_figure(rank: int, own: pd.DataFrame, peers: pd.DataFrame) -> go.Figure:
    """The straggler's step, part by part, above its peers' median step (s), per step."""
    figure = make_subplots(rows=2, cols=1, shared_xaxes=True, shared_yaxes=True,
                           vertical_spacing=0.1, subplot_titles=(
                               f"rank {rank}", "its peers' median (the other ranks)"))  # fmt: skip
    colours = dash_ui.PART_COLOURS
    for row, frame in enumerate((own, peers), start=1):
        for name in BREAKDOWN_PARTS:
            figure.add_trace(go.Bar(x=frame["step"], y=frame[name], name=name,
                                    marker_color=colours.get(name), legendgroup=name,
                                    showlegend=row == 1), row=row, col=1)  # fmt: skip
    figure.update_layout(barmode="stack", height=480, title=f"where rank {rank}'s step goes "
                         "against its peers' (s)", **dash_ui.FIGURE_LAYOUT)  # fmt: skip
    figure.update_xaxes(title_text="step", row=2, col=1)
    return figure


def breakdown_figure(parts: pd.DataFrame) -> go.Figure:
    """Mean seconds per rank in each part of the step, stacked, per step."""
    figure = go.Figure(
        [
            go.Bar(
                x=parts["step"],
                y=parts[name],
                name=name,
                marker_color=dash_ui.PART_COLOURS.get(name),
            )
            for name in BREAKDOWN_PARTS
        ]
    )
    figure.update_layout(
        barmode="stack",
        height=360,
        title="where a rank's step goes (mean s)",
        xaxis_title="step",
        **dash_ui.FIGURE_LAYOUT,
    )
    return figure


def memory_figure(memory: list[dict]) -> go.Figure:
    """Per rank: predicted and measured state (params + grads + optimizer) and peak RSS, MiB."""
    frame = pd.DataFrame(memory)
    figure = go.Figure(
        [
            go.Bar(
                x=frame["rank"],
                y=frame["predicted_state_bytes"] / units.MIB,
                name="state predicted",
            ),
            go.Bar(
                x=frame["rank"],
                y=frame["measured_state_bytes"] / units.MIB,
                name="state measured",
            ),
            go.Bar(
                x=frame["rank"],
                y=frame["predicted_total_bytes"] / units.MIB,
                name="state + activations predicted",
            ),
        ]
    )
    figure.update_layout(
        barmode="group",
        height=320,
        title="memory per rank (MiB)",
        xaxis={"title": "rank", "tickmode": "array", "tickvals": list(frame["rank"])},
        yaxis_title="MiB",
        **dash_ui.FIGURE_LAYOUT,
    )
    return figure


def rank_step_heatmap(con: duckdb.DuckDBPyConnection, run_id: str, metric: str) -> go.Figure:
    """Rank × step heatmap of `metric` (steps binned to at most 300 columns)."""
    matrix = heatmap(con, run_id, metric)
    labels = rank_labels(con, run_id).set_index("rank")
    names = [
        f"r{r} pp{labels.at[r, 'pp']} dp{labels.at[r, 'dp']} tp{labels.at[r, 'tp']}"
        if r in labels.index
        else f"r{r}"
        for r in matrix.index
    ]
    figure = go.Figure(
        go.Heatmap(
            z=matrix.to_numpy(),
            x=list(matrix.columns),
            y=names,
            colorscale="Viridis",
            colorbar={"title": "s"},
        )
    )
    figure.update_layout(
        title=HEATMAP_METRICS[metric],
        xaxis_title="step",
        height=max(320, min(900, 18 * len(names) + 120)),
        yaxis={"autorange": "reversed"},
        **dash_ui.FIGURE_LAYOUT,
    )
    return figure
