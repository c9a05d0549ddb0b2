"""AdamW over the flat slice of parameters a rank owns, with fp32 master weights and moments,
global-norm gradient clipping across every parallel group, and the learning-rate schedule.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments), written on
one flat fp32 tensor so ZeRO sharding is a matter of which slice a rank owns.
"""

from __future__ import annotations

import math

import torch

from ranktrace.trainer.comm import Comm
from ranktrace.trainer.parallel.data import DataParallelBuffers


def learning_rate(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 10% of `peak` at `total`."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


class ShardedAdamW:
    """AdamW on `buffers`' owned elements; every rank calls `step` (it contains collectives)."""

    def __init__(
        self,
        buffers: DataParallelBuffers,
        comm: Comm,
        weight_decay: float,
        grad_clip: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        self.buffers, self.comm = buffers, comm
        self.weight_decay, self.grad_clip = weight_decay, grad_clip
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.master = buffers.initial_master  # fp32 [owned]
        buffers.initial_master = None
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.steps_taken = 0
        # Matrices decay, norm weights do not.
        self.decay_mask = buffers.element_mask(lambda slot: slot.param.dim() >= 2)
        # A parameter replicated over tp is counted once (on tp rank 0) in the global norm.
        tp_rank = comm.dims.coords.tp
        self.norm_mask = buffers.element_mask(
            lambda slot: slot.param.tp_dim is not None or tp_rank == 0
        )

    def global_grad_norm(self, grads: torch.Tensor) -> float:
        """L2 norm of the full model's gradient, from each rank's owned fp32 slice."""
        sum_sq = (grads * self.norm_mask).pow(2).sum().reshape(1)
        self.comm.all_reduce(sum_sq, "world")
        if self.buffers.zero == 0:
            sum_sq /= self.comm.dims.dp  # every dp replica owns (and counted) everything
        return math.sqrt(sum_sq.item())

    @torch.no_grad()
    def step(self, grads: torch.Tensor, lr: float) -> float:
        """Clip, update the master weights, write them back to the model; returns the grad norm."""
        norm = self.global_grad_norm(grads)
        clip_coef = self.grad_clip / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        if self.grad_clip > 0 and clip_coef < 1.0:
            grads = grads * clip_coef
        self.steps_taken += 1
        t = self.steps_taken
        self.master.mul_(1.0 - lr * self.weight_decay * self.decay_mask)
        self.exp_avg.lerp_(grads, 1.0 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(grads, grads, value=1.0 - self.beta2)
        bias1, bias2 = 1.0 - self.beta1**t, 1.0 - self.beta2**t
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(self.eps)
        self.master.addcdiv_(self.exp_avg, denom, value=-lr / bias1)
        self.buffers.write_params(self.master)
        return norm
