"""bf16 matmuls on CPUs without native bf16 arithmetic.

A bf16 GEMM multiplies bf16 operands, accumulates in fp32 and rounds the result to bf16. On a
CPU with AVX-512 BF16 or AMX, torch runs that natively; on one with AVX2 only, its fallback was
measured here at 1.1 GFLOP/s against 60 for fp32 (a [4, 128, 256] x [1024, 256] linear,
forward and backward: 555 ms in bf16, 15 ms in fp32), which made a small-model step take
10 s. The same arithmetic runs at fp32 speed by upcasting the bf16 operands (exact), doing the
matmul in fp32 and rounding the result to bf16. The upcast is taken where the CPU has no bf16
instructions, read from its feature flags: the same answer in every process of a run. (It was
a timing once; on a CPU with AVX-512 BF16 the two paths ran so close that the answer flipped
from process to process, and a resumed attempt redid its steps on the other path, 2e-6 off
the first attempt's losses.) Where the flags cannot be read, it is measured.
"""

from __future__ import annotations

import functools
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_PROBE = 128  # [128, 128] @ [128, 128]: 4 MFLOP, ~4 ms on the slow path, ~0.1 ms in fp32
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}
"""CPU feature flags of native bf16 arithmetic (/proc/cpuinfo: x86 flags, Arm features)."""


def _cpu_flags() -> set[str] | None:
    """This CPU's feature flags (Linux), else None."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


@functools.cache
def upcast_is_faster() -> bool:
    """Whether this CPU has no native bf16 arithmetic (its flags; where they cannot be read,
    whether it multiplies bf16 matrices more slowly than fp32 ones, best of 3 each)."""
    flags = _cpu_flags()
    if flags is not None and platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        return not flags & NATIVE_BF16_FLAGS
    generator = torch.Generator().manual_seed(0)  # the job's random stream is left alone
    a32 = torch.randn(_PROBE, _PROBE, generator=generator)
    b32 = torch.randn(_PROBE, _PROBE, generator=generator)
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
