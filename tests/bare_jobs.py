"""The bare reference runs of the tests' third-party jobs, through one tests/bare_job_server.py
per test process (torch imported once, each rank forked): `run_bare` answers like
`subprocess.run` of the job's `torchrun` (or `python`) command line, its ranks' output
concatenated in rank order (only rank 0 prints losses)."""

from __future__ import annotations

import atexit
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

SERVER = Path(__file__).with_name("bare_job_server.py")

_lock = threading.Lock()
_server: subprocess.Popen | None = None
_outputs = Path(tempfile.mkdtemp(prefix="bare-jobs-"))


def _stop() -> None:
    """End the server (its stdin closed) and remove the ranks' output files."""
    if _server is not None and _server.poll() is None:
        _server.stdin.close()
        try:
            _server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _server.kill()
    shutil.rmtree(_outputs, ignore_errors=True)


atexit.register(_stop)


def _started(env: dict[str, str]) -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env=env, cwd=_outputs,
                                   text=True)  # fmt: skip
    return _server


def run_bare(script: str, args: tuple[str, ...], nproc: int | None, cwd: Path,
             env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:  # fmt: skip
    """`script ARGS` bare on `nproc` ranks (None: one plain process) from `cwd` with `env`."""
    with _lock:
        server = _started(env)
        out = str(_outputs / uuid.uuid4().hex)
        request = {"script": script, "args": list(args), "nproc": nproc, "cwd": str(cwd),
                   "env": env, "out": out}  # fmt: skip
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        reply: list[str] = []
        reader = threading.Thread(target=lambda: reply.append(server.stdout.readline()))
        reader.start()
        reader.join(timeout)
        if not reply or not reply[0]:
            server.kill()
            raise TimeoutError(f"bare {script} {args} gave no answer in {timeout} s")
    ranks = range(nproc or 1)
    read = [(Path(f"{out}.{r}.stdout").read_text(), Path(f"{out}.{r}.stderr").read_text())
            for r in ranks]  # fmt: skip
    return subprocess.CompletedProcess(
        [script, *args],
        json.loads(reply[0])["returncode"],
        "".join(stdout for stdout, _ in read),
        "".join(stderr for _, stderr in read),
    )
