"""Megatron-style tensor parallelism: the f/g autograd functions, column/row-parallel linears,
vocab-parallel embedding and cross-entropy, and the sequence-parallel variants.

Activations are [B, S, H] (batch, sequence, hidden). With sequence parallelism the activations
outside the TP regions are split along S, so norms and residuals run on S/tp tokens per rank.

Each sharded parameter carries `tp_dim` (the dimension split over tp, None if replicated) and
`tp_fused` (how many equal blocks are fused along that dimension, e.g. 3 for q|k|v), which is all
that `shard_full_tensor` / `unshard_tensors` need to move between the full and sharded forms.
A replicated parameter that only sees its rank's sequence slice carries `sequence_parallel=True`:
its gradient must be summed over tp before the optimizer step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ranktrace.trainer.comm import Comm
from ranktrace.trainer.cpu_bf16 import linear

SEQ_DIM = 1  # activations are [B, S, H]


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward (entry of a TP region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_reduce(grad.contiguous(), "tp"), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (exit of a TP region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return comm.all_reduce(x.contiguous(), "tp")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """SP entry: all-gather along S forward, reduce-scatter along S backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return comm.all_gather(x, "tp", dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.reduce_scatter(grad, "tp", dim=SEQ_DIM), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """SP exit: reduce-scatter along S forward, all-gather along S backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return comm.reduce_scatter(x, "tp", dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_gather(grad, "tp", dim=SEQ_DIM), None


def enter_tp_region(x: torch.Tensor, comm: Comm, sequence_parallel: bool) -> torch.Tensor:
    """Input of a column-parallel layer: full activation on every tp rank."""
    if comm.dims.tp == 1:
        return x
    if sequence_parallel:
        return _GatherFromSequence.apply(x, comm)
    return _CopyToTP.apply(x, comm)


def exit_tp_region(x: torch.Tensor, comm: Comm, sequence_parallel: bool) -> torch.Tensor:
    """Output of a row-parallel layer: sum the partial results (scattered along S with SP)."""
    if comm.dims.tp == 1:
        return x
    if sequence_parallel:
        return _ReduceScatterToSequence.apply(x, comm)
    return _ReduceFromTP.apply(x, comm)


def _mark(param: nn.Parameter, tp_dim: int | None, fused: int = 1) -> nn.Parameter:
    param.tp_dim = tp_dim
    param.tp_fused = fused
    return param


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ with W split by output rows: each tp rank produces out_features/tp outputs.

    `fused` blocks (e.g. q|k|v) are each split, so rank r holds block_i[r] for every block i.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Comm,
        fused: int = 1,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        tp = comm.dims.tp
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = _mark(nn.Parameter(torch.empty(out_features // tp, in_features)), 0, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_tp_region(x, self.comm, self.sequence_parallel)  # [B, S, in] full
        return linear(x, self.weight)  # [B, S, out/tp]


class RowParallelLinear(nn.Module):
    """y = x Wᵀ with W split by input columns: each rank holds a partial sum, reduced over tp."""

    def __init__(
        self, in_features: int, out_features: int, comm: Comm, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        tp = comm.dims.tp
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = _mark(nn.Parameter(torch.empty(out_features, in_features // tp)), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = linear(x, self.weight)  # [B, S, out] partial over tp
        return exit_tp_region(partial, self.comm, self.sequence_parallel)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; ids outside a rank's range contribute zeros."""

    def __init__(
        self, vocab_size: int, hidden: int, comm: Comm, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        tp, tp_rank = comm.dims.tp, comm.dims.coords.tp
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.rows = vocab_size // tp
        self.first_row = tp_rank * self.rows
        self.weight = _mark(nn.Parameter(torch.empty(self.rows, hidden)), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first_row  # [B, S]
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [B, S, H]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_tp_region(out, self.comm, self.sequence_parallel)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy when the logits' vocab dimension is split over tp."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, comm: Comm, first_row: int):
        # logits: [N, V/tp] (fp32), targets: [N] global ids
        logits_max = logits.max(dim=-1).values
        comm.all_reduce(logits_max, "tp", op=torch.distributed.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        local = targets - first_row
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        # One all-reduce carries both sums: [2, N].
        sums = comm.all_reduce(torch.stack([sum_exp, target_logit]), "tp")
        sum_exp, target_logit = sums[0], sums[1]
        loss = sum_exp.log() - target_logit  # [N]
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()  # d loss / d logits = softmax - one_hot(target)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= (~outside).to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, comm: Comm
) -> torch.Tensor:
    """Per-token loss [N] from vocab-sharded logits [N, V/tp] and global target ids [N]."""
    first_row = comm.dims.coords.tp * logits.shape[-1]
    if comm.dims.tp == 1:
        return F.cross_entropy(logits, targets, reduction="none")
    return _VocabParallelCrossEntropy.apply(logits, targets, comm, first_row)


def shard_full_tensor(full: torch.Tensor, tp_dim: int | None, fused: int, tp: int, rank: int):
    """This rank's shard of a full parameter (a view of `full` when no fused blocks)."""
    if tp_dim is None or tp == 1:
        return full
    blocks = full.chunk(fused, dim=tp_dim)
    return torch.cat([b.chunk(tp, dim=tp_dim)[rank] for b in blocks], dim=tp_dim)


def unshard_tensors(shards: list[torch.Tensor], tp_dim: int | None, fused: int) -> torch.Tensor:
    """Inverse of `shard_full_tensor`: the full parameter from every tp rank's shard, in order."""
    if tp_dim is None or len(shards) == 1:
        return shards[0]
    per_rank_blocks = [s.chunk(fused, dim=tp_dim) for s in shards]
    blocks = [
        torch.cat([rank_blocks[i] for rank_blocks in per_rank_blocks], dim=tp_dim)
        for i in range(fused)
    ]
    return torch.cat(blocks, dim=tp_dim)
