"""bf16 matmuls on CPUs without native bf16 arithmetic.

A bf16 GEMM multiplies bf16 operands, accumulates in fp32 and rounds the result to bf16. On a
CPU with AVX-512 BF16 or AMX, torch runs that natively; on one with AVX2 only, its fallback was
measured here at 1.1 GFLOP/s against 60 for fp32 (a [4, 128, 256] x [1024, 256] linear,
forward and backward: 555 ms in bf16, 15 ms in fp32), which made a small-model step take
10 s. The same arithmetic runs at fp32 speed by upcasting the bf16 operands (exact), doing the
matmul in fp32 and rounding the result to bf16. Which path a rank takes is measured once, on
the rank's own CPU: the upcast only where native bf16 is the slower of the two.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

_PROBE = 128  # [128, 128] @ [128, 128]: 4 MFLOP, ~4 ms on the slow path, ~0.1 ms in fp32


@functools.cache
def upcast_is_faster() -> bool:
    """Whether this CPU multiplies bf16 matrices more slowly than fp32 ones (best of 3 each)."""
    a32, b32 = torch.randn(_PROBE, _PROBE), torch.randn(_PROBE, _PROBE)
    a16, b16 = a32.bfloat16(), b32.bfloat16()

    def best(a, b) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        return min(times)

    torch.mm(a16, b16), torch.mm(a32, b32)  # first calls pay for dispatch and allocation
    return best(a16, b16) > best(a32, b32)


def _upcast(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and upcast_is_faster()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight): in fp32 with a bf16 result where that is the faster bf16 GEMM."""
    if _upcast(x):
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal scaled dot-product attention, its matmuls as `linear`'s."""
    if _upcast(q):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(
            q.dtype
        )
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
