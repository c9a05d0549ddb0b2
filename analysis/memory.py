"""Memory model: bytes per rank for parameters, gradients, optimizer state and activations of a
3D-parallel layout, compared with what the ranks measured.

Mixed-precision Adam (ZeRO paper, Rajbhandari et al. 2020) needs 16 B/parameter: 2 B compute
weights + 2 B gradients + 12 B fp32 master weights and two Adam moments. TP and PP divide the
parameters (norm weights stay replicated over tp); ZeRO-1 divides the 12 B over dp, ZeRO-2 also
the gradients. The reference trainer accumulates micro-batch gradients in one full buffer and
reduce-scatters it once per step, so under ZeRO-2 its gradient buffer stays whole:
`predict(..., grads_sharded=False)` models that; the planner uses the paper's figure.
Activations per micro-batch and layer: s·b·h·(34 + 5·a·s/h) bytes ÷ tp (Korthikanti et al. 2022,
16-bit activations without recomputation); 1F1B keeps min(pp - stage, M) micro-batches alive,
GPipe all M.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

MASTER_AND_ADAM_BYTES = 12  # fp32 master weights + first + second moments
COMPUTE_BYTES = {"bf16": 2, "fp32": 4}
STATE_TOLERANCE = 0.05
"""Predicted vs measured state bytes agree within 5% (buffers are padded to multiples of dp)."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs of a decoder (the trainer's ModelConfig fields)."""

    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    ffn_hidden: int

    @classmethod
    def of(cls, config: dict) -> ModelShape:
        """From a run.json's `model_config` (the trainer's ModelConfig, more fields than these)."""
        return cls(**{f.name: config[f.name] for f in fields(cls)})


@dataclass
class RankMemory:
    """Predicted (and, when known, measured) bytes of one rank."""

    rank: int | None
    stage: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    measured_state_bytes: int | None = None
    measured_rss_peak_bytes: int | None = None
    measured_uss_bytes: int | None = None

    @property
    def state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    def to_dict(self) -> dict:
        out = asdict(self)
        out["predicted_state_bytes"] = self.state_bytes
        out["predicted_total_bytes"] = self.total_bytes
        if self.measured_state_bytes:
            out["state_ratio"] = round(self.measured_state_bytes / self.state_bytes, 4)
        return out


def layer_params(model: ModelShape, tp: int = 1) -> int:
    """Parameters of one transformer block on one rank: its attention and MLP projections
    sharded over tp, its two norm weights whole."""
    h = model.hidden
    return (4 * h * h + 3 * h * model.ffn_hidden) // tp + 2 * h


def stage_params(model: ModelShape, layers: int, stage: int, n_stages: int, tp: int) -> int:
    """Parameters held by one rank of `stage` (with `layers` blocks) under tensor parallelism."""
    h, v = model.hidden, model.vocab_size
    params = layers * layer_params(model, tp)
    if stage == 0:
        params += v * h // tp  # vocab-parallel embedding
    if stage == n_stages - 1:
        params += v * h // tp + h  # LM head (column-parallel) and final norm
    return params


def activation_bytes_per_layer(model: ModelShape, micro_batch: int, seq_len: int, tp: int) -> int:
    """Korthikanti et al. 2022: s·b·h·(34 + 5·a·s/h) bytes, divided by tp."""
    s, b, h, a = seq_len, micro_batch, model.hidden, model.n_heads
    return int(s * b * h * (34 + 5 * a * s / h) / tp)


def predict(
    model: ModelShape,
    tp: int,
    pp: int,
    dp: int,
    zero: int,
    precision: str = "bf16",
    stage_layers: list[int] | None = None,
    micro_batch: int = 1,
    seq_len: int = 2048,
    micro_batches: int = 1,
    schedule: str = "1f1b",
    grads_sharded: bool = True,
) -> list[RankMemory]:
    """Predicted bytes of one rank per pipeline stage (every rank of a stage holds the same)."""
    split = stage_layers or [model.n_layers // pp] * pp
    element = COMPUTE_BYTES[precision]
    per_layer_activations = activation_bytes_per_layer(model, micro_batch, seq_len, tp)
    out = []
    for stage, layers in enumerate(split):
        params = stage_params(model, layers, stage, pp, tp)
        grads = params * element // (dp if zero >= 2 and grads_sharded else 1)
        optimizer = MASTER_AND_ADAM_BYTES * params // (dp if zero >= 1 else 1)
        live = micro_batches if schedule == "gpipe" else min(pp - stage, micro_batches)
        out.append(RankMemory(
            rank=None, stage=stage, params_bytes=params * element, grads_bytes=grads,
            optimizer_bytes=optimizer, activation_bytes=live * layers * per_layer_activations,
        ))  # fmt: skip
    return out
