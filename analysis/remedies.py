"""What to change for each finding, and what it should give: a remedy with its predicted step time
and gain, priced by the replay on what the change itself changes, never a stage "at its mean".

- a stage imbalance: a rebalanced `--stage-layers` from the measured time per layer (a layer
  takes the same time on every stage; what a stage takes beyond its layers, the LM head and
  the loss, is fixed): each stage's compute gaps scaled by its time with the new layers over
  its time now, its optimizer and gradient sync gaps and dp gradient transfers by its
  parameters; of the split that evens the compute and each one-layer move off the slowest
  stage, the one the replay finds fastest, and none where none is faster than the split now;
- a random imbalance from varying sequence lengths: length-bucketed batches
  (`--length-buckets`). Each micro-batch's compute is fitted against its tokens; the step's
  micro-batches regrouped as the trainer's bucketing does (trainer/lengths.py: sorted, dealt to
  the dp ranks in turn, the order reversed every micro-batch so that every rank's sum stays
  even) give each rank its new compute, its gaps scaled by it in the replay; not offered where
  the replay finds it slower (one micro-batch a rank: the longest always goes to the first dp
  rank, and a dp 2 run was predicted 4.3% slower);
- a slow rank (compute, host) or a slow node: run without that host, its operations at its
  peers' pace (the finding's what-if);
- slow data loading: more loader workers or prefetching, its data phase at its peers' pace.
Predicted step: the run's measured median step × the replay's ratio; gain: what the replay
saves, % of the run's time. A change to the job's work is priced on the job's own work: each
gap less the time its rank recorded waiting for a core in it (`own_work`), the waits another
job or the host caused being no part of what the layers or the lengths change. Beside another
2-rank job here, the wall times held 1.6x the CPU rank by rank and step by step: bucketing
priced on them gave -0.7 to +0.9% (no remedy in 2 of 4 runs) while the lengths explained the
compute (r = 0.96-0.98); on the own work, +2.2 to +5.4%. On hosts whose ranks share cores
the layers moved or the lengths regrouped change how long the ranks compete for the cores,
which the recorded durations hold fixed: there the change scales each gap's time on a core
and the shared-core replay (analysis/shared_cores.py) prices it (a rank waiting for a peer
hands its core to the others, so an imbalance there costs less than on dedicated cores).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from ranktrace.analysis.memory import ModelShape, stage_params
from ranktrace.analysis.replay_graph import COMPUTE
from ranktrace.analysis.spread import micro_batch_cost

LENGTH_BUCKETS = 8
"""Ranges of lengths a length-bucketing remedy asks for."""
MAX_SPLITS = 20_000
"""Stage splits tried one by one; past that many, layers are moved one at a time."""
COMPUTE_LABELS = ("forward", "backward")
PARAMETER_LABELS = ("optimizer", "grad_sync")
"""Gaps whose work follows the stage's parameters."""


