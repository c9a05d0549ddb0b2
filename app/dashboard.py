"""`ranktrace dash`: the Dash Pages app over a runs directory (pages in app/pages/)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import dash
from dash import dcc, html
from werkzeug.serving import BaseWSGIServer, make_server

from ranktrace.app import dash_data, dash_ingest

PAGES_DIR = Path(__file__).with_name("pages")
NAV = [("Runs", "/"), ("Compare", "/compare"), ("SQL", "/sql")]


def create_app(runs_dir: Path, refresh_s: float) -> dash.Dash:
    """The dashboard over `runs_dir` (its store and live runs), serving every asset locally;
    pages of a run that may still change re-read it `refresh_s` after their last read."""
    app = dash.Dash(
        __name__,
        use_pages=True,
        pages_folder=str(PAGES_DIR),
        title="ranktrace",
        serve_locally=True,
        suppress_callback_exceptions=True,
    )
    app.server.config[dash_data.RUNS_DIR_KEY] = str(Path(runs_dir).resolve())
    app.server.config[dash_data.REFRESH_S_KEY] = refresh_s
    links = [dcc.Link(label, href=href, className="nav-link") for label, href in NAV]
    app.layout = html.Div(
        [
            html.Header([html.Strong("ranktrace", className="brand"), *links], className="nav"),
            html.Main(dash.page_container),
        ]
    )
    return app


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop the dashboard (Ctrl-C, a service manager's stop)."""


def serve(
    runs_dir: Path,
    host: str,
    port: int,
    serving: Callable[[], None] = lambda: None,
    *,
    refresh_s: float,
) -> None:
    """Serve the dashboard until SIGINT or SIGTERM (werkzeug's threaded server, as `app.run`
    starts it; errors are logged, not every request), ingesting finished runs the store lacks
    meanwhile (app/dash_ingest.py). `serving` is called once the port listens.

    A stop signal shuts the server down from its handler rather than by a KeyboardInterrupt
    raised wherever the main thread happens to be: `ranktrace demo`, SIGINT'ed as its
    dashboard line appeared on a machine running another job, served on (4 tries of 4 here;
    3 minutes later still serving) where `ranktrace dash` alone stopped at every moment tried."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    app = create_app(runs_dir, refresh_s)
    app.enable_dev_tools(debug=False)  # what `app.run` sets before it serves
    server = make_server(host, port, app.server, threaded=True)
    ingester = dash_ingest.Ingester(runs_dir)
    ingester.start()
    try:
        with _stopped_by_signals(server):
            serving()
            server.serve_forever()
    finally:
        server.server_close()
        ingester.stop()


@contextmanager
def _stopped_by_signals(server: BaseWSGIServer) -> Iterator[None]:
    """While inside, STOP_SIGNALS shut `server` down (from another thread: `shutdown` waits
    for `serve_forever` to return); the handlers before are put back after."""

    def stop(signum, frame) -> None:
        threading.Thread(target=server.shutdown, name="ranktrace-dash-stop", daemon=True).start()

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
