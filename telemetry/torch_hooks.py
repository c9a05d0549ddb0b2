"""torch's own hooks, turned into a job rank's steps and phases (telemetry/job.py):

- the optimizer's global step pre/post hooks (`torch.optim.optimizer`): the optimizer phase and
  the end of a step;
- a global module forward pre-hook: the first module call after a step began (or after a
  backward) starts `forward`; after the first steps it is replaced by hooks on the modules that
  started forwards (the job's models), so that other module calls cost nothing;
- `torch.autograd.backward` (what `Tensor.backward` calls): the backward phase;
- DDP: a communication hook (torch's own all-reduce hook, registered before DDP's first forward
  unless the job registers one) so that its gradient buckets go through torch.distributed,
  where telemetry/comm_hooks.py times them; the reducer otherwise calls the process group from
  C++, unseen.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch
from torch.compiler import is_compiling
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks

from ranktrace.telemetry.patching import Patches

ROOT_DISCOVERY_STEPS = 2
"""Steps during which every module call is looked at to learn which modules start forwards."""

_ddp_hook = threading.local()


def in_ddp_hook() -> bool:
    return bool(getattr(_ddp_hook, "active", False))


class TorchHooks:
    """Installs the hooks above for one `JobRecorder`; `uninstall()` removes them."""

    def __init__(self, job) -> None:
        self.job = job
        self._handles: list = []
        self._patches = Patches()
        self._global_forward = None
        # id -> a module that started a forward, held weakly: a job's model (a DDP module, its
        # reducer and process group with it) must go when the job lets it go (comm_hooks.py)
        self._roots: weakref.WeakValueDictionary[int, torch.nn.Module] = (
            weakref.WeakValueDictionary()
        )

    def install(self) -> None:
        """Install the hooks; one that cannot be installed is left out and named in `notes`."""
        patches = self._patches
        patches.attempt("optimizer steps", self._hook_optimizers)
        patches.attempt("forward phases", self._hook_forwards)
        patches.attempt("backward phases", patches.replace, torch.autograd, "backward",
                        self._wrap_backward(torch.autograd.backward))  # fmt: skip
        from torch.nn.parallel import DistributedDataParallel

        patches.attempt("DDP's gradient buckets", self._hook_ddp, DistributedDataParallel)

    @property
    def notes(self) -> list[str]:
        """What could not be hooked, so is not recorded."""
        return self._patches.notes

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._global_forward is not None:
            self._global_forward.remove()
            self._global_forward = None
        self._patches.restore()

    def _hook_optimizers(self) -> None:
        self._handles.append(optimizer_hooks.register_optimizer_step_pre_hook(self._before_step))
        self._handles.append(optimizer_hooks.register_optimizer_step_post_hook(self._after_step))

    def _hook_forwards(self) -> None:
        self._global_forward = module_hooks.register_module_forward_pre_hook(self._any_forward)

    def _hook_ddp(self, ddp_class) -> None:
        """Both or neither: a job's own communication hook must stop ours (DDP takes one)."""
        self._patches.replace_together([
            (ddp_class, "__init__", self._wrap_ddp_init(ddp_class.__init__)),
            (ddp_class, "register_comm_hook", self._wrap_register(ddp_class.register_comm_hook)),
        ])  # fmt: skip

    def _any_forward(self, module, args) -> None:
        """Every module call while the roots are learnt: the one that starts a forward is a root."""
        if is_compiling():
            return
        job = self.job
        if job.phase is None or job.phase[0] not in ("forward", "backward"):
            self._roots.setdefault(id(module), module)
            job.forward_begin()
        elif id(module) in self._roots and job.phase[0] == "forward":
            job.count_forward()
        if job.step >= ROOT_DISCOVERY_STEPS and self._global_forward is not None:
            self._global_forward.remove()
            self._global_forward = None
            for root in list(self._roots.values()):
                self._handles.append(root.register_forward_pre_hook(self._root_forward))
            self._roots.clear()

    def _root_forward(self, module, args) -> None:
        if is_compiling():
            return
        job = self.job
        if job.phase is not None and job.phase[0] == "forward":
            job.count_forward()
        else:
            job.forward_begin()

    def _before_step(self, optimizer, args, kwargs) -> None:
        if not is_compiling():
            self.job.optimizer_begin()

    def _after_step(self, optimizer, args, kwargs) -> None:
        if not is_compiling():
            self.job.optimizer_end()

    def _wrap_backward(self, original):
        job = self.job

        @functools.wraps(original)
        def backward(*args, **kwargs):
            if is_compiling():
                return original(*args, **kwargs)
            job.backward_begin()
            try:
                return original(*args, **kwargs)
            finally:
                job.backward_end()

        return backward

    def _wrap_ddp_init(self, original):
        @functools.wraps(original)
        def init(ddp, *args, **kwargs):
            original(ddp, *args, **kwargs)
            ddp._ranktrace_hooked = False
            handle = None

            def before_first_forward(module, inputs) -> None:
                if not module._ranktrace_hooked:
                    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                    _register_timed(module, module.process_group, default_hooks.allreduce_hook)
                handle.remove()

            handle = ddp.register_forward_pre_hook(before_first_forward)

        return init

    def _wrap_register(self, original):
        @functools.wraps(original)
        def register_comm_hook(ddp, state, hook):
            ddp._ranktrace_hooked = True
            return original(ddp, state, _marked(hook))

        return register_comm_hook


def _marked(hook):
    """`hook` with the calls it makes marked as DDP's (telemetry/job.py exposes their wait)."""

    @functools.wraps(hook)
    def marked(state, bucket):
        if is_compiling():
            return hook(state, bucket)
        _ddp_hook.active = True
        try:
            return hook(state, bucket)
        finally:
            _ddp_hook.active = False

    return marked


def _register_timed(ddp, state, hook) -> None:
    ddp._ranktrace_hooked = True
    type(ddp).register_comm_hook.__wrapped__(ddp, state, _marked(hook))
