"""PyTorch's own FSDP2 (`fully_shard`) with torch.optim.AdamW, as an independent oracle for our
hand-written data parallelism with ZeRO: same model, data, schedule and clipping, 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from ranktrace.trainer.comm import Comm
from ranktrace.trainer.config import TrainConfig
from ranktrace.trainer.data import BatchSource
from ranktrace.trainer.mesh import ParallelDims
from ranktrace.trainer.model import StageModel, initialize
from ranktrace.trainer.optim import learning_rate
from tests.conftest import ranktrace
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)

LOSS_RTOL = 1e-5
CFG = TrainConfig(
    model="tiny",
    dp=2,
    zero=2,
    steps=4,
    global_batch=8,
    micro_batches=1,
    seq_len=32,
    precision="fp32",
)


def _fsdp2_losses(rank: int, world_size: int, cfg_dict: dict) -> list[float]:
    """Train with fully_shard over dp and return the global mean loss of every step."""
    cfg = TrainConfig(**cfg_dict)
    dims = ParallelDims(pp=1, dp=world_size, tp=1)
    mcfg = cfg.model_config
    model = StageModel(mcfg, Comm(dims), list(range(mcfg.n_layers)), cfg.seq_len)
    initialize(model, cfg.seed)
    for block in model.layers.values():
        fully_shard(block, mesh=dims.mesh["dp"])
    fully_shard(model, mesh=dims.mesh["dp"])
    named = list(model.named_parameters())
    groups = [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    data = BatchSource(cfg.data, cfg.seq_len, cfg.global_batch, mcfg.vocab_size, cfg.seed)
    losses = []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg.lr, cfg.resolved_warmup_steps(), cfg.steps)
        (tokens,) = data.micro_batches(step, rank, world_size, 1)  # [B/dp, S+1]
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world_size)
    return losses


def test_zero2_data_parallel_matches_pytorch_fsdp2(tmp_path):
    oracle = run_on_ranks(_fsdp2_losses, 2, CFG.to_dict())[0]
    result = ranktrace(
        "train",
        "--dp",
        "2",
        "--zero",
        "2",
        "--model",
        CFG.model,
        "--steps",
        str(CFG.steps),
        "--global-batch",
        "8",
        "--micro-batches",
        "1",
        "--seq-len",
        "32",
        "--precision",
        "fp32",
        runs_dir=tmp_path / "runs",
    )
    assert result.returncode == 0, result.stderr
    ours = result.run()["losses"]
    assert len(ours) == len(oracle) == CFG.steps
    for step, (got, want) in enumerate(zip(ours, oracle, strict=True)):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"step {step}: ours {got}, FSDP2 {want}"
    assert oracle[-1] < oracle[0]  # a real training signal, not a constant