@dataclass
class RunShape:
    """What pricing a remedy needs of the run's configuration (a trainer run's run.json)."""

    model: dict
    """The model's dimensions: hidden, ffn_hidden, vocab_size, n_layers."""
    split: list[int]
    """Layers per pipeline stage."""
    seq_len: int
    micro_batches: int
    tp: int = 1

    @classmethod
    def of(cls, record: dict) -> RunShape | None:
        """From a run.json (`record`); None for a run that does not say (an imported trace,
        a job ranktrace did not run)."""
        model, config = record.get("model_config"), record.get("config") or {}
        if not model or "pp" not in config:
            return None
        split = record.get("stage_layers") or [model["n_layers"] // config["pp"]] * config["pp"]
        return cls(model, [int(n) for n in split], int(config["seq_len"]),
                   int(config["micro_batches"]), int(config.get("tp", 1)))  # fmt: skip


@dataclass
class Remedy:
    """One change and what the replay says it gives."""

    action: str
    settings: dict
    predicted_step_s: float | None
    predicted_gain_pct: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def stage_costs(compute_s: np.ndarray, split: list[int]) -> tuple[float, np.ndarray]:
    """(seconds per layer, each stage's fixed seconds) of measured stage compute `compute_s`:
    a layer takes the same time on every stage, measured on the stages that hold nothing but
    layers (the middle ones; with two stages, the first, whose embedding lookup is cheap);
    what a stage takes beyond its layers (the LM head and loss on the last) is fixed."""
    layers = np.asarray(split, dtype=float)
    plain = slice(1, -1) if len(split) > 2 else slice(0, 1)
    per_layer = float(np.median(compute_s[plain] / layers[plain]))
    return per_layer, np.clip(compute_s - layers * per_layer, 0.0, None)


def best_split(compute_s: np.ndarray, split: list[int]) -> list[int]:
    """The split of the same layers over the stages whose slowest stage is fastest, a stage
    taking its layers at the measured time per layer plus its fixed time (`stage_costs`)."""
    per_layer, fixed = stage_costs(compute_s, split)
    n_layers, stages = sum(split), len(split)

    def slowest(candidate: list[int]) -> float:
        return float((np.asarray(candidate) * per_layer + fixed).max())

    if _compositions(n_layers, stages) <= MAX_SPLITS:
        candidates = [list(c) for c in _splits(n_layers, stages)]
        return min(candidates, key=lambda c: (slowest(c), c != split))
    current = list(split)
    while True:  # move one layer from the slowest stage to a neighbour while that helps
        worst = int((np.asarray(current) * per_layer + fixed).argmax())
        options = []
        for neighbour in (worst - 1, worst + 1):
            if 0 <= neighbour < stages and current[worst] > 1:
                option = current[:]
                option[worst] -= 1
                option[neighbour] += 1
                options.append(option)
        better = [o for o in options if slowest(o) < slowest(current)]
        if not better:
            return current
        current = min(better, key=slowest)


def _compositions(n: int, k: int) -> int:
    from math import comb

    return comb(n - 1, k - 1)


def _splits(n: int, k: int):
    """Every way to give n layers to k stages, each at least one."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def rebalanced_durations(timeline, entries: pd.DataFrame, shape: RunShape,
                         new: list[int]) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(gap durations, transfers) with the layers moved: each stage's forward and backward
    compute scaled by its time with the new layers over its time now (`stage_costs`), and
    what follows its parameters, the optimizer's step and gradient sync gaps and its dp
    gradient transfers, by its parameters with the new layers over its parameters now
    (analysis/memory.py)."""
    compute_s = stage_compute(entries)
    per_layer, fixed = stage_costs(compute_s, shape.split)
    scale = (np.asarray(new) * per_layer + fixed) / compute_s
    params = _param_ratio(shape, new)
    durations = entries["duration_s"].to_numpy().copy()
    labels, stage = entries["label"], entries["pp"].to_numpy()
    gap = entries["kind"].to_numpy() == COMPUTE
    compute = gap & labels.isin(COMPUTE_LABELS)
    durations[compute] *= scale[stage[compute]]
    update = gap & labels.isin(PARAMETER_LABELS)
    durations[update] *= params[stage[update]]
    transfer = timeline.transfer_s.copy()
    calls = entries[~gap]
    dp = calls[timeline.instance_axis[calls["instance"].to_numpy()] == "dp"]
    by_instance = dp.groupby("instance")["pp"].first()
    transfer[by_instance.index.to_numpy()] *= params[by_instance.to_numpy()]
    return durations, transfer


def _param_ratio(shape: RunShape, new: list[int]) -> np.ndarray:
    """(stages,) each stage's parameters with the `new` layers over its parameters now."""
    model = ModelShape.of(shape.model)
    stages = len(new)

    def held(split: list[int]) -> np.ndarray:
        return np.array([stage_params(model, n, s, stages, shape.tp) for s, n in enumerate(split)],
                        dtype=float)  # fmt: skip

    return held(new) / held(shape.split)


def own_work(entries: pd.DataFrame, durations: np.ndarray) -> np.ndarray:
    """(gaps,) `durations` less each gap's recorded wait for a core (`entries.core_wait_s`,
    NaN where the rank did not record it: kept), never below 0: the time the rank's own work
    took (module docstring)."""
    waited = entries["core_wait_s"].fillna(0.0).to_numpy() if "core_wait_s" in entries else 0.0
    return np.maximum(durations - waited, 0.0)


def stage_compute(entries: pd.DataFrame) -> np.ndarray:
    """(stages,) each stage's forward and backward compute per step: the median over its
    ranks and steps of the rank's sum."""
    compute = entries[(entries["kind"] == COMPUTE) & entries["label"].isin(COMPUTE_LABELS)]
    per_rank = compute.groupby(["pp", "rank", "step"])["duration_s"].sum()
    return per_rank.groupby(level="pp").median().sort_index().to_numpy()


def bucketed_assignment(lengths: np.ndarray, dp: int) -> np.ndarray:
    """(units,) where each of a step's micro-batch lengths (by global unit, dp-rank-major)
    goes under length bucketing: sorted, dealt to the dp ranks in turn, the dealing order
    reversed every micro-batch (trainer/lengths.py)."""
    n_micro = len(lengths) // dp
    order = np.argsort(lengths, kind="stable")
    placed = np.empty_like(lengths)
    for position, unit in enumerate(order):
        wave, offset = divmod(position, dp)
        rank = offset if wave % 2 == 0 else dp - 1 - offset
        placed[rank * n_micro + wave] = lengths[unit]
    return placed


def bucketed_durations(entries: pd.DataFrame, forwards: pd.DataFrame,
                       micro_batches: int) -> np.ndarray | None:  # fmt: skip
    """The gap durations had the micro-batches been length-bucketed: per (rank, step), the
    compute scaled by its micro-batches' fitted time after regrouping over before (the fit:
    analysis/spread.py `micro_batch_cost`); None without tokens, or where the compute does not
    grow with them (nothing to regroup)."""
    cost = micro_batch_cost(forwards)
    if cost is None:
        return None
    intercept, slope = cost
    known = forwards.dropna(subset=["tokens"])
    factor = {}
    for (step, _, _), group in known.groupby(["step", "pp", "tp"]):  # a stage and tp share
        group = group.sort_values(["rank", "micro_batch"])
        dp = group["rank"].nunique()
        if len(group) != dp * micro_batches:
            continue
        tokens = group["tokens"].to_numpy(dtype=float)
        before = (intercept + slope * tokens).reshape(dp, micro_batches).sum(axis=1)
        placed = bucketed_assignment(tokens, dp)
        after = (intercept + slope * placed).reshape(dp, micro_batches).sum(axis=1)
        for rank, ratio in zip(group["rank"].unique(), after / before, strict=True):
            factor[(int(rank), int(step))] = float(ratio)
    if not factor:
        return None
    keys = pd.MultiIndex.from_frame(entries[["rank", "step"]])
    scale = pd.Series(factor).reindex(keys).fillna(1.0).to_numpy()
    durations = entries["duration_s"].to_numpy().copy()
    compute = (entries["kind"].to_numpy() == COMPUTE) & entries["label"].isin(COMPUTE_LABELS)
    durations[compute] *= scale[compute]
    return durations


def remedies(findings: list, imbalances: list, timeline, base: np.ndarray, rerun,
             shape: RunShape | None, forwards: pd.DataFrame) -> dict[int, Remedy]:  # fmt: skip
    """{id(finding): its remedy} for the confirmed stragglers (priced by their what-if already)
    and imbalances (module docstring). `base`: the gap durations the changes scale (on hosts
    whose ranks share cores, each gap's time on a core), `rerun(durations, transfers)`: replayed
    step times with them (there, the shared-core replay, analysis/shared_cores.py)."""
    out = {}
    for finding in findings:
        out[id(finding)] = Remedy(_straggler_action(finding), _straggler_settings(finding),
                                  finding.whatif_step_time_s, finding.cost_pct)  # fmt: skip
    entries = timeline.entries.assign(duration_s=base)
    actual = None
    for imbalance in imbalances:
        actual = rerun(base, timeline.transfer_s) if actual is None else actual
        priced = None
        if imbalance.kind == "stage" and shape is not None and len(shape.split) > 1:
            priced = _fastest_split(timeline, entries, shape, rerun, actual)
        elif imbalance.kind == "random" and shape is not None:
            durations = bucketed_durations(entries, forwards, shape.micro_batches)
            fixed = None if durations is None else rerun(durations, timeline.transfer_s)
            if fixed is not None and fixed.sum() < actual.sum():  # never a change that slows
                action = (f"length-bucketed batches: --length-buckets {LENGTH_BUCKETS} (the "
                          "micro-batches the dp ranks run together of like length)")  # fmt: skip
                priced = (action, {"length_buckets": LENGTH_BUCKETS}, fixed)
        if priced is None:
            continue
        action, settings, fixed = priced
        measured = float(timeline.measured_step_s.reindex(actual.index).median())
        predicted_step = float((fixed / actual).median() * measured)
        gain = round(100 * (1 - float(fixed.sum()) / float(actual.sum())), 2)
        out[id(imbalance)] = Remedy(action, settings, predicted_step, gain)
    return out


def _fastest_split(timeline, entries: pd.DataFrame, shape: RunShape, rerun,
                   actual: pd.Series) -> tuple[str, dict, pd.Series] | None:  # fmt: skip
    """(action, settings, replayed steps) of the split the replay finds fastest among the one
    that evens the stages' compute (`best_split`) and each move of one layer off the slowest
    stage; None where none beats the split as it is (a layer also moves its optimizer work
    and gradients: evening the compute can lengthen the step where a stage's parameters, an
    LM head's, dominate its update)."""
    compute_s = stage_compute(entries)
    options = [best_split(compute_s, shape.split)]
    worst = int(compute_s.argmax())
    for neighbour in (worst - 1, worst + 1):
        if 0 <= neighbour < len(shape.split) and shape.split[worst] > 1:
            moved = list(shape.split)
            moved[worst] -= 1
            moved[neighbour] += 1
            options.append(moved)
    best = None
    for new in {tuple(o) for o in options if o != shape.split}:
        fixed = rerun(*rebalanced_durations(timeline, entries, shape, list(new)))
        if fixed.sum() < actual.sum() and (best is None or fixed.sum() < best[1].sum()):
            best = (list(new), fixed)
    if best is None:
        return None
    text = ",".join(map(str, best[0]))
    return f"rebalance the pipeline stages: --stage-layers {text}", {"stage_layers": text}, best[1]


def _straggler_action(finding) -> str:
    """What to do about a straggler, in words."""
    if finding.kind == "data":
        return (f"give rank {finding.rank}'s data loading more workers or prefetching "
                "(DataLoader num_workers, prefetch_factor), or move its input off the slow "
                "storage")  # fmt: skip
    if finding.hosts:
        return (f"run without host {', '.join(finding.hosts)}: relaunch torchrun with a spare "
                "node in its place (--nnodes the same, its rank's node replaced)")  # fmt: skip
    if finding.rank is None:
        hosts = f" (nodes {', '.join(finding.candidate_hosts)})" if finding.candidate_hosts else ""
        return (f"find which of ranks {', '.join(map(str, finding.candidates))}{hosts} is slow "
                "(`ranktrace probe --for RUN`), then run without its host")  # fmt: skip
    return (f"run without rank {finding.rank}'s host (or GPU): relaunch torchrun with it "
            "replaced by a healthy one")  # fmt: skip


def _straggler_settings(finding) -> dict:
    """The settings a straggler's remedy changes."""
    if finding.kind == "data":
        return {"data_loading": finding.rank}
    if finding.hosts:
        return {"exclude_hosts": finding.hosts}
    if finding.rank is None:
        return {"probe": True, "candidates": finding.candidates}
    return {"replace_rank": finding.rank}
