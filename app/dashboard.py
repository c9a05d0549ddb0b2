"""`ranktrace dash`: the Dash Pages app over a runs directory (pages in app/pages/)."""

from __future__ import annotations

import logging
from pathlib import Path

import dash
from dash import dcc, html

from ranktrace.app import dash_data, dash_ingest

PAGES_DIR = Path(__file__).with_name("pages")
NAV = [("Runs", "/"), ("Compare", "/compare"), ("SQL", "/sql")]


def create_app(runs_dir: Path) -> dash.Dash:
    """The dashboard over `runs_dir` (its store and live runs), serving every asset locally."""
    app = dash.Dash(
        __name__,
        use_pages=True,
        pages_folder=str(PAGES_DIR),
        title="ranktrace",
        serve_locally=True,
        suppress_callback_exceptions=True,
    )
    app.server.config[dash_data.RUNS_DIR_KEY] = str(Path(runs_dir).resolve())
    links = [dcc.Link(label, href=href, className="nav-link") for label, href in NAV]
    app.layout = html.Div(
        [
            html.Header([html.Strong("ranktrace", className="brand"), *links], className="nav"),
            html.Main(dash.page_container),
        ]
    )
    return app


def serve(runs_dir: Path, host: str, port: int) -> None:
    """Serve the dashboard until interrupted (Flask's threaded server; errors are logged, not
    every request), ingesting finished runs the store lacks meanwhile (app/dash_ingest.py)."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    app = create_app(runs_dir)
    ingester = dash_ingest.Ingester(runs_dir)
    ingester.start()
    try:
        app.run(host=host, port=port, debug=False)
    finally:
        ingester.stop()
