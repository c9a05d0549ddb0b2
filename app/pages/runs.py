"""Runs: every run in the store (and those still training or not yet ingested), filterable;
pick two to compare. Refreshes every --refresh-s (2 s) while a run trains."""

from __future__ import annotations

import time

import dash
import pandas as pd
from dash import Input, Output, callback, dcc, html

from ranktrace.analysis.views import runs_overview
from ranktrace.app import dash_data, dash_ui, units

dash.register_page(__name__, path="/", name="Runs", title="ranktrace: runs")

LIVE = "running (live)"
"""The status of a run still training, whether its pages read its segments or its windows."""
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


def runs_rows(unstored: dict[str, dict]) -> list[dict]:
    """The runs table's rows: the runs not in the store (`unstored`: run id -> run.json;
    training, or awaiting ingest) first, then stored runs with their straggler count."""
    rows = []
    if dash_data.has_store():
        with dash_data.store() as con:
            overview = runs_overview(con)
        records = dash_data.run_records()
        for run in overview.to_dict("records"):
            findings = dash_data.run_report(run["run_id"])["stragglers"]
            rows.append(
                {
                    "run": f"[{run['run_id']}](/run/{run['run_id']})",
                    "run_id": run["run_id"],
                    "name": run["name"],
                    "status": _stored_status(run["status"], records.get(run["run_id"])),
                    "tp": run["tp"],
                    "pp": run["pp"],
                    "dp": run["dp"],
                    "zero": run["zero"],
                    "micro_batches": run["micro_batches"],
                    "model": run["model"],
                    "world_size": run["world_size"],
                    "steps_done": run["steps_done"],
                    "median step s": dash_ui.seconds(run["median_step_time_s"]),
                    "MFU": units.formatted("mfu", run["mfu"]),
                    "tokens/s": f"{run['tokens_per_s']:.0f}" if run["tokens_per_s"] else "",
                    "stragglers": len(findings),
                    "started": str(run["started"])[:19],
                }
            )
    for run_id, record in unstored.items():
        status = record.get("status")
        rows.insert(
            0,
            {
                "run": f"[{run_id}](/run/{run_id})",
                "run_id": run_id,
                "name": record.get("name"),
                "status": LIVE if status == "running" else f"{status} (not in store)",
                "steps_done": len(record.get("losses", [])),
                "started": _started(record),
            },
        )
    return rows


def _stored_status(stored: str | None, record: dict | None) -> str | None:
    """A stored run's status: live while it trains (its completed windows stored); one that
    ended since the store took its windows says so until its final ingest."""
    if stored != "running":
        return stored
    ended = (record or {}).get("status")
    return LIVE if ended in (None, "running") else f"{ended} (being stored)"


def _started(record: dict) -> str:
    started = record.get("started_at")
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else ""


def layout(**_query) -> html.Div:
    unstored = dash_data.unstored_runs()
    rows = runs_rows(unstored)
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
            dash_ui.refresh_timer("runs-refresh", dash_data.any_changing(), dash_data.refresh_s()),
        ]
    )


@callback(
    Output("runs-table", "data"),
    Output("runs-refresh", "max_intervals"),
    Input("runs-refresh", "n_intervals"),
    prevent_initial_call=True,
)
def refresh(n_intervals: int):
    """While a run trains (or awaits ingest): re-read the runs."""
    unstored = dash_data.unstored_runs()
    frame = pd.DataFrame(runs_rows(unstored)).reindex(columns=[*COLUMNS, "run_id"])
    return frame.to_dict("records"), dash_ui.next_tick(n_intervals, dash_data.any_changing())


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
