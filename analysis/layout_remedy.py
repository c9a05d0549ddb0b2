"""A layout far below what its devices could do: the one-axis change to make, with its predicted
step and MFU.

The planner's first-order model (analysis/planner.py) prices each part of a step from the
layout, but its absolute figures are a datasheet's. Here each part is the run's own measured
part (the median over its ranks and steps after the warm-up step) times the model's ratio, the
new layout's over the run's:
- compute (forward and backward, less their tp communication): the step's work over the
  devices, the same in every layout of the same devices (tp's smaller matmuls run less
  efficiently: not modelled);
- optimizer (the rest of the rank's own work): the rank's parameters, ÷ dp under ZeRO ≥ 1;
- pipeline wait (the bubble and the pipeline's transfers): ∝ (pp − 1) / M, M the micro-batches;
- tp communication: 4 all-reduces a layer of the stage and micro-batch, of the micro-batch's
  activations, ring 2(tp − 1)/tp: ∝ layers/pp × sequences per rank × 2(tp − 1)/tp;
- dp communication: the rank's gradients ring-reduced: ∝ parameters × 2(dp − 1)/dp;
- data, host and world communication: as measured.
A part the run does not have (tp communication at tp 1, dp at dp 1) is priced from the model's
bytes at the seconds per ring byte the run's own transfers show; a bubble at pp 1 from its
compute. The parameters are the fullest stage's (analysis/memory.py).

Candidates: the layouts of the same devices one axis away: tp or pp doubled or halved, dp
taking up the devices, the micro-batches kept; each valid for the model and batch. Offered only
on a run with no straggler or imbalance (their waits would be priced as the layout's), when the
fastest layout of these devices by the same model is FAR_BELOW_PCT or more faster than the run,
and the best one-axis step toward it gains MIN_COST_PCT.

Measured with `ranktrace remedy --apply` (A B A B, this 2-core machine): the demo's tp 2 pp 2
dp 2 `small` run, remedy tp 1 dp 4: predicted 29.3% faster, measured 24.0%. Doubling the
micro-batches of its tp 1 run was predicted 7.0% faster (the bubble halved) and measured 18.9%
slower: a micro-batch's fixed cost (its calls, its Python, smaller matmuls) is not in the model
and one run cannot measure it, so the micro-batches are never changed here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import duckdb

from ranktrace.analysis.memory import ModelShape, stage_params
from ranktrace.analysis.peers import WARMUP_STEPS
from ranktrace.analysis.planner import ring_factor
from ranktrace.analysis.stragglers import MIN_COST_PCT

FAR_BELOW_PCT = 10.0
"""A run is far below its devices' best when the model's fastest layout is this much faster."""
ACTIVATION_BYTES = {"fp32": 4}
"""Bytes per activation element by precision (2 for bf16 and fp16)."""
GRADIENT_BYTES = 4
"""Bytes per gradient element reduced over dp (the trainer reduces fp32 gradients)."""


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batches: int


@dataclass(frozen=True)
class Parts:
    """Seconds per rank and step of each part the model prices."""

    compute: float
    optimizer: float
    pipeline: float
    tp: float
    dp: float
    other: float

    def total(self) -> float:
        return self.compute + self.optimizer + self.pipeline + self.tp + self.dp + self.other


@dataclass(frozen=True)
class Job:
    """What the model needs of the run besides its layout."""

    model: ModelShape
    global_batch: int
    seq_len: int
    zero: int
    precision: str
    seconds_per_ring_byte: float | None
    """Of the run's tp and dp transfers together (None: it has none)."""


