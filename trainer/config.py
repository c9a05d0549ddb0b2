"""Typed configuration for the trainer: named model sizes, the run's settings, and their validation.

Every check that can be made before a process is spawned lives in `TrainConfig.validate`, so that
`ranktrace train` fails with one readable line (exit code 2), not a traceback from inside a rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A setting that cannot work; the message names the value and the valid choices."""


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, untied embedding and head."""

    name: str
    vocab_size: int
    """Tokens in the vocabulary; the byte-level corpus uses ids 0..255."""
    hidden: int
    """Model width h (the residual stream)."""
    n_layers: int
    """Transformer blocks L."""
    n_heads: int
    """Attention heads; hidden / n_heads is the head dimension."""
    ffn_hidden: int
    """Inner width of the SwiGLU MLP (gate and up projections each have this many outputs)."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def n_params(self) -> int:
        """Exact parameter count of the model this config builds (embedding and head included)."""
        h, f = self.hidden, self.ffn_hidden
        per_layer = 4 * h * h + 3 * h * f + 2 * h  # q,k,v,o + gate,up,down + two RMSNorm weights
        return (
            self.n_layers * per_layer + 2 * self.vocab_size * h + h
        )  # + embedding, head, final norm

    def n_non_embedding_params(self) -> int:
        """Parameters that take part in the 6·N FLOPs estimate (embedding and head excluded)."""
        return self.n_params() - 2 * self.vocab_size * self.hidden


# `tiny` supports tp and pp in {1, 2, 4}; `small` is the demo model (~4.3M parameters);
# `1b` and `7b` are only ever used by the planner and the FLOP counter on this machine.
MODELS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("tiny", vocab_size=256, hidden=64, n_layers=4, n_heads=4, ffn_hidden=128),
    "small": ModelConfig(
        "small", vocab_size=256, hidden=256, n_layers=4, n_heads=8, ffn_hidden=768
    ),
    "1b": ModelConfig(
        "1b", vocab_size=32000, hidden=2048, n_layers=24, n_heads=16, ffn_hidden=5632
    ),
    "7b": ModelConfig(
        "7b", vocab_size=32000, hidden=4096, n_layers=32, n_heads=32, ffn_hidden=11008
    ),
}

PRECISIONS = ("bf16", "fp32")
ZERO_STAGES = (0, 1, 2)
SCHEDULES = ("1f1b", "gpipe")
RANK_ORDERS = ("tp-dp-pp", "dp-tp-pp", "tp-pp-dp", "pp-tp-dp", "dp-pp-tp", "pp-dp-tp")
"""Every order of the mesh axes, innermost (consecutive ranks) first (trainer/mesh.py)."""
DATASETS = ("text", "synthetic")
DEVICES = ("auto", "cpu", "cuda")
TELEMETRY_LEVELS = ("off", "steps", "collectives")


