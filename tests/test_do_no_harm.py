"""ranktrace's wrappers pass every check torch and libraries make on what they replace: `P2POp`
and `batch_isend_irecv` (which compare functions by identity), `is` between torch's own names
and a job's earlier imports, `inspect.signature`, pickling, and `torch.compile` (no graph break
that torch alone would not make); and they keep alive nothing the job lets go. On 2 real
gloo ranks, inside a recorded step."""

from __future__ import annotations

import gc
import inspect
import pickle
import sys
import types
import weakref
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from ranktrace.telemetry.comm_hooks import DIST_FUNCTIONS, FUNCOL_FUNCTIONS, CommHooks
from ranktrace.telemetry.job import JobRecorder, Settings
from ranktrace.telemetry.patching import Patches
from ranktrace.telemetry.torch_hooks import TorchHooks
from tests.distributed import run_on_ranks


def _replaced() -> dict[str, tuple[object, str]]:
    """Every function or method the hooks replace: label -> (owner, attribute)."""
    owners = {f"dist.{n}": (dist, n) for n in [*DIST_FUNCTIONS, "batch_isend_irecv"]}
    owners.update({f"funcol.{n}": (funcol, n) for n in FUNCOL_FUNCTIONS})
    owners.update({"Work.wait": (dist.distributed_c10d.Work, "wait"),
                   "DeviceMesh.__init__": (DeviceMesh, "__init__"),
                   "autograd.backward": (torch.autograd, "backward")})  # fmt: skip
    return {label: (owner, name) for label, (owner, name) in owners.items() if hasattr(owner, name)}


def _signature(fn) -> str:
    """`inspect.signature(fn)` as text ("none" where inspect finds none, as for C methods)."""
    try:
        return str(inspect.signature(fn))
    except ValueError:
        return "none"


def _graph_breaks(model: torch.nn.Module) -> dict[str, int]:
    """Dynamo's graph breaks in three compiled functions: collectives (blocking, functional),
    a model's forward, and a training step's forward and backward."""
    import torch._dynamo

    def collectives(x):
        y = x * 2
        dist.all_reduce(y)
        return funcol.all_reduce(y, "sum", dist.group.WORLD) + 1

    def forward(x):
        return model(x).sum()

    def train(x):
        model(x).sum().backward()
        return x + 1

    counts = {}
    for fn in (collectives, forward, train):
        torch._dynamo.reset()
        counts[fn.__name__] = torch._dynamo.explain(fn)(torch.randn(4, 8)).graph_break_count
    return counts


def _held_after_release() -> list[str]:
    """What a job let go of that is still alive: a DDP model and its process group, used in a
    recorded step, then deleted and destroyed by the job. (A process group alive past its
    `destroy_process_group` aborts the process at exit: telemetry/comm_hooks.py.)"""
    from torch.nn.parallel import DistributedDataParallel

    group = dist.new_group([0, 1])
    ddp = DistributedDataParallel(torch.nn.Linear(8, 1), process_group=group)
    ddp(torch.randn(4, 8)).sum().backward()
    dist.all_reduce(torch.ones(1), group=group)
    alive = {"DDP model": weakref.ref(ddp), "process group": weakref.ref(group)}
    del ddp
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return [name for name, ref in alive.items() if ref() is not None]