_PARTS_SQL = """
WITH parts AS (  -- (`tp` is a rank's coordinate there: its communication is `tp_comm`)
    SELECT *, coalesce(tp_transfer_s, 0) + coalesce(tp_blocking_s, 0) AS tp_comm,
           greatest(forward_s + backward_s - coalesce(tp_transfer_s, 0)
                    - coalesce(tp_blocking_s, 0), 0) AS forward_backward
    FROM step_breakdown WHERE run_id = ? AND step >= ?
)
SELECT median(forward_backward) AS compute,
       median(greatest(work_s - forward_backward, 0)) AS optimizer,
       median(pipeline_wait_s) AS pipeline, median(tp_comm) AS tp,
       median(coalesce(dp_transfer_s, 0) + coalesce(dp_blocking_s, 0)) AS dp,
       median(data_s + host_s + coalesce(world_transfer_s, 0) + coalesce(world_blocking_s, 0))
           AS other
FROM parts
"""
_RATE_SQL = """
SELECT sum(transfer_s) / nullif(sum(bytes * 2.0 * (group_size - 1) / group_size), 0)
FROM collectives WHERE run_id = ? AND step >= ? AND axis IN ('tp', 'dp') AND group_size > 1
  AND op IN ('all_reduce', 'reduce_scatter', 'all_gather')
"""


def measured_parts(con: duckdb.DuckDBPyConnection, run_id: str) -> Parts | None:
    """The run's parts (module docstring); None where it has no step after the warm-up."""
    row = con.execute(_PARTS_SQL, [run_id, WARMUP_STEPS]).fetchone()
    return None if row is None or row[0] is None else Parts(*(float(v or 0.0) for v in row))


def ring_rate(con: duckdb.DuckDBPyConnection, run_id: str) -> float | None:
    """Seconds per ring byte (bytes × 2(n − 1)/n) of the run's tp and dp reductions."""
    row = con.execute(_RATE_SQL, [run_id, WARMUP_STEPS]).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def _params(job: Job, layout: Layout) -> float:
    """The fullest stage's parameters on one rank."""
    per_stage = job.model.n_layers // layout.pp
    return float(max(stage_params(job.model, per_stage, s, layout.pp, layout.tp)
                     for s in range(layout.pp)))  # fmt: skip


def _tp_bytes(job: Job, layout: Layout) -> float:
    """Ring bytes of a rank's tp all-reduces in a step."""
    sequences = job.global_batch / layout.dp
    element = ACTIVATION_BYTES.get(job.precision, 2)
    per_layer = 4 * sequences * job.seq_len * job.model.hidden * element
    return job.model.n_layers / layout.pp * per_layer * ring_factor(layout.tp)


def _dp_bytes(job: Job, layout: Layout) -> float:
    """Ring bytes of a rank's gradient reduction in a step."""
    return _params(job, layout) * GRADIENT_BYTES * ring_factor(layout.dp)


def _scaled(measured: float, now: float, new: float, rate: float | None) -> float | None:
    """A part in the new layout: the measured one × the model's new/now where the run has it,
    else the model's `new` bytes at `rate` (None where neither prices it)."""
    if new == 0:
        return 0.0
    if now > 0 and measured > 0:
        return measured * new / now
    return None if rate is None else new * rate


def predicted_parts(parts: Parts, job: Job, now: Layout, new: Layout) -> Parts | None:
    """The parts of `new` (module docstring); None where a part cannot be priced."""
    tp = _scaled(parts.tp, _tp_bytes(job, now), _tp_bytes(job, new), job.seconds_per_ring_byte)
    dp = _scaled(parts.dp, _dp_bytes(job, now), _dp_bytes(job, new), job.seconds_per_ring_byte)
    if tp is None or dp is None:
        return None
    sharded = (lambda layout: layout.dp) if job.zero >= 1 else (lambda layout: 1)
    optimizer = (
        parts.optimizer * (_params(job, new) / sharded(new)) / (_params(job, now) / sharded(now))
    )
    bubble_now = (now.pp - 1) / now.micro_batches
    bubble_new = (new.pp - 1) / new.micro_batches
    pipeline = (parts.pipeline * bubble_new / bubble_now if bubble_now > 0
                else parts.compute * bubble_new)  # fmt: skip
    return replace(parts, optimizer=optimizer, pipeline=pipeline, tp=tp, dp=dp)