def divisors(n: int) -> list[int]:
    """All positive divisors of n, ascending (used to list valid parallel degrees in errors)."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class TrainConfig:
    """Everything one training run needs. Field defaults are the CLI defaults."""

    tp: int = 1
    """Tensor-parallel degree (innermost mesh dimension)."""
    pp: int = 1
    """Pipeline-parallel degree (number of stages)."""
    dp: int = 1
    """Data-parallel degree."""
    zero: int = 0
    """ZeRO stage: 0 replicates optimizer state, 1 shards it over dp, 2 also shards gradients."""
    model: str = "tiny"
    steps: int = 20
    global_batch: int = 8
    """Sequences per optimizer step, over all dp ranks and micro-batches."""
    micro_batches: int = 2
    """Micro-batches per step on each dp rank (gradient accumulation / pipeline micro-batches)."""
    seq_len: int = 64
    seq_len_dist: str = ""
    """Each micro-batch's sequence length drawn from this distribution, e.g. "uniform:16,64"
    (trainer/lengths.py); empty: every sequence is seq_len tokens."""
    length_buckets: int = 0
    """With seq_len_dist: the micro-batches the dp ranks run together come from one of N equal
    ranges of lengths (length-grouped batches); 0: placed as drawn."""
    precision: str = "bf16"
    seed: int = 1234
    lr: float = 3e-3
    """Peak learning rate (linear warm-up, cosine decay to 10%)."""
    warmup_steps: int = -1
    """Warm-up steps; -1 picks min(100, steps // 10)."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    """Clip gradients to this global L2 norm (over every group); 0 disables clipping."""
    schedule: str = "1f1b"
    rank_order: str = RANK_ORDERS[0]
    """Mesh axes from innermost (consecutive ranks, so one node) to outermost (trainer/mesh.py)."""
    sequence_parallel: bool = False
    data: str = "text"
    bucket_mb: float = 4.0
    """Gradient bucket size for the data-parallel all-reduce / reduce-scatter, in MiB."""
    device: str = "auto"
    runs_dir: str = "runs"
    run_name: str = ""
    run_id: str = ""
    """Chosen by the launcher; ranks under torchrun agree on one at start-up."""
    log_every: int = 0
    """Print a summary line every N steps; 0 picks about 20 lines per run."""
    save_weights: bool = False
    """Write the consolidated final weights and gradients to <run>/weights.pt."""
    nproc: int = 0
    """Processes to launch; 0 means tp*pp*dp. Any other value must equal tp*pp*dp."""
    telemetry: str = "collectives"
    """off: nothing; steps: step and phase records; collectives: also every collective."""
    trace_every: int = 1
    """Record collectives one by one on every Nth step (steps level on all the others)."""
    flush_every: int = 10
    """Write a telemetry segment every N steps..."""
    flush_seconds: float = 5.0
    """...or every T seconds, whichever comes first."""
    otlp_endpoint: str = ""
    """Also send spans to this OpenTelemetry collector (OTLP/HTTP, e.g. http://localhost:4318)."""
    peak_flops: float = 0.0
    """A rank's device peak FLOP/s for MFU; 0: the datasheet (GPU) or the host's stored peak
    (CPU, telemetry/peaks.py)."""
    inject: list[str] = field(default_factory=list)
    """Fault specs (trainer/faults.py), e.g. `compute:rank=1,factor=2`."""
    stage_layers: str = ""
    """Layers per pipeline stage, e.g. "3,1"; empty: an even split."""
    checkpoint_every: int = 0
    """Save a sharded checkpoint every N steps (0: not by step count)."""
    checkpoint_minutes: float = 0.0
    """...and/or once M minutes have passed since the last one (0: not by time)."""
    checkpoint_keep: int = 3
    """Complete checkpoints kept; older ones are deleted once a newer one is complete."""
    checkpoint_sync: bool = False
    """Save synchronously (training waits for the write); the default saves in the background."""
    resume: str = ""
    """Run id to continue from its latest complete checkpoint (`ranktrace train --resume`)."""
    max_restarts: int = 0
    """Restart the whole job up to N times when a rank dies; it resumes from a checkpoint."""
    collective_timeout: float = 0.0
    """Seconds a collective may wait before the job records every rank's state and exits."""
    attempt: int = 0
    """Launches of this run before this one (0: the first); set by the launcher on --resume."""
    extra: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def model_config(self) -> ModelConfig:
        return MODELS[self.model]

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch // (self.dp * self.micro_batches)

    def stage_split(self) -> list[int]:
        """Layers of each pipeline stage: `stage_layers`, or an even split."""
        if self.stage_layers:
            return [int(part) for part in self.stage_layers.split(",")]
        return [self.model_config.n_layers // self.pp] * self.pp

    def resolved_warmup_steps(self) -> int:
        return self.warmup_steps if self.warmup_steps >= 0 else min(100, self.steps // 10)

    def resolved_log_every(self) -> int:
        return self.log_every if self.log_every > 0 else max(1, self.steps // 20)

    def validate(self, world_size: int | None = None) -> None:
        """Raise ConfigError naming the first impossible setting and what would work instead."""
        if self.model not in MODELS:
            raise ConfigError(f"unknown model '{self.model}'; choose one of {sorted(MODELS)}")
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"--{name}={value} must be at least 1")
        if self.steps <= 0:
            raise ConfigError(f"--steps={self.steps} must be a positive number of steps")
        for name, value, choices in (
            ("precision", self.precision, PRECISIONS),
            ("zero", self.zero, ZERO_STAGES),
            ("schedule", self.schedule, SCHEDULES),
            ("rank_order", self.rank_order, RANK_ORDERS),
            ("data", self.data, DATASETS),
            ("device", self.device, DEVICES),
            ("telemetry", self.telemetry, TELEMETRY_LEVELS),
        ):
            if value not in choices:
                raise ConfigError(f"--{name}={value} is not valid; choose one of {list(choices)}")
        expected = world_size if world_size is not None else (self.nproc or self.world_size)
        if expected != self.world_size:
            raise ConfigError(
                f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.world_size} does not match "
                f"{expected} processes; choose degrees whose product is {expected}"
            )
        m = self.model_config
        for what, count in (
            ("n_heads", m.n_heads),
            ("hidden", m.hidden),
            ("ffn_hidden", m.ffn_hidden),
            ("vocab_size", m.vocab_size),
        ):
            if count % self.tp:
                valid = [d for d in divisors(m.n_heads) if m.hidden % d == 0]
                raise ConfigError(
                    f"tp={self.tp} does not divide {what}={count} of model '{m.name}'; "
                    f"choose tp in {valid}"
                )
        if self.stage_layers:
            self._validate_stage_layers()
        elif m.n_layers % self.pp:
            raise ConfigError(
                f"pp={self.pp} does not divide n_layers={m.n_layers} of model '{m.name}'; "
                f"choose pp in {divisors(m.n_layers)}"
            )
        if self.micro_batches < 1:
            raise ConfigError(f"--micro-batches={self.micro_batches} must be at least 1")
        per_step = self.dp * self.micro_batches
        if self.global_batch < 1 or self.global_batch % per_step:
            multiples = [per_step * k for k in (1, 2, 4, 8)]
            raise ConfigError(
                f"--global-batch={self.global_batch} is not divisible by dp*micro-batches = "
                f"{self.dp}*{self.micro_batches} = {per_step}; "
                f"choose a multiple such as {multiples}"
            )
        if self.seq_len < 2:
            raise ConfigError(f"--seq-len={self.seq_len} must be at least 2")
        if self.sequence_parallel and self.seq_len % self.tp:
            raise ConfigError(
                f"--seq-len={self.seq_len} is not divisible by tp={self.tp}, which sequence "
                f"parallelism needs; choose a multiple of {self.tp}"
            )
        self._validate_lengths()
        for name in ("trace_every", "flush_every"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag}={getattr(self, name)} must be at least 1")
        if self.flush_seconds <= 0:
            raise ConfigError(f"--flush-seconds={self.flush_seconds} must be positive")
        if self.peak_flops < 0:
            raise ConfigError(f"--peak-flops={self.peak_flops:g} must be positive (FLOP/s of "
                              "one rank's device, e.g. 9.89e14), or 0 to measure")  # fmt: skip
        for name in ("checkpoint_every", "max_restarts"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag}={getattr(self, name)} must be 0 (off) or more")
        for name in ("checkpoint_minutes", "collective_timeout"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag}={getattr(self, name)} must be 0 (off) or positive")
        if self.checkpoint_keep < 1:
            raise ConfigError(
                f"--checkpoint-keep={self.checkpoint_keep} must be at least 1 (the latest)"
            )
        if self.bucket_mb <= 0:
            raise ConfigError(f"--bucket-mb={self.bucket_mb} must be positive")
        from ranktrace.trainer.faults import (
            check_faults,
        )  # faults builds on this module's ConfigError

        faults = check_faults(self.inject, self.world_size, self.steps)
        hang = next((f for f in faults if f.kind == "hang"), None)
        if hang is not None and self.collective_timeout <= 0:
            raise ConfigError(
                f"--inject {hang.text} needs --collective-timeout SECONDS, or the job would wait "
                f"for gloo's own 30-minute timeout"
            )

    def _validate_lengths(self) -> None:
        from ranktrace.trainer.lengths import LengthDistribution  # builds on ConfigError here

        if self.length_buckets < 0:
            raise ConfigError(f"--length-buckets={self.length_buckets} must be 0 (off) or more")
        if not self.seq_len_dist:
            if self.length_buckets:
                raise ConfigError("--length-buckets groups lengths drawn by --seq-len-dist; "
                                  "give --seq-len-dist too (e.g. uniform:16,64)")  # fmt: skip
            return
        LengthDistribution.parse(self.seq_len_dist, self.seq_len)
        if self.sequence_parallel:
            raise ConfigError("--seq-len-dist with --sequence-parallel is not supported "
                              "(each length would have to divide by tp); drop one")  # fmt: skip

    def _validate_stage_layers(self) -> None:
        n_layers, text = self.model_config.n_layers, self.stage_layers
        try:
            split = [int(part) for part in text.split(",")]
        except ValueError:
            raise ConfigError(
                f"--stage-layers={text} is not a comma-separated list of layer counts (e.g. 3,1)"
            ) from None
        if len(split) != self.pp:
            raise ConfigError(
                f"--stage-layers={text} gives {len(split)} stages but pp={self.pp}; "
                f"give one layer count per stage"
            )
        if min(split) < 1 or sum(split) != n_layers:
            raise ConfigError(
                f"--stage-layers={text} must give every stage at least one layer and sum to "
                f"n_layers={n_layers} of model '{self.model}'"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
