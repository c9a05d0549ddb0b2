"""The test session's side of tests/launcher_service.py: `ranktrace` commands sent to one
long-lived launcher process instead of a new interpreter each."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class LauncherService:
    """Starts the service on first use; `run` sends one job and waits for its result."""

    def __init__(self, cwd: Path, env: dict) -> None:
        self.cwd, self.env = cwd, env
        self.proc: subprocess.Popen | None = None
        self.jobs: Path | None = None  # job output files, made on first use
        self.count = 0

    def _started(self) -> subprocess.Popen:
        if self.jobs is None:
            self.jobs = Path(tempfile.mkdtemp(prefix="ranktrace-launcher-"))
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.launcher_service"], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                cwd=self.cwd, env=self.env, start_new_session=True,
            )  # fmt: skip
        return self.proc

    def run(self, argv: list[str], timeout: float, cwd: Path | None = None) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of `ranktrace ARGV` run in `cwd` (else the service's
        directory); TimeoutExpired after `timeout` (the service and its ranks are killed; the
        next job starts a new one)."""
        proc = self._started()
        self.count += 1
        out = self.jobs / f"job-{self.count:04d}"
        job = {"argv": argv, "out": str(out), "cwd": str(cwd) if cwd else None}
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        result = out.with_suffix(".json")
        deadline = time.monotonic() + timeout
        while not result.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the launcher service died (exit {proc.returncode})")
            if time.monotonic() > deadline:
                self.kill()
                raise subprocess.TimeoutExpired(argv, timeout)
            time.sleep(0.05)
        code = json.loads(result.read_text())["returncode"]
        read = lambda suffix: out.with_suffix(suffix).read_text(errors="replace")  # noqa: E731
        return code, read(".stdout"), read(".stderr")

    def kill(self) -> None:
        """Kill the service and everything it started (its process group)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        """End the service after its last job (its forkserver ends with it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        self.kill()
