"""Runs: every run in the store (and those still training), filterable; pick two to compare."""

from __future__ import annotations

import dash
import pandas as pd
from dash import Input, Output, callback, dcc, html

from analysis.views import runs_overview
from app import dash_data, dash_ui

dash.register_page(__name__, path="/", name="Runs", title="ranktrace: runs")

COLUMNS = [
    "run",
    "name",
    "status",
    "tp",
    "pp",
    "dp",
    "zero",
    "micro_batches",
    "model",
    "world_size",
    "steps_done",
    "median step s",
    "MFU",
    "tokens/s",
    "stragglers",
    "started",
]


def runs_rows() -> list[dict]:
    """The runs table's rows: stored runs with their straggler count, then live runs."""
    rows = []
    if dash_data.has_store():
        with dash_data.store() as con:
            overview = runs_overview(con)
        for run in overview.to_dict("records"):
            findings = dash_data.run_report(run["run_id"])["stragglers"]
            rows.append(
                {
                    "run": f"[{run['run_id']}](/run/{run['run_id']})",
                    "run_id": run["run_id"],
                    "name": run["name"],
                    "status": run["status"],
                    "tp": run["tp"],
                    "pp": run["pp"],
                    "dp": run["dp"],
                    "zero": run["zero"],
                    "micro_batches": run["micro_batches"],
                    "model": run["model"],
                    "world_size": run["world_size"],
                    "steps_done": run["steps_done"],
                    "median step s": dash_ui.seconds(run["median_step_time_s"]),
                    "MFU": dash_ui.percent(run["mfu"]),
                    "tokens/s": f"{run['tokens_per_s']:.0f}" if run["tokens_per_s"] else "",
                    "stragglers": len(findings),
                    "started": str(run["started"])[:19],
                }
            )
    stored = {row["run_id"] for row in rows}
    for run_id in dash_data.running_run_ids():
        if run_id not in stored:
            record = dash_data.run_record(run_id) or {}
            rows.insert(
                0,
                {
                    "run": f"[{run_id}](/run/{run_id})",
                    "run_id": run_id,
                    "name": record.get("name"),
                    "status": "running (live)",
                    "steps_done": len(record.get("losses", [])),
                },
            )
    return rows


def layout(**_query) -> html.Div:
    rows = runs_rows()
    if not rows:
        return dash_ui.no_runs_state(str(dash_data.runs_dir()))
    frame = pd.DataFrame(rows).reindex(columns=[*COLUMNS, "run_id"])
    return html.Div(
        [
            html.H2("Runs"),
            dash_ui.table(
                frame,
                "runs-table",
                markdown=["run"],
                filter_action="native",
                sort_action="native",
                row_selectable="multi",
                selected_rows=[],
                hidden_columns=["run_id"],
                page_size=50,
                css=[{"selector": ".show-hide", "rule": "display: none"}],
            ),
            html.Div(id="runs-compare-link", className="actions"),
        ]
    )


@callback(
    Output("runs-compare-link", "children"),
    Input("runs-table", "selected_rows"),
    Input("runs-table", "data"),
)
def compare_link(selected: list[int] | None, data: list[dict]):
    """A link to the compare page once exactly two runs are selected."""
    selected = selected or []
    if len(selected) != 2:
        return html.Span("Select two runs to compare them.", className="hint")
    a, b = (data[i]["run_id"] for i in selected)
    return dcc.Link(f"Compare {a} with {b}", href=f"/compare?a={a}&b={b}", id="runs-compare")
