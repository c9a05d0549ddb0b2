"""One launcher process for the `ranktrace` commands of a test session (`python -m
tests.launcher_service`, driven by tests/launcher.py).

A job is `app.cli.main(ARGV)`, the code the `ranktrace` command runs. Jobs run one after
another in this process, so torch, DuckDB and the analysis are imported once, and the rank
forkserver (trainer/rank_server.py) started by the first job serves every later one: a launch
costs ~1-2 s less than a new `ranktrace` process importing torch, twice (itself and its
forkserver). `ranktrace sweep` and `ranktrace demo` launch several jobs from one process the
same way.

Each job's output, its ranks' included (they inherit this process's descriptors through the
forkserver), is routed to that job's files: descriptors 1 and 2 are pipes read here.

Protocol: one JSON object per line on stdin, {"argv": [...], "out": PREFIX, "cwd": DIR or
null}; the job runs in DIR (else the service's directory) and writes PREFIX.stdout and
PREFIX.stderr, then PREFIX.json ({"returncode": N}) last.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import traceback
import uuid


class _Router:
    """Copies everything written to one descriptor (now a pipe) to the current job's file."""

    def __init__(self, fd: int) -> None:
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        os.close(write_end)
        self.fd, self.reader = fd, os.fdopen(read_end, "rb", buffering=0)
        self.target = None
        self.marker: bytes | None = None
        self.drained = threading.Event()
        threading.Thread(target=self._copy, daemon=True).start()

    def _copy(self) -> None:
        pending = b""
        while chunk := self.reader.read(65536):
            pending += chunk
            marker = self.marker
            if marker is not None and marker in pending:
                before, _, pending = pending.partition(marker)
                self._write(before)
                self.drained.set()
                continue
            keep = len(marker) if marker else 0  # a marker may arrive split in two reads
            self._write(pending[: len(pending) - keep])
            pending = pending[len(pending) - keep :]

    def _write(self, data: bytes) -> None:
        if data and self.target is not None:
            self.target.write(data)
            self.target.flush()

    def start(self, path: str) -> None:
        self.target = open(path, "wb")  # noqa: SIM115 (closed in finish)

    def finish(self) -> None:
        """Wait until everything written before now reached the file, then close it."""
        self.marker = f"\n@@{uuid.uuid4().hex}@@\n".encode()
        self.drained.clear()
        os.write(self.fd, self.marker)
        self.drained.wait(timeout=30)
        self.marker = None
        self.target.close()
        self.target = None


def run_job(argv: list[str]) -> int:
    """`ranktrace ARGV` in this process; its exit status."""
    from ranktrace.app.cli import main

    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    except Exception:
        traceback.print_exc()
        return 1


def serve() -> None:
    control = os.fdopen(os.dup(0), "r")
    routers = (_Router(1), _Router(2))
    home = os.getcwd()
    for line in control:
        job = json.loads(line)
        for router, suffix in zip(routers, (".stdout", ".stderr"), strict=True):
            router.start(job["out"] + suffix)
        try:
            os.chdir(job.get("cwd") or home)
            code = run_job(job["argv"])
        except OSError as error:  # a directory that is not there: the job's own failure
            print(f"launcher: {error}", file=sys.stderr)
            code = 1
        finally:
            os.chdir(home)
        with contextlib.suppress(ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        for router in routers:
            router.finish()
        with open(job["out"] + ".json.tmp", "w") as result:
            json.dump({"returncode": code}, result)
        os.replace(job["out"] + ".json.tmp", job["out"] + ".json")


if __name__ == "__main__":
    serve()
