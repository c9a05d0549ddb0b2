"""The `train` command's arguments, shared by `ranktrace train` and `python -m ranktrace.trainer`
(the per-rank entry point under torchrun)."""

from __future__ import annotations

import argparse

from ranktrace.trainer.config import (
    DATASETS,
    DEVICES,
    MODELS,
    PRECISIONS,
    RANK_ORDERS,
    SCHEDULES,
    TELEMETRY_LEVELS,
    ZERO_STAGES,
    TrainConfig,
)

_DEFAULTS = TrainConfig()


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every training option; defaults come from `TrainConfig` (shown by --help)."""
    d = _DEFAULTS
    layout = parser.add_argument_group("layout")
    layout.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel degree")
    layout.add_argument("--pp", type=int, default=d.pp, help="pipeline-parallel degree (stages)")
    layout.add_argument("--dp", type=int, default=d.dp, help="data-parallel degree")
    layout.add_argument(
        "--zero",
        type=int,
        default=d.zero,
        choices=ZERO_STAGES,
        help="ZeRO stage: 1 shards optimizer state over dp, 2 also gradients",
    )
    layout.add_argument(
        "--micro-batches",
        type=int,
        default=d.micro_batches,
        help="micro-batches per step on each dp rank",
    )
    layout.add_argument(
        "--schedule", default=d.schedule, choices=SCHEDULES, help="pipeline schedule"
    )
    layout.add_argument(
        "--rank-order",
        default=d.rank_order,
        choices=RANK_ORDERS,
        help="mesh axes from innermost (consecutive ranks: one node under torchrun) outward",
    )
    layout.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="shard norm/residual activations along the sequence over tp",
    )
    layout.add_argument(
        "--stage-layers",
        default=d.stage_layers,
        metavar="N,N,...",
        help="layers per pipeline stage, e.g. 3,1 (default: an even split)",
    )
    layout.add_argument(
        "--nproc",
        type=int,
        default=d.nproc,
        help="processes to launch (default: tp*pp*dp); must equal tp*pp*dp",
    )
    run = parser.add_argument_group("training")
    run.add_argument("--model", default=d.model, choices=sorted(MODELS), help="model size")
    run.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    run.add_argument(
        "--global-batch",
        type=int,
        default=d.global_batch,
        help="sequences per step over all dp ranks",
    )
    run.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    run.add_argument(
        "--seq-len-dist",
        default=d.seq_len_dist,
        metavar="uniform:MIN,MAX",
        help="variable-length batches: each micro-batch's sequence length drawn from this "
        "(no padding, no packing); default: every sequence --seq-len tokens",
    )
    run.add_argument(
        "--length-buckets",
        type=int,
        default=d.length_buckets,
        metavar="N",
        help="with --seq-len-dist: the micro-batches the dp ranks run together come from one "
        "of N equal ranges of lengths (length-grouped batches); 0: off",
    )
    run.add_argument(
        "--precision",
        default=d.precision,
        choices=PRECISIONS,
        help="bf16: bf16 compute with fp32 master weights and AdamW state",
    )
    run.add_argument("--seed", type=int, default=d.seed, help="seed of weights and data order")
    run.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    run.add_argument(
        "--warmup-steps",
        type=int,
        default=d.warmup_steps,
        help="linear warm-up steps (-1: min(100, steps/10))",
    )
    run.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW decay")
    run.add_argument(
        "--grad-clip",
        type=float,
        default=d.grad_clip,
        help="clip to this global gradient norm (0: off)",
    )
    run.add_argument(
        "--data",
        default=d.data,
        choices=DATASETS,
        help="text: bytes of the Python standard library; synthetic: random tokens",
    )
    run.add_argument(
        "--bucket-mb",
        type=float,
        default=d.bucket_mb,
        help="gradient bucket size for dp communication, MiB",
    )
    run.add_argument("--device", default=d.device, choices=DEVICES, help="where ranks compute")
    tel = parser.add_argument_group("telemetry")
    tel.add_argument(
        "--telemetry",
        default=d.telemetry,
        choices=TELEMETRY_LEVELS,
        help="off; steps (step and phase records); collectives (also each collective)",
    )
    tel.add_argument(
        "--trace-every",
        type=int,
        default=d.trace_every,
        help="record collectives one by one on every Nth step",
    )
    tel.add_argument(
        "--flush-every",
        type=int,
        default=d.flush_every,
        help="write a telemetry segment every N steps",
    )
    tel.add_argument(
        "--flush-seconds",
        type=float,
        default=d.flush_seconds,
        help="... or every T seconds, whichever comes first",
    )
    tel.add_argument(
        "--peak-flops",
        type=float,
        default=d.peak_flops,
        metavar="FLOPS",
        help="peak FLOP/s of one rank's device, for MFU (default: the GPU's datasheet figure, "
        "or the host's peak measured once and stored in the runs dir's peaks.json)",
    )
    tel.add_argument(
        "--otlp-endpoint",
        default=d.otlp_endpoint,
        help="also send spans to an OpenTelemetry collector (OTLP/HTTP base URL)",
    )
    faults = parser.add_argument_group("fault injection")
    faults.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="make a rank slow or crash (repeatable): compute:rank=R,factor=F[,from=S][,to=E] | "
        "link:rank=R,delay=SECONDS[,axis=tp|pp|dp|world] | data:rank=R,delay=SECONDS | "
        "pause:rank=R,every=K,duration=SECONDS | crash:rank=R,step=S | hang:rank=R,step=S | "
        "io:rank=R,delay=SECONDS",
    )
    ft = parser.add_argument_group("fault tolerance")
    ft.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        metavar="N",
        help="save a sharded checkpoint every N steps (0: off)",
    )
    ft.add_argument(
        "--checkpoint-minutes",
        type=float,
        default=d.checkpoint_minutes,
        metavar="M",
        help="save a checkpoint once M minutes passed since the last (0: off)",
    )
    ft.add_argument(
        "--checkpoint-keep",
        type=int,
        default=d.checkpoint_keep,
        metavar="K",
        help="keep the last K complete checkpoints",
    )
    ft.add_argument(
        "--checkpoint-sync",
        action="store_true",
        help="save synchronously (default: in the background while training goes on)",
    )
    ft.add_argument(
        "--resume",
        default=d.resume,
        metavar="RUN",
        help="continue run RUN from its latest complete checkpoint, appending to its telemetry",
    )
    ft.add_argument(
        "--max-restarts",
        type=int,
        default=d.max_restarts,
        metavar="N",
        help="restart the job up to N times when a rank dies; it resumes from a checkpoint",
    )
    ft.add_argument(
        "--collective-timeout",
        type=float,
        default=d.collective_timeout,
        metavar="SECONDS",
        help="a collective waiting longer is an alert: every rank records its state, the job "
        "exits non-zero (0: off)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--runs-dir", default=d.runs_dir, help="directory holding one folder per run")
    out.add_argument("--run-name", default=d.run_name, help="human name of the run (default: id)")
    out.add_argument("--run-id", default=d.run_id, help=argparse.SUPPRESS)
    out.add_argument(
        "--log-every",
        type=int,
        default=d.log_every,
        help="print a line every N steps (0: about 20 lines)",
    )
    out.add_argument(
        "--save-weights",
        action="store_true",
        help="write consolidated final weights and gradients to <run>/weights.pt",
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig named by parsed arguments (unvalidated)."""
    fields = TrainConfig.__dataclass_fields__
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
