"""Runs the tests' third-party jobs bare (no ranktrace in the process), as `torchrun
--standalone --nproc-per-node N SCRIPT ARGS` or `python SCRIPT ARGS` would, from one process
that imported torch once: each rank is forked from here instead of a new interpreter importing
torch (~1.9 s of CPU each, 3-5 a job). Driven by tests/bare_jobs.py; the reference that
tests/test_run_command.py compares `ranktrace run`'s results with.

Started as `python tests/bare_job_server.py` with the jobs' environment (OMP_NUM_THREADS=1, no
PYTHONPATH). It never imports ranktrace. A rank gets what torchrun gives one (its RANK,
LOCAL_RANK, WORLD_SIZE... and a rendezvous at MASTER_ADDR:MASTER_PORT), then runs its script as
`python SCRIPT` does: from its folder, as `__main__`, and ends as an interpreter does (its
threads joined, atexit run, an uncaught exception printed and exit status 1).

Protocol: one JSON object per line on stdin, {"script", "args", "nproc" (null: plain python),
"cwd", "env", "out"}; each rank writes OUT.RANK.stdout and OUT.RANK.stderr; the reply is one
line {"returncode": N}: the script's exit status for plain python, else 0 when every rank
exited 0 and 1 otherwise (torchrun's).
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys

# The point of this process: every rank forked with torch imported, and with what torch imports
# lazily on a job's first optimizer step, DDP wrap or DTensor call (torch._dynamo: ~1.2-1.7 s of
# CPU a rank), and the parallel APIs the jobs import. Not lightning: it reads the rank from the
# environment when imported (every rank forked from here would be rank 0).
import torch._dynamo
import torch.distributed
import torch.distributed.device_mesh
import torch.distributed.fsdp
import torch.distributed.pipelining
import torch.distributed.tensor.parallel
import torch.nn.parallel
import torch.optim  # noqa: F401


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun_environment(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What `torchrun --standalone --nproc-per-node NPROC` sets for local rank `rank`."""
    size = str(nproc)
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": size, "LOCAL_WORLD_SIZE": size,
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": size, "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }  # fmt: skip


def _run_rank(job: dict, rank: int, extra: dict[str, str]) -> None:
    """In a forked child: become `python SCRIPT ARGS` for one rank; never returns."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)  # the job gets the descriptors `python SCRIPT` would, no more
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        target = os.open(f"{job['out']}.{rank}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"], **extra)
    script = os.path.abspath(job["script"])
    sys.argv = [job["script"], *job["args"]]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` puts its folder first
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)  # SystemExit and any exception leave as from `python SCRIPT`


def serve() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        nproc = job["nproc"]
        port = _free_port()
        children = []
        for rank in range(nproc or 1):
            extra = {} if nproc is None else _torchrun_environment(rank, nproc, port, job["out"])
            pid = os.fork()
            if pid == 0:
                _run_rank(job, rank, extra)
            children.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
        returncode = codes[0] if nproc is None else int(any(codes))
        print(json.dumps({"returncode": returncode}), flush=True)


if __name__ == "__main__":
    serve()
