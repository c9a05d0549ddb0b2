"""Pipeline parallelism: point-to-point stage transfers and the GPipe and 1F1B schedules.

A schedule drives a `Stage` through every micro-batch of one step. Both schedules are plain
functions; each transfer is commented with who is on the other end. With pp=1 they reduce to
gradient accumulation over the micro-batches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from ranktrace.trainer.comm import Comm


class StageTransfers:
    """Sends and receives of one stage's activations (forward) and their gradients (backward).

    Every message has the shape of a stage boundary activation [b, S_local, H] and compute dtype;
    with variable-length batches S_local is the micro-batch's own, so the receives take the
    index of the micro-batch they bring (`shape_of(mb)`).
    """

    def __init__(
        self,
        comm: Comm,
        shape_of: Callable[[int], tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
        wait: Callable[[], AbstractContextManager] = nullcontext,
    ) -> None:
        """`wait()` wraps every transfer (telemetry times it as the pipeline-wait phase)."""
        dims = comm.dims
        self.comm, self.shape_of, self.dtype, self.device = comm, shape_of, dtype, device
        self.wait = wait
        self.first, self.last = dims.is_first_stage, dims.is_last_stage
        self.prev = None if self.first else dims.stage_peer(-1)
        self.next = None if self.last else dims.stage_peer(+1)

    def _empty(self, mb: int) -> torch.Tensor:
        return torch.empty(self.shape_of(mb), dtype=self.dtype, device=self.device)

    def _transfer(self, sends: list, recvs: list) -> None:
        with self.wait():
            self.comm.exchange(sends, recvs, "pp")

    def recv_forward(self, mb: int) -> torch.Tensor | None:
        if self.first:
            return None
        x = self._empty(mb)
        self._transfer([], [(x, self.prev)])  # activation from the previous stage
        return x.requires_grad_()

    def send_forward(self, y: torch.Tensor) -> None:
        if not self.last:
            self._transfer([(y.detach().contiguous(), self.next)], [])  # activation onwards

    def recv_backward(self, mb: int) -> torch.Tensor | None:
        if self.last:
            return None
        g = self._empty(mb)
        self._transfer([], [(g, self.next)])  # gradient of our output from the next stage
        return g

    def send_backward(self, grad_x: torch.Tensor | None) -> None:
        if not self.first:
            self._transfer([(grad_x.contiguous(), self.prev)], [])  # input gradient back

    def send_forward_recv_backward(self, y: torch.Tensor, mb: int) -> torch.Tensor | None:
        """Send micro-batch y onwards; receive the gradient of micro-batch `mb` (older)."""
        if self.last:
            return None
        g = self._empty(mb)
        # Activation to the next stage while its gradient for an older micro-batch comes back.
        self._transfer([(y.detach().contiguous(), self.next)], [(g, self.next)])
        return g

    def send_backward_recv_forward(self, grad_x: torch.Tensor | None,
                                   mb: int) -> torch.Tensor | None:  # fmt: skip
        """Send an input gradient back; receive micro-batch `mb`'s activation."""
        if self.first:
            return None
        x = self._empty(mb)
        # Input gradient to the previous stage while it hands us the next micro-batch.
        self._transfer([(grad_x.contiguous(), self.prev)], [(x, self.prev)])
        return x.requires_grad_()


ForwardStep = Callable[[int, torch.Tensor | None], torch.Tensor]
"""(micro-batch index, received activation or None on the first stage) -> output or loss."""
BackwardStep = Callable[[torch.Tensor | None, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""(received activation, output, gradient of output or None) -> gradient of the received input."""


def backward_step(
    received: torch.Tensor | None, output: torch.Tensor, output_grad: torch.Tensor | None
) -> torch.Tensor | None:
    """Backpropagate one micro-batch through this stage; returns the gradient of its input."""
    if output_grad is None:  # last stage: output is the (scaled) loss
        output.backward()
    else:
        torch.autograd.backward(output, output_grad)
    return None if received is None else received.grad


def gpipe(
    n_micro: int, forward_step: ForwardStep, backward: BackwardStep, io: StageTransfers
) -> None:
    """All forwards, then all backwards in reverse order (activations of every micro-batch live)."""
    stash = []
    for mb in range(n_micro):
        x = io.recv_forward(mb)
        y = forward_step(mb, x)
        io.send_forward(y)
        stash.append((mb, x, y))
    for mb, x, y in reversed(stash):
        grad_y = io.recv_backward(mb)
        io.send_backward(backward(x, y, grad_y))


def one_f_one_b(
    n_micro: int, forward_step: ForwardStep, backward: BackwardStep, io: StageTransfers
) -> None:
    """1F1B (PipeDream-Flush): warm-up forwards, steady one-forward-one-backward, cool-down.

    Stage s runs min(pp - s - 1, M) warm-up forwards, so at most pp - s micro-batches are live.
    """
    dims = io.comm.dims
    warmup = min(dims.pp - dims.coords.pp - 1, n_micro)
    steady = n_micro - warmup
    stash: deque = deque()
    for mb in range(warmup):
        x = io.recv_forward(mb)
        y = forward_step(mb, x)
        io.send_forward(y)
        stash.append((mb, x, y))
    x = io.recv_forward(warmup) if steady > 0 else None
    for i in range(steady):
        y = forward_step(warmup + i, x)
        grad_y = io.send_forward_recv_backward(y, i)  # the oldest live micro-batch is i
        stash.append((warmup + i, x, y))
        _, old_x, old_y = stash.popleft()
        grad_x = backward(old_x, old_y, grad_y)
        if i == steady - 1:
            io.send_backward(grad_x)
        else:
            x = io.send_backward_recv_forward(grad_x, warmup + i + 1)
    for _ in range(warmup):
        mb, old_x, old_y = stash.popleft()
        io.send_backward(backward(old_x, old_y, io.recv_backward(mb)))


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}
