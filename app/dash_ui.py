"""Small building blocks the dashboard pages share: empty states, tables, number formats."""

from __future__ import annotations

import pandas as pd
from dash import dash_table, dcc, html

FIGURE_LAYOUT = {"margin": {"l": 60, "r": 20, "t": 40, "b": 40}, "template": "plotly_white"}
PART_COLOURS = {
    "compute": "#1f77b4", "tp communication": "#ff7f0e", "pipeline wait": "#7f7f7f",
    "dp communication": "#2ca02c", "world communication": "#9467bd", "data": "#d62728",
    "host": "#e7ba52", "wait for a core": "#17becf",
}  # fmt: skip
"""One colour per part of a step (analysis.views.BREAKDOWN_PARTS), far apart on every page."""

TABLE_CELL = {"fontFamily": "monospace", "fontSize": 13, "padding": "4px 8px",
              "whiteSpace": "normal", "height": "auto"}  # fmt: skip
"""Every table cell's style. Cells wrap, where DataTable's own do not: unwrapped, the demo's
remedies table was 98 px and its runs table 293 px wider than their box at 1280 px, their last
columns out of view."""


def refresh_timer(timer_id: str, live: bool, interval_s: float) -> dcc.Interval:
    """A page's refresh: where `live`, one tick `interval_s` after the page loads, and each
    further tick armed by the refresh callback as it returns (`next_tick`), so that two
    refreshes never overlap. Dash drops the result of a callback fired again before it
    returned (plotly/dash#1613): on a free-running 2 s interval a run page whose refresh took
    longer never updated again, "running" 120 s after its run was stored (a timing-loop run)."""
    return dcc.Interval(id=timer_id, interval=round(interval_s * 1000), max_intervals=int(live))


def next_tick(n_intervals: int | None, again: bool) -> int:
    """The refresh timer's `max_intervals` once a refresh returns: one tick more where the
    page refreshes again, else none (the timer stops)."""
    return (n_intervals or 0) + 1 if again else 0


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
    """A DataTable of `frame` (markdown links allowed in columns named in `markdown`); its
    headers in words unless `exact_headers` (a query's columns, named as the user wrote them)."""
    markdown = set(options.pop("markdown", ()))
    # Headers in words (`micro batches`), which wrap: `micro_batches` was one word no column
    # could be narrower than, the demo's runs table 36 px wider than its box at 1280 px even
    # with its cells wrapped. Column ids keep the data's names.
    exact = options.pop("exact_headers", False)
    columns = [
        {"name": c if exact else c.replace("_", " "), "id": c,
         **({"presentation": "markdown"} if c in markdown else {})}
        for c in frame.columns
    ]  # fmt: skip
    return dash_table.DataTable(
        id=table_id,
        columns=columns,
        data=frame.to_dict("records"),
        style_table={"overflowX": "auto"},
        style_cell=TABLE_CELL,
        style_header={"fontWeight": "bold"},
        **options,
    )


def seconds(value) -> str:
    return "" if value is None or pd.isna(value) else f"{value:.4f}"