def _valid(job: Job, layout: Layout) -> bool:
    m = job.model
    return (m.n_heads % layout.tp == 0 and m.hidden % layout.tp == 0
            and m.ffn_hidden % layout.tp == 0 and m.n_layers % layout.pp == 0
            and job.global_batch % (layout.dp * layout.micro_batches) == 0)  # fmt: skip


def one_axis_away(job: Job, now: Layout) -> list[Layout]:
    """The valid layouts of the same devices one axis from `now` (module docstring)."""
    world = now.tp * now.pp * now.dp
    out = []
    for factor in (2.0, 0.5):
        tp, pp = int(now.tp * factor), int(now.pp * factor)
        if tp >= 1 and world % (tp * now.pp) == 0 and tp != now.tp:
            out.append(Layout(tp, now.pp, world // (tp * now.pp), now.micro_batches))
        if pp >= 1 and world % (now.tp * pp) == 0 and pp != now.pp:
            out.append(Layout(now.tp, pp, world // (now.tp * pp), now.micro_batches))
    return [layout for layout in out if _valid(job, layout)]


def every_layout(job: Job, now: Layout) -> list[Layout]:
    """Every valid layout (tp, pp, dp) of `now`'s devices, with `now`'s micro-batches."""
    world = now.tp * now.pp * now.dp
    out = []
    for tp in (d for d in range(1, world + 1) if world % d == 0):
        for pp in (d for d in range(1, world // tp + 1) if (world // tp) % d == 0):
            out.append(Layout(tp, pp, world // (tp * pp), now.micro_batches))
    return [layout for layout in out if _valid(job, layout)]


def layout_remedy(parts: Parts, job: Job, now: Layout, step_s: float,
                  mfu: float | None) -> dict | None:  # fmt: skip
    """The one-axis change toward the fastest layout of the run's devices (module docstring):
    a remedy (`action`, `settings`, `predicted_step_s`, `predicted_gain_pct`) with
    `predicted_mfu`, `layout` and `best_layout`; None where the run is not far below it."""
    total = parts.total()
    if total <= 0:
        return None

    priced = {}  # layout -> its predicted step (the one-axis layouts are among them)
    for layout in every_layout(job, now):
        new = predicted_parts(parts, job, now, layout)
        if new is not None:
            priced[layout] = step_s * new.total() / total
    if not priced:
        return None
    best = min(priced, key=priced.get)
    if 100.0 * (1.0 - priced[best] / step_s) < FAR_BELOW_PCT:
        return None
    steps = [layout for layout in one_axis_away(job, now) if layout in priced]
    if not steps:
        return None
    nearer = min(steps, key=priced.get)
    next_s = priced[nearer]
    gain = 100.0 * (1.0 - next_s / step_s)
    if gain < MIN_COST_PCT:
        return None
    settings = {k: getattr(nearer, k) for k in ("tp", "pp", "dp")
                if getattr(nearer, k) != getattr(now, k)}  # fmt: skip
    flags = " ".join(f"--{k} {v}" for k, v in settings.items())
    best_text = f"tp={best.tp} pp={best.pp} dp={best.dp}, {priced[best]:.4f} s a step"
    return {
        "action": (f"change the layout one axis at a time toward the fastest of these "
                   f"{now.tp * now.pp * now.dp} devices ({best_text} by the model calibrated on "
                   f"this run): first {flags}"),
        "settings": settings,
        "predicted_step_s": round(next_s, 4),
        "predicted_gain_pct": round(gain, 2),
        "predicted_mfu": None if mfu is None else mfu * step_s / next_s,
        "layout": {"tp": now.tp, "pp": now.pp, "dp": now.dp, "micro_batches": now.micro_batches},
        "best_layout": {"tp": best.tp, "pp": best.pp, "dp": best.dp,
                        "predicted_step_s": round(priced[best], 4)},
    }  # fmt: skip
