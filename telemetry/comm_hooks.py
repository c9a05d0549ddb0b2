"""Every torch.distributed call of a job ranktrace did not write, timed (`ranktrace run`).

- The module functions of `torch.distributed` (collectives and point-to-point, blocking or
  `async_op=True`) and of its functional collectives (DTensor's) are wrapped. A blocking call
  is timed from entry to return. Async work is timed from issue to the end of its last
  `wait()` (DDP's buckets, waited for in C++: to their futures' completion), and the time the
  rank spent blocked in `Work.wait()` is its `wait_ns`: what the step was exposed to.
- A functional collective is waited for right after it is issued, and timed as a blocking call:
  its wait happens inside torch's own ops (no Python call to see), and eager DTensor waits on
  the result's first use, normally the next operation.
- A call made inside another wrapped call (torch's own `all_gather_into_tensor` calls
  `all_gather_single`) is recorded once, as the outer call.
- Axis names: a DeviceMesh dimension's name for its groups (`dp`, `tp`, ... as the job named
  them), `world` for a group of every rank, else the group's ranks (`ranks:0,2`).

`CommHooks(job).install()` wraps; `uninstall()` puts torch back exactly as it was.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
import weakref

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.compiler import is_compiling

from ranktrace.telemetry.patching import Patches
from ranktrace.telemetry.timers import CudaEventTimer
from ranktrace.telemetry.torch_hooks import in_ddp_hook

# torch.distributed function -> (op recorded, the argument whose bytes are counted, how:
# "one" its own size, "each" × the group size, "list" the sum over a list of tensors)
DIST_FUNCTIONS = {
    "all_reduce": ("all_reduce", "tensor", "one"),
    "all_gather_single": ("all_gather", "output_tensor", "one"),
    "all_gather_into_tensor": ("all_gather", "output_tensor", "one"),
    "_all_gather_base": ("all_gather", "output_tensor", "one"),
    "all_gather": ("all_gather", "tensor", "each"),
    "reduce_scatter_single": ("reduce_scatter", "input", "one"),
    "reduce_scatter_tensor": ("reduce_scatter", "input", "one"),
    "_reduce_scatter_base": ("reduce_scatter", "input", "one"),
    "reduce_scatter": ("reduce_scatter", "input_list", "list"),
    "broadcast": ("broadcast", "tensor", "one"),
    "reduce": ("reduce", "tensor", "one"),
    "all_to_all_single": ("all_to_all", "input", "one"),
    "all_to_all": ("all_to_all", "input_tensor_list", "list"),
    "gather": ("gather", "tensor", "one"),
    "scatter": ("scatter", "tensor", "one"),
    "barrier": ("barrier", None, "one"),
    "send": ("send", "tensor", "one"),
    "recv": ("recv", "tensor", "one"),
    "isend": ("send", "tensor", "one"),
    "irecv": ("recv", "tensor", "one"),
}
ALWAYS_ASYNC = {"isend", "irecv"}
# functional collective -> (op, bytes: "one" the input's, "each" × the group size). torch's
# DTensor calls the `_single` forms; the others call them (recorded once, as the outer call).
FUNCOL_FUNCTIONS = {
    "all_reduce": ("all_reduce", "one"),
    "all_reduce_coalesced": ("all_reduce", "one"),
    "all_gather_single": ("all_gather", "each"),
    "all_gather_single_autograd": ("all_gather", "each"),
    "all_gather_tensor": ("all_gather", "each"),
    "all_gather_tensor_autograd": ("all_gather", "each"),
    "all_gather_single_coalesced": ("all_gather", "each"),
    "all_gather_into_tensor_coalesced": ("all_gather", "each"),
    "reduce_scatter_single": ("reduce_scatter", "one"),
    "reduce_scatter_single_autograd": ("reduce_scatter", "one"),
    "reduce_scatter_tensor": ("reduce_scatter", "one"),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", "one"),
    "reduce_scatter_single_coalesced": ("reduce_scatter", "one"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "one"),
    "all_to_all_single": ("all_to_all", "one"),
    "all_to_all_single_autograd": ("all_to_all", "one"),
    "broadcast": ("broadcast", "one"),
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def _first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, list | tuple):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


class GroupNames:
    """Axis name and group id (its lowest global rank) of each process group, cached.

    Groups are held weakly: a process group that outlives the job's `destroy_process_group`
    aborts the process at interpreter exit (torch 2.13 with gloo: "terminate called without an
    active exception", exit -6, in 11 of 21 runs of a job keeping its world group; 0 of 20 not
    keeping it), so ranktrace must never be what keeps one alive."""

    def __init__(self) -> None:
        self.mesh_names = weakref.WeakKeyDictionary()  # process group -> its axis (mesh dim)
        self._cache = weakref.WeakKeyDictionary()  # process group -> (axis, group id, size)

    def name_mesh(self, mesh) -> None:
        """Remember the dimension names of a DeviceMesh for its groups on this rank."""
        for dim, name in enumerate(mesh.mesh_dim_names or ()):
            try:
                group = mesh.get_group(dim)
            except (RuntimeError, ValueError):  # a dimension this rank holds no group of
                continue
            self.name_group(group, name)

    def name_group(self, group, name: str) -> None:
        """Calls on `group` are on axis `name` (a group that cannot be weakly referenced keeps
        the axis its ranks give it)."""
        if _remember(self.mesh_names, group, name):
            self._cache.pop(group, None)

    def of(self, group) -> tuple[str, int, int]:
        """(axis, group id, group size) of `group` (None: the default group)."""
        group = group if group is not None else dist.group.WORLD
        known = _recall(self._cache, group)
        if known is not None:
            return known
        ranks = dist.get_process_group_ranks(group)
        named = _recall(self.mesh_names, group)
        if named is not None:
            axis = named
        elif group is dist.group.WORLD or len(ranks) == dist.get_world_size():
            axis = "world"
        else:
            axis = "ranks:" + ",".join(map(str, sorted(ranks)))
        known = (axis, min(ranks), len(ranks))
        _remember(self._cache, group, known)
        return known


def _remember(table: weakref.WeakKeyDictionary, group, value) -> bool:
    """table[group] = value; False where `group` cannot be weakly referenced or hashed."""
    try:
        table[group] = value
    except TypeError:
        return False
    return True


def _recall(table: weakref.WeakKeyDictionary, group):
    """table[group], or None (also for a group that cannot be weakly referenced)."""
    try:
        return table.get(group)
    except TypeError:
        return None


class CommHooks:
    """Wraps torch.distributed for one job recorder (telemetry/job.py's `JobRecorder`): each
    call is handed to `job.issue_comm(...)`, which returns the recorder's call (or None when no
    step is being recorded); async completion and waits update it."""

    def __init__(self, job) -> None:
        self.job = job
        self.groups = GroupNames()
        self._patches = Patches()
        self._inside = threading.local()
        self._by_work: dict[int, object] = {}  # id(Work or tensor) -> the recorder's call
        self._gpu_works: list = []  # (call, its works) of this step, on GPU
        self._on_gpu: bool | None = None
        self._installed = False

    def install(self) -> None:
        """Wrap every function and method above (those this torch has); one that cannot be
        wrapped is left as torch made it and named in `notes`."""
        patches = self._patches
        for name, (op, argument, how) in DIST_FUNCTIONS.items():
            if name in vars(dist):
                wrap = functools.partial(self._wrap_dist, name=name, op=op, argument=argument,
                                         how=how)  # fmt: skip
                patches.attempt(f"torch.distributed.{name}", patches.replace_function, dist,
                                name, wrap)  # fmt: skip
        patches.attempt("torch.distributed.batch_isend_irecv", patches.replace_function, dist,
                        "batch_isend_irecv", self._wrap_batch)  # fmt: skip
        for name, (op, how) in FUNCOL_FUNCTIONS.items():
            if name in vars(funcol):
                wrap = functools.partial(self._wrap_funcol, op=op, how=how)
                patches.attempt(f"functional collective {name}", patches.replace_function,
                                funcol, name, wrap)  # fmt: skip
        work = dist.distributed_c10d.Work
        patches.attempt("Work.wait (async work's waits)", patches.replace, work, "wait",
                        self._wrap_work_wait(work.wait))  # fmt: skip
        from torch.distributed.device_mesh import DeviceMesh

        patches.attempt("DeviceMesh axis names", patches.replace, DeviceMesh, "__init__",
                        self._wrap_mesh_init(DeviceMesh.__init__))  # fmt: skip
        self._installed = True

    @property
    def notes(self) -> list[str]:
        """What could not be wrapped, so is not recorded."""
        return self._patches.notes

    def uninstall(self) -> None:
        """Put torch back; a wrapper a module took after `install()` calls through untimed."""
        self._installed = False
        self._patches.restore()

    def _timing(self) -> bool:
        """Whether a call made now is timed: installed, a process group exists and the call is
        not made by another wrapped call (recorded once, as that outer call)."""
        return self._installed and not getattr(self._inside, "depth", 0) and dist.is_initialized()

    def _call_inside(self, original, *args, **kwargs):
        """`original(...)`, its own wrapped calls passed through untimed."""
        self._inside.depth = 1
        try:
            return original(*args, **kwargs)
        finally:
            self._inside.depth = 0

    # -- torch.distributed ------------------------------------------------------------------

    def _wrap_dist(self, original, name: str, op: str, argument: str | None, how: str):
        parameters = list(inspect.signature(original).parameters)
        position = {p: i for i, p in enumerate(parameters)}
        hooks = self

        def argument_of(args, kwargs, key):
            if key in kwargs:
                return kwargs[key]
            index = position.get(key)
            return args[index] if index is not None and index < len(args) else None

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if is_compiling() or not hooks._timing():
                return original(*args, **kwargs)
            is_async = name in ALWAYS_ASYNC or bool(argument_of(args, kwargs, "async_op"))
            group = argument_of(args, kwargs, "group")
            axis, group_id, size = hooks.groups.of(group)
            value = argument_of(args, kwargs, argument) if argument else None
            nbytes = _nbytes(value) * (size if how == "each" else 1)
            tensor = _first_tensor(value)
            peer = hooks._peer(name, args, kwargs, argument_of, group)
            if peer >= 0:
                group_id = min(dist.get_rank(), peer)
            call = hooks.job.issue_comm(op, axis, group_id, size, nbytes,
                                        tensor.dtype if tensor is not None else None, peer,
                                        is_async)  # fmt: skip
            result = hooks._call_inside(original, *args, **kwargs)
            if call is None:
                return result
            if not is_async:
                hooks.job.complete_comm(call)
            elif result is not None:
                hooks._watch([result], call)
            return result

        return timed

    @staticmethod
    def _peer(name, args, kwargs, argument_of, group) -> int:
        """The global rank at the other end of a point-to-point call, else -1."""
        if name not in ("send", "recv", "isend", "irecv"):
            return -1
        key = "dst" if name in ("send", "isend") else "src"
        peer = argument_of(args, kwargs, key)
        if peer is None:
            group_peer = kwargs.get(f"group_{key}")
            if group_peer is None:
                return -1
            return dist.get_global_rank(group or dist.group.WORLD, group_peer)
        return int(peer)

    def _wrap_batch(self, original):
        hooks = self

        @functools.wraps(original)
        def timed(p2p_op_list):
            if is_compiling() or not hooks._timing() or not p2p_op_list:
                return original(p2p_op_list)
            sends = [p for p in p2p_op_list if p.op in (dist.isend, dist.send)]
            op = "send_recv" if sends and len(sends) < len(p2p_op_list) else (
                "send" if sends else "recv")  # fmt: skip
            first = p2p_op_list[0]
            axis, _, size = hooks.groups.of(first.group)
            peer = first.peer
            call = hooks.job.issue_comm(op, axis, min(dist.get_rank(), peer), size,
                                        sum(_nbytes(p.tensor) for p in p2p_op_list),
                                        first.tensor.dtype, peer, True)  # fmt: skip
            works = hooks._call_inside(original, p2p_op_list)
            if call is not None and works:
                hooks._watch(list(works), call)
            return works

        return timed

    def _watch(self, works: list, call) -> None:
        """Follow `works` (one call's): their waits are the rank's exposure to it, and the end
        of the last wait its completion, unless torch waits for them in C++ (DDP's buckets),
        where their futures' callbacks complete it. (A callback for every call cost ~90 µs of
        CPU a call, most of it gloo's thread and the step thread handing the GIL over.)"""
        if self.on_gpu:  # a CUDA future completes at enqueue: NCCL's own events time it
            self._gpu_works.append((call, works))
            for work in works:
                self._by_work[id(work)] = call
            return
        if not in_ddp_hook():
            for work in works:
                self._by_work[id(work)] = call
            return
        remaining = [len(works)]
        lock = threading.Lock()
        job = self.job

        def done(_future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                job.complete_comm(call, end_ns=time.perf_counter_ns())

        for work in works:
            self._by_work[id(work)] = call
            try:
                work.get_future().add_done_callback(done)
            except (RuntimeError, AttributeError):  # a backend without futures: wait() ends it
                remaining[0] -= 1

    def _wrap_work_wait(self, original):
        hooks = self

        @functools.wraps(original)
        def wait(work, *args, **kwargs):
            call = None if is_compiling() else hooks._by_work.pop(id(work), None)
            if call is None:
                return original(work, *args, **kwargs)
            recorder = hooks.job.recorder
            start = recorder.host_mark()
            try:
                return original(work, *args, **kwargs)
            finally:
                hooks.job.waited(call, start, recorder.host_mark())

        return wait

    # -- functional collectives (DTensor) ---------------------------------------------------

    def _wrap_funcol(self, original, op: str, how: str):
        position = {p: i for i, p in enumerate(inspect.signature(original).parameters)}
        hooks = self

        def argument_of(args, kwargs, key, default=None):
            index = position.get(key)
            if key in kwargs:
                return kwargs[key]
            return args[index] if index is not None and index < len(args) else default

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if is_compiling() or not hooks._timing() or not args:
                return original(*args, **kwargs)
            tensors = args[0]  # a tensor, or a list of them (the coalesced forms)
            try:
                process_group = dist.distributed_c10d._resolve_process_group(
                    funcol._resolve_group_name(argument_of(args, kwargs, "group"),
                                               argument_of(args, kwargs, "tag", ""))
                )  # fmt: skip
            except (RuntimeError, ValueError, TypeError, AttributeError):
                process_group = None
            axis, group_id, size = hooks.groups.of(process_group)
            nbytes = _nbytes(tensors) * (size if how == "each" else 1)
            first = _first_tensor(tensors)
            call = hooks.job.issue_comm(op, axis, group_id, size, nbytes,
                                        first.dtype if first is not None else None, -1,
                                        False)  # fmt: skip
            result = hooks._call_inside(original, *args, **kwargs)
            if call is not None:
                for output in result if isinstance(result, list | tuple) else (result,):
                    raw = getattr(output, "elem", output)  # an AsyncCollectiveTensor's tensor
                    if isinstance(raw, torch.Tensor):
                        torch.ops._c10d_functional.wait_tensor(raw)
                hooks.job.complete_comm(call)
            return result

        return timed

    # -- DeviceMesh ---------------------------------------------------------------------------

    def _wrap_mesh_init(self, original):
        hooks = self

        @functools.wraps(original)
        def init(mesh, *args, **kwargs):
            original(mesh, *args, **kwargs)
            if mesh.mesh_dim_names and not is_compiling():
                hooks.groups.name_mesh(mesh)
                hooks.job.on_mesh(mesh)

        return init

    @property
    def on_gpu(self) -> bool:
        """Whether the job's recorder times on a GPU (known once its telemetry opened)."""
        if self._on_gpu is None:
            recorder = self.job.recorder
            if recorder is None:
                return False
            self._on_gpu = isinstance(recorder.timer, CudaEventTimer)
        return self._on_gpu

    def time_gpu_work(self) -> None:
        """At step end, async GPU work's durations from NCCL's own start and end events (the
        job's environment has TORCH_NCCL_ENABLE_TIMING=1: `ranktrace run` sets it); without
        them its end is unknown and it is recorded at its issue."""
        if not self._gpu_works:
            return
        torch.cuda.synchronize()
        for call, works in self._gpu_works:
            try:
                duration_ms = max(work._get_duration() for work in works)
            except (RuntimeError, AttributeError, ValueError):
                continue
            call[9] = ("after", int(duration_ms * 1e6))
        self._gpu_works = []

    def forget(self) -> None:
        """Drop the waits that never came (called at step end)."""
        self._by_work.clear()
