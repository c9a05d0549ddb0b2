"""Each tensor-parallel layer, on real gloo ranks, against the unsharded PyTorch computation:
forward outputs and gradients of inputs and weights, with and without sequence parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ranktrace.trainer.comm import Comm
from ranktrace.trainer.mesh import ParallelDims
from ranktrace.trainer.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_full_tensor,
    unshard_tensors,
    vocab_parallel_cross_entropy,
)
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)

TOL = 1e-5  # fp32; only the summation order differs from the reference
B, S, H, OUT, V = 2, 8, 16, 12, 32  # batch, sequence, hidden, output features, vocab


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _seq(t: torch.Tensor, tp: int, rank: int, sp: bool) -> torch.Tensor:
    """This rank's sequence slice of [B, S, ...] under SP, else the whole tensor."""
    return t.chunk(tp, dim=1)[rank] if sp else t


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _column(comm: Comm, sp: bool) -> dict:
    tp, rank = comm.dims.tp, comm.dims.coords.tp
    w_full, x_full = _leaf(torch.randn(3 * OUT, H)), _leaf(torch.randn(B, S, H))
    upstream = torch.randn(B, S, 3 * OUT)  # dL/dy of the full output
    y_ref = F.linear(x_full, w_full)
    (y_ref * upstream).sum().backward()

    layer = ColumnParallelLinear(H, 3 * OUT, comm, fused=3, sequence_parallel=sp)
    layer.weight.data.copy_(shard_full_tensor(w_full.detach(), 0, 3, tp, rank))
    x = _leaf(_seq(x_full, tp, rank, sp))
    y = layer(x)  # [B, S, 3*OUT/tp]
    (y * shard_full_tensor(upstream, 2, 3, tp, rank)).sum().backward()
    return {
        "out": _diff(y, shard_full_tensor(y_ref.detach(), 2, 3, tp, rank)),
        "x_grad": _diff(x.grad, _seq(x_full.grad, tp, rank, sp)),
        "w_grad": _diff(layer.weight.grad, shard_full_tensor(w_full.grad, 0, 3, tp, rank)),
    }


def _row(comm: Comm, sp: bool) -> dict:
    tp, rank = comm.dims.tp, comm.dims.coords.tp
    w_full, x_full = _leaf(torch.randn(OUT, H)), _leaf(torch.randn(B, S, H))
    upstream = torch.randn(B, S, OUT)
    y_ref = F.linear(x_full, w_full)
    (y_ref * upstream).sum().backward()

    layer = RowParallelLinear(H, OUT, comm, sequence_parallel=sp)
    layer.weight.data.copy_(shard_full_tensor(w_full.detach(), 1, 1, tp, rank))
    x = _leaf(shard_full_tensor(x_full.detach(), 2, 1, tp, rank))  # input features split
    y = layer(x)  # [B, S(/tp with SP), OUT], reduced over tp
    (y * _seq(upstream, tp, rank, sp)).sum().backward()
    return {
        "out": _diff(y, _seq(y_ref.detach(), tp, rank, sp)),
        "x_grad": _diff(x.grad, shard_full_tensor(x_full.grad, 2, 1, tp, rank)),
        "w_grad": _diff(layer.weight.grad, shard_full_tensor(w_full.grad, 1, 1, tp, rank)),
    }


def _embedding(comm: Comm, sp: bool) -> dict:
    tp, rank = comm.dims.tp, comm.dims.coords.tp
    table = _leaf(torch.randn(V, H))
    ids = torch.randint(0, V, (B, S))
    upstream = torch.randn(B, S, H)
    y_ref = F.embedding(ids, table)
    (y_ref * upstream).sum().backward()

    layer = VocabParallelEmbedding(V, H, comm, sequence_parallel=sp)
    layer.weight.data.copy_(shard_full_tensor(table.detach(), 0, 1, tp, rank))
    y = layer(ids)
    (y * _seq(upstream, tp, rank, sp)).sum().backward()
    return {
        "out": _diff(y, _seq(y_ref.detach(), tp, rank, sp)),
        "w_grad": _diff(layer.weight.grad, shard_full_tensor(table.grad, 0, 1, tp, rank)),
    }


def _cross_entropy(comm: Comm) -> dict:
    tp, rank = comm.dims.tp, comm.dims.coords.tp
    logits_full = _leaf(torch.randn(B * S, V) * 3)
    targets = torch.randint(0, V, (B * S,))
    upstream = torch.rand(B * S)
    loss_ref = F.cross_entropy(logits_full, targets, reduction="none")
    (loss_ref * upstream).sum().backward()

    logits = _leaf(shard_full_tensor(logits_full.detach(), 1, 1, tp, rank))
    loss = vocab_parallel_cross_entropy(logits, targets, comm)
    (loss * upstream).sum().backward()
    return {
        "loss": _diff(loss, loss_ref.detach()),
        "logits_grad": _diff(logits.grad, shard_full_tensor(logits_full.grad, 1, 1, tp, rank)),
    }


def _all_layer_cases(rank: int, world_size: int) -> dict:
    dims = ParallelDims(pp=1, dp=1, tp=world_size)
    comm = Comm(dims)
    diffs = {}
    for sp in (False, True):
        torch.manual_seed(1)  # every rank builds the same full tensors
        for name, case in (("column", _column), ("row", _row), ("embedding", _embedding)):
            for what, value in case(comm, sp).items():
                diffs[f"{name}{'_sp' if sp else ''}.{what}"] = value
    for what, value in _cross_entropy(comm).items():
        diffs[f"cross_entropy.{what}"] = value
    return diffs


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def layer_diffs(request) -> dict:
    """Worst difference over ranks, per case and quantity."""
    per_rank = run_on_ranks(_all_layer_cases, request.param)
    return {key: max(r[key] for r in per_rank) for key in per_rank[0]}


@pytest.mark.parametrize("layer", ["column", "column_sp", "row", "row_sp"])
def test_parallel_linear_matches_unsharded_output_and_grads(layer_diffs, layer):
    for what in ("out", "x_grad", "w_grad"):
        assert layer_diffs[f"{layer}.{what}"] < TOL, (layer, what, layer_diffs)


@pytest.mark.parametrize("layer", ["embedding", "embedding_sp"])
def test_vocab_parallel_embedding_matches_unsharded(layer_diffs, layer):
    assert layer_diffs[f"{layer}.out"] < TOL
    assert layer_diffs[f"{layer}.w_grad"] < TOL


def test_vocab_parallel_cross_entropy_matches_unsharded_loss_and_grad(layer_diffs):
    assert layer_diffs["cross_entropy.loss"] < TOL
    assert layer_diffs["cross_entropy.logits_grad"] < TOL


@pytest.mark.parametrize("fused", [1, 2, 3])
def test_shard_then_unshard_restores_the_full_tensor(fused):
    full = torch.arange(4 * 6 * fused, dtype=torch.float32).reshape(6 * fused, 4)
    for dim in (0, 1) if fused == 1 else (0,):
        shards = [shard_full_tensor(full, dim, fused, 2, r) for r in range(2)]
        assert torch.equal(unshard_tensors(shards, dim, fused), full)
