"""Small building blocks the dashboard pages share: empty states, tables, number formats."""

from __future__ import annotations

import pandas as pd
from dash import dash_table, html

REFRESH_MS = 2000
"""How often pages of a run that may still change re-read it."""
FIGURE_LAYOUT = {"margin": {"l": 60, "r": 20, "t": 40, "b": 40}, "template": "plotly_white"}
PART_COLOURS = {
    "compute": "#1f77b4", "tp communication": "#ff7f0e", "pipeline wait": "#7f7f7f",
    "dp communication": "#2ca02c", "world communication": "#9467bd", "data": "#d62728",
    "host": "#e7ba52",
}  # fmt: skip
"""One colour per part of a step (analysis.views.BREAKDOWN_PARTS), far apart on every page."""


def empty_state(title: str, hint: str) -> html.Div:
    """A friendly message where data would be, with what to do about it."""
    return html.Div([html.H3(title), html.P(hint)], className="empty-state")


def no_runs_state(runs_dir: str) -> html.Div:
    return empty_state(
        f"No runs in {runs_dir} yet",
        "Train one, e.g. `ranktrace train --tp 2 --pp 2 --dp 2 --steps 30`, or point the "
        "dashboard at another directory with `ranktrace dash --runs-dir DIR`.",
    )


def table(frame: pd.DataFrame, table_id: str, **options) -> dash_table.DataTable:
    """A DataTable of `frame` (markdown links allowed in columns named in `markdown`)."""
    markdown = set(options.pop("markdown", ()))
    columns = [
        {"name": c, "id": c, **({"presentation": "markdown"} if c in markdown else {})}
        for c in frame.columns
    ]
    return dash_table.DataTable(
        id=table_id,
        columns=columns,
        data=frame.to_dict("records"),
        style_table={"overflowX": "auto"},
        style_cell={"fontFamily": "monospace", "fontSize": 13, "padding": "4px 8px"},
        style_header={"fontWeight": "bold"},
        **options,
    )


def seconds(value) -> str:
    return "" if value is None or pd.isna(value) else f"{value:.4f}"
