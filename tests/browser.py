"""Serving the real dashboard for a browser: `ranktrace dash` on a free localhost port, and how
to launch Debian's Chromium headless (never a downloaded browser)."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from tests.conftest import REPO, cli_env, wait_for

CHROMIUM = "/usr/bin/chromium"
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serving(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start_dashboard(runs_dir, *options: str) -> tuple[subprocess.Popen, str]:
    """`ranktrace dash [OPTIONS]` on a free localhost port; returns (process, base URL)."""
    port = free_port()
    argv = [sys.executable, "-m", "ranktrace.app.cli", "dash", "--runs-dir", str(runs_dir),
            "--port", str(port), *options]  # fmt: skip
    log = Path(tempfile.mkdtemp(prefix="ranktrace-dash-")) / "dash.log"
    with log.open("w") as out:  # the child keeps its own handle
        proc = subprocess.Popen(argv, cwd=REPO, env=cli_env(), stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: _serving(base + "/"), 60, f"the dashboard to serve (its log: {log})")
    return proc, base
