"""The decoder (RMSNorm, rotary attention, SwiGLU MLP) as one pipeline stage's slice of layers.

Parameter names are layout independent (`layers.<global index>.attn.qkv.weight`), and every
parameter is initialised from (seed, name) on its full shape before being sharded, so any
(tp, pp, dp) layout starts from exactly the weights of the single-process model.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from ranktrace.trainer.comm import Comm
from ranktrace.trainer.config import ModelConfig
from ranktrace.trainer.cpu_bf16 import causal_attention
from ranktrace.trainer.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_full_tensor,
    vocab_parallel_cross_entropy,
)

INIT_STD = 0.02


class RMSNorm(nn.Module):
    """x / rms(x) · w, computed in fp32. The weight is replicated over tp."""

    def __init__(self, hidden: int, eps: float, sequence_parallel: bool) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))
        self.weight.tp_dim, self.weight.tp_fused = None, 1
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [S, head_dim/2] for rotary position embedding (Su et al. 2021)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x [B, heads, S, d] by the position angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return rotated.to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head attention; heads are split over tp (q|k|v fused column-parallel)."""

    def __init__(self, cfg: ModelConfig, comm: Comm, sequence_parallel: bool) -> None:
        super().__init__()
        self.local_heads = cfg.n_heads // comm.dims.tp
        self.head_dim = cfg.head_dim
        self.qkv = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, comm, 3, sequence_parallel)
        self.out = RowParallelLinear(cfg.hidden, cfg.hidden, comm, sequence_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [B, S, 3 * heads/tp * d]
        B, S, _ = qkv.shape  # batch, full sequence
        q, k, v = qkv.view(B, S, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos[:S], sin[:S]), apply_rotary(k, cos[:S], sin[:S])
        y = causal_attention(q, k, v)  # [B, heads/tp, S, d]
        y = y.transpose(1, 2).reshape(B, S, self.local_heads * self.head_dim)
        return self.out(y)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)); gate|up fused column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, comm: Comm, sequence_parallel: bool) -> None:
        super().__init__()
        self.gate_up = ColumnParallelLinear(
            cfg.hidden, 2 * cfg.ffn_hidden, comm, 2, sequence_parallel
        )
        self.down = RowParallelLinear(cfg.ffn_hidden, cfg.hidden, comm, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # each [B, S, ffn/tp]
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig, comm: Comm, sequence_parallel: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, sequence_parallel)
        self.attn = Attention(cfg, comm, sequence_parallel)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, sequence_parallel)
        self.mlp = SwiGLU(cfg, comm, sequence_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class StageModel(nn.Module):
    """Layers [first_layer, first_layer + n) of the decoder, plus the embedding on the first stage
    and the final norm, LM head and loss on the last stage.

    forward: first stage takes token ids [B, S]; others take hidden states [B, S_local, H].
    The last stage returns the mean token loss; others return hidden states [B, S_local, H]
    (S_local = S / tp with sequence parallelism, else S).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        comm: Comm,
        layer_ids: list[int],
        seq_len: int,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        dims = comm.dims
        self.cfg, self.comm, self.sequence_parallel = cfg, comm, sequence_parallel
        self.is_first, self.is_last = dims.is_first_stage, dims.is_last_stage
        if self.is_first:
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, comm, sequence_parallel)
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, comm, sequence_parallel) for i in layer_ids}
        )
        if self.is_last:
            self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps, sequence_parallel)
            self.head = ColumnParallelLinear(cfg.hidden, cfg.vocab_size, comm, 1, sequence_parallel)
        cos, sin = rotary_tables(seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            x = self.embed(x)  # [B, S_local, H]
        cos = self.rope_cos.to(x.dtype)
        sin = self.rope_sin.to(x.dtype)
        for block in self.layers.values():
            x = block(x, cos, sin)
        if not self.is_last:
            return x
        logits = self.head(self.final_norm(x))  # [B, S, V/tp]
        per_token = vocab_parallel_cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), self.comm
        )
        return per_token.mean()


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def full_initial_value(name: str, full_shape: tuple[int, ...], n_layers: int, seed: int):
    """The fp32 initial value of a full (unsharded) parameter: a function of (seed, name) only.

    Normal(0, 0.02), output projections scaled by 1/sqrt(2L) (GPT-2), norm weights one.
    """
    if name.endswith("norm.weight"):
        return torch.ones(full_shape)
    std = INIT_STD
    if name.endswith(("attn.out.weight", "mlp.down.weight")):
        std /= math.sqrt(2 * n_layers)
    generator = torch.Generator().manual_seed(_param_seed(seed, name))
    return torch.randn(full_shape, generator=generator) * std


def full_shape_of(param: nn.Parameter, tp: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if param.tp_dim is not None:
        shape[param.tp_dim] *= tp
    return tuple(shape)


@torch.no_grad()
def initialize(model: StageModel, seed: int) -> None:
    """Fill every parameter with its shard of the layout-independent full initial value."""
    dims = model.comm.dims
    for name, param in model.named_parameters():
        full = full_initial_value(name, full_shape_of(param, dims.tp), model.cfg.n_layers, seed)
        param.copy_(shard_full_tensor(full, param.tp_dim, param.tp_fused, dims.tp, dims.coords.tp))


def stage_layer_ids(split: list[int], stage: int) -> list[int]:
    """Global indices of the layers on `stage`, given the layer count of every stage."""
    first = sum(split[:stage])
    return list(range(first, first + split[stage]))
