"""S and its causes from the what-if replay (analysis/replay.py), after the published method
(Lin et al., OSDI'25):

- launch slowdown = measured / replayed without launch delays (rendezvous runs; a host-serial
  CPU rank has no launch delays to separate: 1.0);
- S = replayed without launch delays / ideal replay;
- S_X = replayed with only X's operations as recorded (the rest ideal, no launch delays) / ideal,
  for X a rank, a pipeline stage, or a label (a compute phase, or a call's `axis op`): a factor,
  1.0 for what costs nothing (`slowdown_by`);
- the stragglers the replay confirms, each priced by the replay without launch delays with
  exactly its operations at their reference (its peers' pace, analysis/whatif.py; on hosts
  whose ranks share cores, with the competition of the steps without it,
  analysis/competition.py), and `slowdown_by_cause` with the decomposition of S - 1
  (analysis/causes.py).
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

from ranktrace.analysis import competition, remedies, shared_cores, whatif
from ranktrace.analysis.causes import price_causes
from ranktrace.analysis.contention import dedicated_core_durations
from ranktrace.analysis.replay import ideal_durations, per_op_ideal, replay
from ranktrace.analysis.replay_graph import HOST_SERIAL, RENDEZVOUS
from ranktrace.analysis.replay_timeline import Timeline, load_timeline
from ranktrace.analysis.spread import explained_by_tokens
from ranktrace.analysis.stragglers import Straggler

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
    first_step: int
    last_step: int
    """The first and last step replayed (S and every S_X are over the steps between)."""
    ranks: int
    """Ranks (workers) replayed: the ideal's means pool them all."""
    sampled_every: int
    """1, or k when only every k-th step was replayed (MAX_REPLAY_CALLS)."""
    model: str

    def to_dict(self) -> dict:
        measured = self.measured_s
        return {
            "slowdown": self.slowdown, "replayed_s": self.replayed_s, "ideal_s": self.ideal_s,
            "measured_s": measured, "steps": self.steps, "first_step": self.first_step,
            "last_step": self.last_step, "sampled_every": self.sampled_every,
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
             model: str = HOST_SERIAL, varying_lengths: bool = False,
             shape: remedies.RunShape | None = None,
             forwards: pd.DataFrame | None = None,
             max_calls: int | None = None) -> dict | None:  # fmt: skip
    """`slowdown` (S), `slowdown_detail`, `slowdown_by` (S_X maps) and `slowdown_by_cause` of a
    run, plus `spread_imbalance` (a random imbalance the replay finds where the findings leave
    ≥ SPREAD_MIN_SAVED_PCT of the time and no rank holds most of it, or None), `stragglers` and
    `imbalances` (those the replay confirms, priced by it). None when no step has recorded
    collectives, or none the dependency model can replay. `max_calls`: the replay's budget
    (analysis/replay_timeline.py; a window of a long run replays its share of the run's)."""
    timeline = load_timeline(con, run_id, model, max_calls)
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
        steps=len(full), first_step=int(full.index.min()), last_step=int(full.index.max()),
        ranks=int(entries["rank"].nunique()),
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
        fixed = replay(pricing, durations, transfer)
        if crowded:  # removing a delay never lengthens a step (competition.py: why it can here)
            fixed = np.minimum(fixed, actual.reindex(fixed.index).fillna(np.inf))
        return fixed

    def what_if(finding):
        """(idealised mask, gap durations, transfers) of the replay without `finding`."""
        base = None
        if isinstance(finding, Straggler):
            freed_s = max(finding.step_time_s - finding.whatif_step_time_s, 0.0)
            base = competition.restored(pricing, crowded, whatif.finding_steps(finding), freed_s)
        if base is None:
            return whatif.finding_what_if(pricing, finding, no_launch, ideal_gaps)
        scaled = copy.copy(pricing)
        scaled.entries = pricing.entries.assign(duration_s=base.durations)
        scaled.transfer_s = base.transfer_s
        return whatif.finding_what_if(scaled, finding, base.durations, ideal_gaps)

    dedicated = _dedicated_cores(con, run_id, timeline) if crowded else None
    stragglers = whatif.confirmed(stragglers, what_if, rerun, actual, dedicated)
    by_cause, imbalances, spread, remainder = price_causes(
        pricing, stragglers, imbalances, what_if, rerun, actual, summary.ideal_s, varying_lengths,
        explained_by_tokens(forwards) if varying_lengths and forwards is not None
        else frozenset(),
    )  # fmt: skip
    found = [*imbalances, *([spread] if spread else [])]
    remedy_base, remedy_rerun = remedies.own_work(pricing.entries, no_launch), rerun
    host_of, cores = shared_cores.sharing_of(con, run_id) if crowded else ({}, {})
    if cores:  # remedies move work between ranks sharing cores: priced by the shared replay
        remedy_base = dedicated_core_durations(con, run_id, pricing.entries, no_launch)

        def remedy_rerun(durations, transfer) -> pd.Series:
            return shared_cores.shared_replay(pricing, durations, transfer, host_of, cores)

    remedy_of = remedies.remedies(stragglers, found, pricing, remedy_base, remedy_rerun, shape,
                                  forwards if forwards is not None else pd.DataFrame())  # fmt: skip
    stragglers = [_with_remedy(f, remedy_of) for f in stragglers]
    imbalances = [_with_remedy(i, remedy_of) for i in imbalances]
    spread = _with_remedy(spread, remedy_of) if spread else None
    factors = slowdown_factors(timeline, no_launch, ideal_gaps, ideal_transfer, ideal)
    notes = [SHARED_CORES_NOTE.format(len(crowded))] if crowded else []
    return {"slowdown": summary.slowdown,
            "slowdown_detail": {**summary.to_dict(), "ranks_sharing_cores": len(crowded)},
            "slowdown_by": factors, "slowdown_by_cause": by_cause,
            "slowdown_remainder": remainder, "spread_imbalance": spread,
            "imbalances": imbalances, "stragglers": stragglers, "notes": notes}  # fmt: skip


