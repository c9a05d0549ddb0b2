"""SQL: one read-only SELECT over the store, with a row limit and a time limit. The connection
is sandboxed (analysis.store.open_reader): no writes, no files outside the runs directory, no
ATTACH; more than one statement, or anything but a SELECT, is refused before it runs."""

from __future__ import annotations

import threading

import dash
import pandas as pd
from dash import Input, Output, State, callback, dcc, html

from ranktrace.analysis.store import StoreError, query
from ranktrace.app import dash_data, dash_ui

dash.register_page(__name__, path="/sql", name="SQL", title="ranktrace: SQL")

MAX_ROWS = 1000
TIME_LIMIT_S = 10.0
EXAMPLE = (
    "SELECT run_id, step, slowest_rank, max_step_time_s FROM step_stats ORDER BY step LIMIT 20"
)


def run_query(sql: str) -> tuple[pd.DataFrame | None, str]:
    """(result, message): at most MAX_ROWS rows; interrupted after TIME_LIMIT_S."""
    if not dash_data.has_store():
        return None, f"no store in {dash_data.runs_dir()} yet: train or ingest a run first"
    with dash_data.store() as con:
        timer = threading.Timer(TIME_LIMIT_S, con.interrupt)
        timer.start()
        try:
            columns, rows = query(con, sql, MAX_ROWS + 1)
        except StoreError as error:
            message = str(error)
            if "INTERRUPT" in message.upper():
                message = f"the query ran longer than {TIME_LIMIT_S:.0f} s and was stopped"
            return None, message
        finally:
            timer.cancel()
    shown = rows[:MAX_ROWS]
    note = f"first {MAX_ROWS} rows" if len(rows) > MAX_ROWS else f"{len(rows)} row(s)"
    return pd.DataFrame(shown, columns=columns), note


def layout(**_query) -> html.Div:
    return html.Div(
        [
            html.H2("SQL"),
            html.P(
                "One SELECT over runs, ranks, steps, collectives, group_transfers, spans, events "
                "and the views step_stats and step_breakdown (docs/schema.md). Read-only."
            ),
            dcc.Textarea(id="sql-query", value=EXAMPLE, style={"width": "100%", "height": 120}),
            html.Button("Run", id="sql-run", n_clicks=0),
            html.Div(id="sql-message", className="hint"),
            html.Div(id="sql-result"),
        ]
    )


@callback(
    Output("sql-result", "children"),
    Output("sql-message", "children"),
    Input("sql-run", "n_clicks"),
    State("sql-query", "value"),
    prevent_initial_call=True,
)
def on_run(_clicks: int, sql: str):
    frame, message = run_query(sql or "")
    if frame is None:
        return html.Div(), html.Span(message, id="sql-error")
    for column in frame.columns:  # lists, timestamps, ... as text for the grid
        if frame[column].dtype == object:
            frame[column] = frame[column].map(
                lambda v: v if isinstance(v, str | int | float) or v is None else str(v)
            )
    return dash_ui.table(frame, "sql-table", page_size=50, exact_headers=True), message
