"""Model FLOPs per token, the numerator of MFU.

Training FLOPs per token ≈ 6·N + 12·L·h·s (PaLM, Chowdhery et al. 2022, appendix B): 6·N for the
forward (2·N) and backward (4·N) matrix multiplies over the N non-embedding parameters, plus the
attention score and value products (QKᵀ and AV), 2 matmuls × 2 FLOPs × s·h per layer forward,
tripled for the backward. MFU counts these model FLOPs only; activation recomputation is not
counted (that would be HFU).
"""

from __future__ import annotations


def training_flops_per_token(
    n_non_embedding_params: int, n_layers: int, hidden: int, seq_len: int
) -> float:
    """FLOPs of one training token (forward + backward) for a decoder of the given shape."""
    return 6.0 * n_non_embedding_params + 12.0 * n_layers * hidden * seq_len


# Peak dense bf16 FLOP/s from vendor datasheets (without sparsity), matched against
# torch.cuda.get_device_name(). Measured through PyTorch on an H200: ~790 T on an 8192³ matmul.
GPU_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
}


def gpu_peak_flops(device_name: str) -> float | None:
    """Datasheet peak bf16 FLOP/s of a GPU, or None when the table does not know it."""
    for key, peak in GPU_PEAK_BF16_FLOPS.items():
        if key in device_name:
            return peak
    return None


def measure_matmul_flops(dtype, size: int = 512, seconds: float = 0.2) -> float:
    """Achieved FLOP/s of repeated size³ matmuls on this process's CPU threads: the CPU
    denominator of MFU. Ranks that share cores calibrate at the same time, so each measures its
    own share of the machine. Draws from a generator of its own: the job's random stream (its
    data, its dropout) is left where it was."""
    import time

    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    a @ b  # warm-up
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        count += 1
    return 2.0 * size**3 * count / elapsed
