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
