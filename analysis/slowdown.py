"""S and its causes from the what-if replay (analysis/replay.py), after the published method
(Lin et al., OSDI'25):

- launch slowdown = measured / replayed without launch delays (rendezvous runs; a host-serial
  CPU rank has no launch delays to separate: 1.0);
- S = replayed without launch delays / ideal replay;
- S_X = replayed with only X's operations as recorded (the rest ideal, no launch delays) / ideal,
  for X a rank, a pipeline stage, or a label (a compute phase, or a call's `axis op`): a factor,
  1.0 for what costs nothing (`slowdown_by`);
- `slowdown_by_cause`: each finding's share of what idealising everything removes (a straggler:
  its gaps at its peers' pace, analysis/whatif.py), and the stragglers the replay confirms.
`replay_error_pct`: the replay with the recorded durations and launch delays against the
measured steps, the check of the dependency model.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import duckdb
import numpy as np
import pandas as pd

from ranktrace.analysis import competition, whatif
from ranktrace.analysis.contention import dedicated_core_durations
from ranktrace.analysis.imbalances import Imbalance
from ranktrace.analysis.replay import ideal_durations, per_op_ideal, replay
from ranktrace.analysis.replay_graph import HOST_SERIAL, RENDEZVOUS
from ranktrace.analysis.replay_timeline import Timeline, load_timeline
from ranktrace.analysis.stragglers import MIN_COST_PCT, Straggler

SPREAD_MIN_SAVED_PCT = 12.0
"""Compute variation no finding explains is a random imbalance when idealising it saves ≥ 12% of
the replayed time (healthy CPU runs here leave 6-7%; ±30% per micro-batch leaves 10%)..."""
SPREAD_MAX_RANK_SHARE = 0.5
"""...and no rank holds more than half of that excess compute."""
MAX_RANK_FACTORS = 32
"""`slowdown_by.rank` holds at most this many ranks, those whose recorded compute exceeds the
ideal most (one replay each: 1,024 of them would take longer than the whole report)."""
FACTOR_EVENT_STEPS = 24
"""The factors replay at most this many steps that need the call-by-call replay (a cycle in
their calls), evenly spread: ~0.4 ms a step each, 19 factors over 347 such steps of a 100k-event
profiler trace took 2.5 s. S_X is a ratio of sums, which a regular sample estimates."""

SHARED_CORES_NOTE = (
    "{} ranks share cores: S and S_X divide by an ideal in which no rank waits for a core or "
    "varies from step to step, so there they say more than a fix gives; the costs are priced "
    "with the cores shared as in the run's steps without the finding (on cores of their own: "
    "`dedicated_core_cost_pct`)"
)


@dataclass
class Slowdown:
    """S and what the replay saw (module docstring)."""

    slowdown: float
    replayed_s: float
    """Σ over the replayed steps of the replay without launch delays."""
    ideal_s: float
    measured_s: float
    """Σ of the measured job step times of the same steps."""
    full_s: float
    """Σ of the replay with the recorded launch delays (the measured steps' model)."""
    step_errors_pct: np.ndarray
    """Per replayed step: that replay against the measured step, %."""
    steps: int
    ranks: int
    """Ranks (workers) replayed: the ideal's means pool them all."""
    sampled_every: int
    """1, or k when only every k-th step was replayed (MAX_REPLAY_CALLS)."""
    model: str

    def to_dict(self) -> dict:
        measured = self.measured_s
        return {
            "slowdown": self.slowdown, "replayed_s": self.replayed_s, "ideal_s": self.ideal_s,
            "measured_s": measured, "steps": self.steps, "sampled_every": self.sampled_every,
            "replay_error_pct": 100 * (self.full_s - measured) / measured if measured else None,
            "replay_error_abs_pct_median": float(np.median(np.abs(self.step_errors_pct)))
            if len(self.step_errors_pct) else None,
            "replay_error_abs_pct_max": float(np.max(np.abs(self.step_errors_pct)))
            if len(self.step_errors_pct) else None,
            "launch_slowdown": measured / self.replayed_s
            if self.model == RENDEZVOUS and self.replayed_s else 1.0,
            "replay_model": self.model, "ranks": self.ranks,
        }  # fmt: skip


def slowdown(con: duckdb.DuckDBPyConnection, run_id: str, stragglers, imbalances,
             model: str = HOST_SERIAL) -> dict | None:  # fmt: skip
    """`slowdown` (S), `slowdown_detail`, `slowdown_by` (S_X maps) and `slowdown_by_cause` of a
    run, plus `spread_imbalance` (a random imbalance the replay finds where the findings leave
    ≥ SPREAD_MIN_SAVED_PCT of the time and no rank holds most of it, or None), `stragglers` and
    `imbalances` (those the replay confirms, priced by it). None when no step has recorded
    collectives, or none the dependency model can replay."""
    timeline = load_timeline(con, run_id, model)
    if timeline is None:
        return None
    entries = timeline.entries
    recorded = entries["duration_s"].to_numpy()
    launch = timeline.launch
    no_launch = np.where(launch, 0.0, recorded)
    if model == RENDEZVOUS:
        ideal_gaps, ideal_transfer = per_op_ideal(timeline)
    else:
        ideal_gaps, ideal_transfer = ideal_durations(entries), timeline.transfer_s
    full = replay(timeline, recorded, timeline.transfer_s, timeline.delays())
    if full.empty:  # no step the model can order (e.g. sends done before their recv is posted)
        return None
    without = replay(timeline, no_launch, timeline.transfer_s)
    ideal = replay(timeline, ideal_gaps, ideal_transfer)
    measured = timeline.measured_step_s.reindex(full.index)
    summary = Slowdown(
        slowdown=float(without.sum() / ideal.sum()) if ideal.sum() > 0 else 1.0,
        replayed_s=float(without.sum()), ideal_s=float(ideal.sum()),
        measured_s=float(measured.sum()), full_s=float(full.sum()),
        step_errors_pct=(100 * (full - measured) / measured).dropna().to_numpy(),
        steps=len(full), ranks=int(entries["rank"].nunique()),
        sampled_every=timeline.sampled_every, model=model,
    )  # fmt: skip

    # The what-ifs replay without launch delays, as S and S_X do (the published "fixed alone"
    # figures do too); on hosts whose ranks share cores, with the competition of the steps
    # without the finding (analysis/competition.py).
    pricing, actual = timeline, without
    if model == RENDEZVOUS:
        pricing = copy.copy(timeline)
        pricing.entries, pricing.call_delay = entries.assign(duration_s=no_launch), None
    crowded = competition.crowded_ranks(con, run_id) if model == HOST_SERIAL else set()

    def rerun(durations, transfer) -> pd.Series:
        return replay(pricing, durations, transfer)

    def what_if(finding):
        """(idealised mask, gap durations, transfers) of the replay without `finding`."""
        base = None
        if isinstance(finding, Straggler):
            base = competition.restored(pricing, crowded, whatif.finding_steps(finding))
        if base is None:
            return whatif.finding_what_if(pricing, finding, no_launch, ideal_gaps)
        scaled = copy.copy(pricing)
        scaled.entries = pricing.entries.assign(duration_s=base.durations)
        scaled.transfer_s = base.transfer_s
        return whatif.finding_what_if(scaled, finding, base.durations, ideal_gaps)

    dedicated = _dedicated_saving(con, run_id, timeline) if crowded else None
    stragglers = whatif.confirmed(stragglers, what_if, rerun, actual, dedicated)
    by_cause, imbalances, spread = _causes(pricing, stragglers, imbalances, what_if, rerun,
                                           actual, ideal_gaps, summary.ideal_s)  # fmt: skip
    factors = slowdown_factors(timeline, no_launch, ideal_gaps, ideal_transfer, ideal)
    notes = [SHARED_CORES_NOTE.format(len(crowded))] if crowded else []
    return {"slowdown": summary.slowdown,
            "slowdown_detail": {**summary.to_dict(), "ranks_sharing_cores": len(crowded)},
            "slowdown_by": factors, "slowdown_by_cause": by_cause, "spread_imbalance": spread,
            "imbalances": imbalances, "stragglers": stragglers, "notes": notes}  # fmt: skip


def _dedicated_saving(con: duckdb.DuckDBPyConnection, run_id: str, timeline: Timeline):
    """A finding's saving, % of the replayed time, had every rank a core of its own (compute
    gaps at their time on a core, analysis/contention.py): a function of the finding, or None
    where no rank's waits for a core were recorded."""
    entries = timeline.entries
    recorded = entries["duration_s"].to_numpy()
    durations = dedicated_core_durations(con, run_id, entries, recorded)
    if durations is recorded:
        return None
    priced = copy.copy(timeline)
    priced.entries = entries.assign(duration_s=durations)
    ideal = ideal_durations(priced.entries)
    actual = replay(priced, durations, timeline.transfer_s)

    def saving(finding) -> float:
        _, gaps, transfer = whatif.finding_what_if(priced, finding, durations, ideal)
        total = float(actual.sum())
        return 100.0 * float((actual - replay(priced, gaps, transfer)).sum()) / total

    return saving


def slowdown_factors(timeline: Timeline, recorded: np.ndarray, ideal_gaps: np.ndarray,
                     ideal_transfer: np.ndarray, ideal: pd.Series) -> dict:  # fmt: skip
    """`slowdown_by`: {"rank": {r: S_r}, "stage": {s: S_s}, "phase": {label: S_label}} (module
    docstring); keys as strings (JSON)."""
    entries = timeline.entries
    gaps = timeline.graph.is_gap
    irregular = np.asarray(timeline.graph.irregular_steps, dtype=np.int64)
    every = max(1, -(-len(irregular) // FACTOR_EVENT_STEPS))
    steps = np.setdiff1d(ideal.index.to_numpy(), np.setdiff1d(irregular, irregular[::every]))
    ideal_total = float(ideal[ideal.index.isin(steps)].sum())
    call_entry = np.flatnonzero(~gaps)
    call_instance = entries["instance"].to_numpy()[call_entry]

    def factor(kept_gaps: np.ndarray, kept_instances: np.ndarray) -> float:
        durations = np.where(kept_gaps, recorded, ideal_gaps)
        transfer = ideal_transfer.copy()
        transfer[kept_instances] = timeline.transfer_s[kept_instances]
        replayed = replay(timeline, durations, transfer, steps=steps)
        return round(float(replayed.sum()) / ideal_total, 4)

    def by(column: np.ndarray, values) -> dict:
        return {str(v): factor(gaps & (column == v),
                               np.unique(call_instance[column[call_entry] == v]))
                for v in values}  # fmt: skip

    rank, stage = entries["rank"].to_numpy(), entries["pp"].to_numpy()
    excess = pd.Series(np.where(gaps, recorded - ideal_gaps, 0.0)).groupby(rank).sum()
    ranks = sorted(excess.nlargest(MAX_RANK_FACTORS).index) if ideal_total > 0 else []
    label = np.where(gaps, entries["label"].to_numpy(dtype=object), "")
    call_label = (
        timeline.instance_axis[call_instance]
        + " "
        + pd.Series(entries["kind"].to_numpy()[call_entry]).map(_CALL_NAMES).to_numpy()
    )
    label[call_entry] = call_label
    labels = sorted(set(label[gaps & (label != "launch")]) | set(call_label))
    if ideal_total <= 0:
        return {"rank": {}, "stage": {}, "phase": {}}
    return {"rank": by(rank, ranks), "stage": by(stage, sorted(set(stage))),
            "phase": by(label, labels)}  # fmt: skip


_CALL_NAMES = {1: "send", 2: "recv", 3: "collective"}


def _causes(timeline, stragglers, imbalances, what_if, rerun, actual, ideal_gaps, ideal_s):
    """(`slowdown_by_cause`, the imbalances the replay confirms, a random imbalance only the
    replay sees or None). An imbalance is confirmed when idealising its operations saves what
    its kind asks (a stage: MIN_COST_PCT of the replayed time; spread slowness:
    SPREAD_MIN_SAVED_PCT), and then costs what the replay saves."""
    entries = timeline.entries
    recorded = entries["duration_s"].to_numpy()
    gaps = timeline.graph.is_gap
    priced, covered = [], np.zeros(len(entries), dtype=bool)
    for finding in [*stragglers, *imbalances]:
        if finding.kind != "random":
            mask, durations, transfer = what_if(finding)
            covered |= mask
            priced.append((finding, float((actual - rerun(durations, transfer)).sum())))
    total = float(actual.sum())
    removable = total - ideal_s
    random_found = any(f.kind == "random" for f in imbalances)
    spread = None
    # What the findings leave, inside each stage (the stages' different work is not random): a
    # random imbalance, or noise. Not replayed when even idealising everything saves too little.
    if random_found or 100 * removable >= SPREAD_MIN_SAVED_PCT * total:
        rest = gaps & ~covered
        stage_ideal = ideal_durations(entries, within_stage=True)
        fixed_rest = rerun(np.where(rest, stage_ideal, recorded), timeline.transfer_s)
        saved_rest = float((actual - fixed_rest).sum())
        if not random_found:
            spread = _spread_imbalance(entries, rest, recorded - stage_ideal, saved_rest,
                                       total, fixed_rest)  # fmt: skip
        priced += [(f, saved_rest) for f in [*imbalances, *([spread] if spread else [])]
                   if f.kind == "random"]  # fmt: skip
    confirmed, unconfirmed = [], set()
    for finding, saved in priced:
        if any(finding is i for i in imbalances):
            saved_pct = 100 * saved / total if total else 0.0
            floor = SPREAD_MIN_SAVED_PCT if finding.kind == "random" else MIN_COST_PCT
            if saved_pct >= floor:
                confirmed.append(dataclasses.replace(finding, cost_pct=round(saved_pct, 2)))
            else:
                unconfirmed.add(id(finding))
    priced = [(finding, saved) for finding, saved in priced if id(finding) not in unconfirmed]
    by_cause = []
    for finding, saved in priced:
        link = finding.kind == "communication"  # the ideal keeps every transfer: no share
        by_cause.append({
            **_cause_of(finding),
            "share_pct": None if link else 100 * saved / removable if removable > 1e-9 else 0.0,
            "saved_pct": 100 * saved / total if total else 0.0,
            "slowdown_without": (total - saved) / ideal_s if ideal_s > 0 else 1.0,
        })  # fmt: skip
    return by_cause, confirmed, spread


def _spread_imbalance(entries, rest, excess, saved, replayed_s, fixed):
    """A random Imbalance when idealising what the findings leave saves ≥ SPREAD_MIN_SAVED_PCT
    of the replayed time and no rank holds more than SPREAD_MAX_RANK_SHARE of the excess
    compute there (else that rank, not the spread, is the cause); None otherwise."""
    if replayed_s <= 0 or 100 * saved / replayed_s < SPREAD_MIN_SAVED_PCT:
        return None
    ranks = entries["rank"].to_numpy()[rest]
    per_rank = pd.Series(np.clip(excess, 0, None)[rest]).groupby(ranks).sum()
    if per_rank.sum() <= 0 or per_rank.max() / per_rank.sum() > SPREAD_MAX_RANK_SHARE:
        return None
    return Imbalance(
        kind="random", stage=None, excess=round(saved / replayed_s, 3),
        cost_pct=round(100 * saved / replayed_s, 2),
        whatif_step_time_s=float(fixed.median()),
        ranks=sorted(int(r) for r in per_rank[per_rank > 0].index),
    )  # fmt: skip


def _cause_of(finding) -> dict:
    """How a finding is named in `slowdown_by_cause`."""
    if finding.kind in ("stage", "random"):
        where = f"stage {finding.stage} " if getattr(finding, "stage", None) is not None else ""
        return {"cause": f"{where}{finding.kind} imbalance", "kind": finding.kind,
                "stage": getattr(finding, "stage", None), "rank": None}  # fmt: skip
    return {"cause": f"rank {finding.rank} {finding.kind}", "kind": finding.kind,
            "stage": None, "rank": finding.rank}  # fmt: skip