def _checks(rank: int, world_size: int, run_dir: str) -> dict:
    early = types.ModuleType("job_imported_early")  # a job's `from torch.distributed import isend`
    early.isend = dist.isend
    sys.modules[early.__name__] = early
    replaced = _replaced()
    originals = {label: vars(owner)[name] for label, (owner, name) in replaced.items()}
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    bare_breaks = _graph_breaks(model)

    job = JobRecorder(Settings(Path(run_dir), "harm"))
    comm, hooks = CommHooks(job), TorchHooks(job)
    comm.install()
    hooks.install()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()  # a step is being recorded from here
    wrapped = {label: getattr(owner, name) for label, (owner, name) in replaced.items()}
    peer = 1 - rank
    received, batched = torch.zeros(4), torch.zeros(4)
    ops = [dist.P2POp(dist.isend, torch.full((4,), float(rank)), peer),
           dist.P2POp(early.isend, torch.full((4,), 10.0 + rank), peer),
           dist.P2POp(dist.irecv, received, peer),
           dist.P2POp(dist.distributed_c10d.irecv, batched, peer)]  # fmt: skip
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    from torch.distributed.pipelining.schedules import _batch_p2p  # groups ops by `dist.isend`

    sent_alone = torch.full((2,), 20.0 + rank)
    for work in _batch_p2p([dist.P2POp(dist.isend, sent_alone, peer)] if rank == 0 else
                           [dist.P2POp(dist.irecv, sent_alone, peer)]):  # fmt: skip
        work.wait()
    optimizer.step()
    functions = [label for label in replaced if inspect.isfunction(originals[label])]
    result = {
        "notes": comm.notes + hooks.notes,
        "all_wrapped": [label for label in replaced if wrapped[label] is originals[label]],
        "one_isend": dist.isend is dist.distributed_c10d.isend is early.isend,
        "exchanged": (received.tolist(), batched.tolist(), sent_alone.tolist()),
        "signatures_differ": [
            label
            for label in replaced
            if _signature(wrapped[label]) != _signature(originals[label])
        ],
        # Dynamo remaps only functions; a function pickles by its module and name
        "no_longer_functions": [f for f in functions if not inspect.isfunction(wrapped[f])],
        "unpickled_differ": [
            f for f in functions if pickle.loads(pickle.dumps(wrapped[f])) is not wrapped[f]
        ],
        "breaks": (bare_breaks, _graph_breaks(model)),
    }
    result["held"] = _held_after_release()  # last: torch.compile above is not to see it
    hooks.uninstall()
    comm.uninstall()
    job.close()
    result["restored"] = [label for label, (owner, name) in replaced.items()
                          if vars(owner)[name] is not originals[label]]  # fmt: skip
    result["early_restored"] = early.isend is dist.distributed_c10d.isend
    return result


@pytest.mark.multiprocess  # real rank processes (see `make test-fast`)
def test_wrapped_functions_pass_the_checks_torch_and_libraries_make(tmp_path):
    run_dir = tmp_path / "harm"
    run_dir.mkdir()
    results = run_on_ranks(_checks, 2, str(run_dir))
    for rank, result in enumerate(results):
        assert result["notes"] == [], result["notes"]  # every hook went in
        assert result["all_wrapped"] == [] and result["one_isend"]
        peer = float(1 - rank)
        assert result["exchanged"] == ([peer] * 4, [10.0 + peer] * 4,
                                       [20.0] * 2)  # fmt: skip
        assert result["signatures_differ"] == [] and result["no_longer_functions"] == []
        assert result["unpickled_differ"] == []
        bare, hooked = result["breaks"]
        assert hooked == bare, f"graph breaks with ranktrace {hooked}, without {bare}"
        assert result["restored"] == [] and result["early_restored"]
        assert result["held"] == [], f"ranktrace keeps alive what the job let go: {result['held']}"
    # the batch and pipelining's lone send/receive were recorded, in the step
    recorded = {int(path.parent.name.split("=")[1]): [row["op"] for row in pq.read_table(
        path, columns=["op"]).to_pylist() if row["op"]] for path in run_dir.glob(
        "telemetry/rank=*/spans-*.parquet")}  # fmt: skip
    assert recorded == {0: ["send_recv", "send"], 1: ["send_recv", "recv"]}


def test_a_hook_that_cannot_go_in_is_left_out_and_named():
    """Python refuses to set an attribute of a built-in type: the replacement is not made, the
    object is as it was, and the note says what is not recorded and why."""
    patches = Patches()
    original = int.bit_length
    patches.attempt("int.bit_length", patches.replace, int, "bit_length", lambda self: 0)
    assert int.bit_length is original and (5).bit_length() == 3
    (note,) = patches.notes
    assert note.startswith("int.bit_length not recorded: TypeError: ")
    patches.restore()
    assert int.bit_length is original
