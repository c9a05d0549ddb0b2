"""bf16 matmuls on CPUs without native bf16 arithmetic (trainer/cpu_bf16.py): the upcast path is
the arithmetic of a bf16 GEMM (bf16 operands, fp32 accumulation, a bf16 result), whichever path
this CPU takes, and its gradients are bf16 like the parameters'."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ranktrace.trainer import cpu_bf16


def _operands():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 64, generator=generator).bfloat16().requires_grad_()
    w = torch.randn(32, 64, generator=generator).bfloat16().requires_grad_()
    return x, w


def test_linear_is_the_bf16_gemm_and_keeps_bf16_gradients():
    x, w = _operands()
    y = cpu_bf16.linear(x, w)
    exact = (x.double() @ w.double().T).bfloat16()  # products exact, one rounding at the end
    native = F.linear(x, w)
    assert y.dtype == torch.bfloat16
    # within one bf16 rounding (2^-8 relative) of the exactly rounded product, as native is
    scale = exact.double().abs().clamp(min=1.0)
    assert ((y.double() - exact.double()).abs() / scale).max() <= 2**-7
    assert ((native.double() - exact.double()).abs() / scale).max() <= 2**-7
    y.sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16


def test_attention_matches_native_bf16_attention():
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=generator).bfloat16() for _ in range(3))
    ours = cpu_bf16.causal_attention(q, k, v)
    native = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, native, atol=2e-2, rtol=2e-2)


def test_the_path_is_measured_once_per_process():
    first = cpu_bf16.upcast_is_faster()
    assert cpu_bf16.upcast_is_faster() is first
    assert cpu_bf16.upcast_is_faster.cache_info().misses == 1