def _with_remedy(finding, remedy_of: dict):
    """`finding` carrying its remedy (analysis/remedies.py), where it has one."""
    remedy = remedy_of.get(id(finding))
    return dataclasses.replace(finding, remedy=remedy.to_dict()) if remedy else finding


@dataclass
class DedicatedCores:
    """The run priced as if every rank had a core of its own: compute gaps at their time on a
    core (analysis/contention.py), replayed."""

    timeline: Timeline
    durations: np.ndarray
    ideal: np.ndarray
    actual: pd.Series
    """The replay of the recorded steps with those durations."""

    def what_if(self, finding):
        """(idealised mask, gap durations, transfers) of the replay without `finding`."""
        return whatif.finding_what_if(self.timeline, finding, self.durations, self.ideal)

    def rerun(self, durations, transfer) -> pd.Series:
        return replay(self.timeline, durations, transfer)


def _dedicated_cores(con: duckdb.DuckDBPyConnection, run_id: str,
                     timeline: Timeline) -> DedicatedCores | None:  # fmt: skip
    """DedicatedCores of the run, or None where no rank's waits for a core were recorded."""
    entries = timeline.entries
    recorded = entries["duration_s"].to_numpy()
    durations = dedicated_core_durations(con, run_id, entries, recorded)
    if durations is recorded:
        return None
    priced = copy.copy(timeline)
    priced.entries = entries.assign(duration_s=durations)
    return DedicatedCores(priced, durations, ideal_durations(priced.entries),
                          replay(priced, durations, timeline.transfer_s))  # fmt: skip


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

    def by(column: np.ndarray, values: dict) -> dict:
        """{key: S with only the entries whose `column` is `value` as recorded}."""
        return {str(key): factor(gaps & (column == value),
                                 np.unique(call_instance[column[call_entry] == value]))
                for key, value in values.items()}  # fmt: skip

    if ideal_total <= 0:
        return {"rank": {}, "stage": {}, "phase": {}}
    rank, stage = entries["rank"].to_numpy(), entries["pp"].to_numpy()
    excess = pd.Series(np.where(gaps, recorded - ideal_gaps, 0.0)).groupby(rank).sum()
    ranks = sorted(excess.nlargest(MAX_RANK_FACTORS).index)
    phase, phases = _phase_codes(timeline, gaps, call_entry, call_instance)
    return {"rank": by(rank, {r: r for r in ranks}),
            "stage": by(stage, {s: s for s in sorted(set(stage))}),
            "phase": by(phase, phases)}  # fmt: skip


def _phase_codes(timeline: Timeline, gaps: np.ndarray, call_entry: np.ndarray,
                 call_instance: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:  # fmt: skip
    """(entries,) an integer code of each entry's phase label (a gap's recorded label, a call's
    "axis kind", e.g. "dp collective"), and {label: code} of the labels `slowdown_by` prices,
    sorted (every call label, every gap label but `launch`). Codes, not strings per entry: a
    1,024-rank run has millions of entries."""
    entries = timeline.entries
    gap_code, gap_names = pd.factorize(entries["label"].to_numpy(dtype=object),
                                       use_na_sentinel=False)  # fmt: skip
    axis_code, axis_names = pd.factorize(timeline.instance_axis[call_instance],
                                         use_na_sentinel=False)  # fmt: skip
    kind_code, kinds = pd.factorize(entries["kind"].to_numpy()[call_entry], use_na_sentinel=False)
    pairs, pair_code = np.unique(axis_code * len(kinds) + kind_code, return_inverse=True)
    pair_names = [f"{axis_names[p // len(kinds)]} {_CALL_NAMES[kinds[p % len(kinds)]]}"
                  for p in pairs]  # fmt: skip
    names = sorted({*(str(n) for n in gap_names[np.unique(gap_code[gaps])] if n != "launch"),
                    *pair_names})  # fmt: skip
    code_of = {name: code for code, name in enumerate(names)}
    launch = len(names)  # `launch` gaps: a code no factor asks for
    gap_to_code = np.array([code_of.get(str(n), launch) for n in gap_names], dtype=np.int64)
    phase = np.full(len(entries), launch, dtype=np.int64)
    phase[gaps] = gap_to_code[gap_code[gaps]]
    phase[call_entry] = np.array([code_of[n] for n in pair_names], dtype=np.int64)[pair_code]
    return phase, code_of


_CALL_NAMES = {1: "send", 2: "recv", 3: "collective"}
