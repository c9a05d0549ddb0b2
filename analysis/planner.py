"""The layout planner behind `ranktrace plan`: every (tp, pp, dp, zero) of a model on a cluster
that fits in memory, ranked by an estimated step time, and why the others do not fit.

Memory: analysis/memory.py (the same model `ranktrace report` compares with measurements),
with ZeRO-2 sharding the gradients as in the paper, one sequence per micro-batch, 1F1B, and
HEADROOM of the device left for the framework, workspace and fragmentation.

Step time (a first-order model; its parts are printed, so it can be checked):
- compute: the step's model FLOPs (6·N + 12·L·h·s per token, PaLM appendix B) ÷ (devices ×
  peak × MATMUL_EFFICIENCY);
- pipeline bubble: compute × (pp − 1) / M for 1F1B with M micro-batches (Narayanan et al. 2021);
- TP: per layer and micro-batch, 4 all-reduces of the b·s·h activations (2 forward, 2
  backward), ring cost 2·(tp − 1)/tp × bytes over the intra-node bandwidth;
- DP: one gradient all-reduce (ZeRO-0/1) or reduce-scatter + all-gather (ZeRO-2, the same
  bytes) of each rank's 2-byte gradients, ring cost 2·(dp − 1)/dp × bytes, over the inter-node
  bandwidth when dp crosses nodes, not overlapped with compute (as in the reference trainer);
- PP: one b·s·h activation and one gradient per micro-batch and stage boundary.
TP stays within a node (tp ≤ devices per node): across nodes its per-layer all-reduces would
run on the slow links.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ranktrace.analysis.memory import MASTER_AND_ADAM_BYTES, ModelShape, layer_params, predict
from ranktrace.telemetry.flops import training_flops_per_token

HEADROOM = 0.10
"""Share of device memory a plan leaves free (CUDA context, NCCL buffers, fragmentation)."""
MATMUL_EFFICIENCY = 0.55
"""Share of the datasheet peak large bf16 matmuls reach (measured here on an H200: ~790 of
989 TFLOP/s on 8192³; a whole training step's kernels reach less)."""
BF16_BYTES = 2
GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """The hardware a plan is for."""

    devices: int
    memory_gb: float
    devices_per_node: int = 8
    peak_tflops: float = 989.0
    intra_node_gbps: float = 450.0
    """GB/s per device inside a node (NVLink 4: ~450 GB/s per direction)."""
    inter_node_gbps: float = 50.0
    """GB/s per device between nodes (one 400 Gb/s NIC per GPU)."""


@dataclass
class Plan:
    """One layout that fits, with its estimated step time and where the time goes."""

    tp: int
    pp: int
    dp: int
    zero: int
    micro_batches: int
    memory_gb: float
    """Peak per device: state + activations (the fullest pipeline stage)."""
    state_gb: float
    activation_gb: float
    compute_s: float
    bubble_s: float
    tp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    step_s: float
    mfu: float

    def to_dict(self) -> dict:
        return asdict(self)


class PlanError(ValueError):
    """The request itself cannot be planned (the message says why)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ring_factor(members: int) -> float:
    """The bytes a ring all-reduce moves per byte reduced: 2(n − 1)/n."""
    return 2.0 * (members - 1) / members


def _ring_s(nbytes: float, members: int, gbps: float) -> float:
    return ring_factor(members) * nbytes / (gbps * GB)


def estimate(
    model: ModelShape,
    cluster: Cluster,
    tp: int,
    pp: int,
    dp: int,
    zero: int,
    seq_len: int,
    global_batch: int,
) -> Plan:
    """Memory and step time of one layout (micro-batch size 1: M = global batch / dp)."""
    micro_batches = global_batch // dp
    stages = predict(model, tp, pp, dp, zero, "bf16", micro_batch=1, seq_len=seq_len,
                     micro_batches=micro_batches, schedule="1f1b", grads_sharded=True)  # fmt: skip
    fullest = max(stages, key=lambda s: s.total_bytes)
    h, layers = model.hidden, model.n_layers
    non_embedding = layers * layer_params(model)
    flops = global_batch * seq_len * training_flops_per_token(non_embedding, layers, h, seq_len)
    compute_s = flops / (cluster.devices * cluster.peak_tflops * 1e12 * MATMUL_EFFICIENCY)
    bubble_s = compute_s * (pp - 1) / micro_batches
    activation = seq_len * h * BF16_BYTES  # one sequence's b·s·h
    per_stage_layers = layers / pp
    tp_calls = 4 * per_stage_layers * micro_batches
    tp_comm_s = tp_calls * _ring_s(activation, tp, cluster.intra_node_gbps)
    grads = fullest.params_bytes  # 2-byte gradients of this rank's parameters
    dp_link = (
        cluster.intra_node_gbps if tp * dp <= cluster.devices_per_node else cluster.inter_node_gbps
    )
    dp_comm_s = _ring_s(grads, dp, dp_link)
    pp_link = (
        cluster.intra_node_gbps
        if tp * dp * pp <= cluster.devices_per_node
        else cluster.inter_node_gbps
    )
    pp_comm_s = 0.0 if pp == 1 else 2 * micro_batches * activation / tp / (pp_link * GB)
    step_s = compute_s + bubble_s + tp_comm_s + dp_comm_s + pp_comm_s
    return Plan(
        tp, pp, dp, zero, micro_batches, fullest.total_bytes / GB, fullest.state_bytes / GB,
        fullest.activation_bytes / GB, compute_s, bubble_s, tp_comm_s, dp_comm_s, pp_comm_s,
        step_s, compute_s * MATMUL_EFFICIENCY / step_s,
    )  # fmt: skip


def plan(
    model: ModelShape,
    n_params: int,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
) -> tuple[list[Plan], list[str]]:
    """(layouts that fit, fastest first; one line per kind of layout that does not fit)."""
    if cluster.devices < 1 or cluster.devices_per_node < 1:
        raise PlanError("--gpus and --gpus-per-node must be at least 1")
    if cluster.devices % cluster.devices_per_node and cluster.devices > cluster.devices_per_node:
        raise PlanError(
            f"--gpus {cluster.devices} is not a whole number of nodes of "
            f"{cluster.devices_per_node}; give a multiple of --gpus-per-node"
        )
    usable = cluster.memory_gb * (1 - HEADROOM)
    fits: list[Plan] = []
    too_big: list[Plan] = []
    reasons: list[str] = []
    state_per_param = BF16_BYTES * 2 + MASTER_AND_ADAM_BYTES
    replicated = n_params * state_per_param / GB
    if replicated > usable:
        reasons.append(
            f"{n_params / 1e9:.1f}B params × {state_per_param} B/param = {replicated:.0f} GB > "
            f"{cluster.memory_gb:g} GB per device: data parallelism alone cannot fit this "
            f"model; shard with ZeRO/TP/PP"
        )
    for tp in _divisors(min(cluster.devices, cluster.devices_per_node)):
        if model.n_heads % tp or model.hidden % tp or model.ffn_hidden % tp:
            continue
        for pp in _divisors(model.n_layers):
            if cluster.devices % (tp * pp):
                continue
            dp = cluster.devices // (tp * pp)
            if global_batch % dp:
                continue
            for zero in (0, 1, 2):
                if zero and dp == 1:
                    continue
                candidate = estimate(model, cluster, tp, pp, dp, zero, seq_len, global_batch)
                (fits if candidate.memory_gb <= usable else too_big).append(candidate)
    fits.sort(key=lambda p: (p.step_s, p.memory_gb))
    if too_big:
        leanest = min(too_big, key=lambda p: p.memory_gb)
        reasons.append(
            f"{len(too_big)} layouts need more than {usable:.0f} GB per device "
            f"({cluster.memory_gb:g} GB less {HEADROOM:.0%} headroom); the leanest of them, "
            f"tp={leanest.tp} pp={leanest.pp} dp={leanest.dp} zero={leanest.zero}, needs "
            f"{leanest.memory_gb:.0f} GB ({leanest.state_gb:.0f} GB state + "
            f"{leanest.activation_gb:.0f} GB activations)"
        )
    if cluster.devices > cluster.devices_per_node:
        reasons.append(
            f"tp > {cluster.devices_per_node} is not considered: TP's per-layer all-reduces "
            f"must stay on a node's fast links (put TP innermost)"
        )
    if not fits and not too_big:
        reasons.append(
            f"no (tp, pp, dp) of {cluster.devices} devices suits this model and batch: tp must "
            f"divide n_heads={model.n_heads} (and stay within a node), pp must divide "
            f"n_layers={model.n_layers}, dp must divide the global batch of {global_batch}"
        )
    elif not fits:
        reasons.append(
            f"no layout of {cluster.devices} devices fits in {usable:.0f} GB "
            f"({cluster.memory_gb:g} GB less {HEADROOM:.0%} headroom); add devices, memory, or "
            f"shorten --seq-len"
        )
    return fits, reasons
