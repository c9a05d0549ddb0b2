"""Stragglers of one run: which rank is slow, why, since when, at what cost; from the store's
view `step_breakdown` (via analysis/peers.py). Slow links are found from the groups' transfer
times in analysis/links.py, with the findings and thresholds defined here.

The method (DESIGN.md, "Straggler diagnosis"):
- Peers are the ranks of one pipeline stage (same layers, same work). Per step, each rank's own
  time (step time minus the time it waited for others) is compared with a robust reference of
  its peers: the median of the *other* peers, and their median absolute deviation. A rank-step
  is slow when it exceeds the reference by `MIN_SLOWDOWN` and by `MAD_K` deviations (of its
  peers at that step, and of the run's own noise in the stage: `_single_steps`).
- The slow part names the kind: compute (forward/backward work on a core: on CPU devices the
  main thread's CPU time), data (the data phase), host (time outside every phase: pauses; and on
  CPU devices compute time spent waiting for a core: contention) or communication (transfer
  time).
- A bad link raises the transfer time of every group the rank belongs to, for all members:
  groups are compared per axis; the culprit is the one rank common to the slow groups of
  different axes (analysis/links.py). When one axis alone is slow, its members are candidates.
- `chronic`: the rank's rolling median over 5 steps stays slow for 8 or more steps (in own
  time, or in the own column of compute, data or host time where the other parts' noise hides
  it in own time: `_with_kind_stretches`), most of them slow on their own (a link: its
  groups are slow in most steps from the onset on), costing at least `MIN_COST_PCT` of the
  run's time; else `transient`: at least `MIN_STEPS` slow steps
  (each slow in its kind's own column; a data or pause step also where that column alone
  stands out against its own noise over the run, `_stands_out`), ≥ `TRANSIENT_MIN_SLOWDOWN`
  and ≥ `TRANSIENT_MIN_COST_PCT` (a link: one located rank). One finding per rank and kind;
  transient host steps per rank and cause (a pause, or a wait for a core), as one finding over
  steps of both causes would start at a wait the pauses did not.
- Cost: the what-if step time had the rank run at its peers' reference (its excess removed
  from the job's step time), and the share of the run's time that excess took.
Imbalances, which are no one rank's fault, are in analysis/imbalances.py.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from ranktrace.analysis.peers import KIND_COLUMNS

MIN_SLOWDOWN = 1.15
"""A rank-step is slow when its own time is ≥ 15% above its peers' reference..."""
MAD_K = 3.0
"""...and above it by ≥ 3 scaled median absolute deviations of the peers..."""
MIN_EXCESS_S = 0.002
"""...and by ≥ 2 ms (timer and scheduler noise)."""
MIN_STEPS = 3
"""Slow steps a transient finding needs..."""
CHRONIC_MIN_STEPS = 8
"""...and a chronic one a stretch of at least 8 steps (shorter bursts are transient)..."""
CHRONIC_SLOW_SHARE = 0.5
"""...in which at least half of the steps are slow on their own."""
CHRONIC_DENSITY = 0.6
"""A slow link is chronic when its groups are slow in ≥ 60% of the steps from its onset on."""
ONSET_WINDOW = 5
"""Steps of the rolling window that tells sustained slowness from scattered slow steps."""
MIN_COST_PCT = 5.0
"""Chronic findings costing less than 5% of the run's time are not reported (on a shared 2-core
machine, stretches of scheduling noise between two peers cost up to ~4%)..."""
TRANSIENT_MIN_COST_PCT = 5.0
"""...nor transient ones below 5%, or with a median slowdown below 1.5× (scattered slow steps
of a healthy rank on a shared 2-core machine cost a few percent at ~1.3×)."""
TRANSIENT_MIN_SLOWDOWN = 1.5
KINDS = ("compute", "data", "host", "communication")


@dataclass
class Straggler:
    """One slow rank (or, for a link that timing cannot pin down, its candidate ranks)."""

    rank: int | None
    kind: str
    axis: str | None
    first_step: int
    last_step: int
    slowdown: float
    """Own time (for communication: the slow groups' transfer time) × the peers' reference."""
    cost_pct: float
    """Share of the run's time spent on this rank's excess."""
    pattern: str
    """`chronic` or `transient`."""
    slow_steps: int
    step_time_s: float
    """Median job step time over the slow steps."""
    whatif_step_time_s: float
    """The same, had the rank run at its peers' reference."""
    candidates: list[int] = field(default_factory=list)
    axes: list[str] = field(default_factory=list)
    saved_pct: float | None = None
    """What the replay saves with only this finding's operations idealised, % of the replayed
    time (analysis/whatif.py); `cost_pct` is this when the run has a replay. On a host whose
    ranks share cores, priced with the cores shared as in the run's steps without the finding
    (analysis/competition.py)."""
    dedicated_core_cost_pct: float | None = None
    """On a host whose ranks share cores: the saving had every rank a core of its own (the
    hardware a job runs on in production), a separate figure, and the one that makes the
    finding material there; None elsewhere."""
    cost_once_others_fixed_pct: float | None = None
    """Beside other findings: what fixing this one saves once they are fixed (% of the replayed
    time), which a finding hidden behind another (its delay inside its wait for a slower rank)
    shows where its own saving cannot; None alone."""
    pp: int | None = None
    dp: int | None = None
    tp: int | None = None
    cause: str | None = None
    """host: `contention` (its compute waited for a core: wall time above its peers', CPU time
    not) or `pause` (time outside every phase); a slow node (analysis/slow_nodes.py): `node
    sends slowly` or `node receives slowly`; else None."""
    hosts: list[str] = field(default_factory=list)
    """A slow node's host (its ranks are `candidates`); empty for the others."""
    steps: list[int] = field(default_factory=list)
    """A transient finding's slow steps; empty for a chronic one (every step from `first_step`
    to `last_step`)."""
    candidate_hosts: list[str] = field(default_factory=list)
    """Where no one rank or node is located (`rank` None): the nodes the evidence allows."""
    node_hypotheses: list[dict] = field(default_factory=list)
    """A slow node finding's hypotheses, the strongest first: {"host", "ranks", "cause"} each
    (one for a named node; every node the timing cannot separate from it otherwise). The
    replay prices the strongest; empty for every other finding."""
    evidence: list[str] = field(default_factory=list)
    """The comparisons that located it (or could not), in words."""
    remedy: dict | None = None
    """What to change and what it should give (analysis/remedies.py)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def who(self) -> str:
        """`rank 5`, or `one of ranks 4, 5` where no one rank is located."""
        if self.rank is not None:
            return f"rank {self.rank}"
        return "one of ranks " + ", ".join(map(str, self.candidates))


def _onset(steps: list[int]) -> int:
    """The first slow step from which the slowness persists (see ONSET_WINDOW)."""
    slow = set(steps)
    for step in steps:
        window = range(step, step + ONSET_WINDOW)
        if sum(s in slow for s in window) >= CHRONIC_DENSITY * ONSET_WINDOW:
            return step
    return steps[0]


def chronic_pattern(steps: list[int]) -> tuple[str, int]:
    """(chronic | transient, first step of the finding)."""
    onset = _onset(steps)
    persisting = [s for s in steps if s >= onset]
    span = persisting[-1] - onset + 1
    if len(persisting) >= CHRONIC_MIN_STEPS and len(persisting) / span >= CHRONIC_DENSITY:
        return "chronic", onset
    return "transient", steps[0]


_COST_JUDGED_BY_RUN: ContextVar[bool] = ContextVar("cost_judged_by_run", default=False)


@contextmanager
def cost_judged_by_the_run() -> Iterator[None]:
    """Within the block one window of a long run is diagnosed (analysis/window_report.py): whether a
    finding costs enough is the run's to judge, once its windows are merged
    (analysis/window_merge.py), so `is_material` passes any cost. A slow rank from step 500
    costs 2.8% of a window of steps 0-599 and 17% of the next: left out of the first, it would
    start at step 600 and cost too little."""
    token = _COST_JUDGED_BY_RUN.set(True)
    try:
        yield
    finally:
        _COST_JUDGED_BY_RUN.reset(token)


def is_material(pattern: str, cost_pct: float, slowdown: float) -> bool:
    """Whether a finding is worth reporting (see the thresholds above; within
    `cost_judged_by_the_run`, any cost of at least 0 is)."""
    by_run = _COST_JUDGED_BY_RUN.get()
    if pattern == "chronic":
        return cost_pct >= (0.0 if by_run else MIN_COST_PCT)
    floor = 0.0 if by_run else TRANSIENT_MIN_COST_PCT
    return cost_pct >= floor and slowdown >= TRANSIENT_MIN_SLOWDOWN


def _rank_straggler(rows: pd.DataFrame, kind: str, pattern: str, job_step: pd.Series,
                    total_s: float) -> Straggler | None:  # fmt: skip
    """One compute/data/host finding over `rows` (the rank's slow steps), if material."""
    excess = rows["excess"].clip(lower=0.0).to_numpy()
    actual = job_step.loc[rows["step"]].to_numpy()
    whatif = np.maximum(actual - excess, 0.0)
    cost_pct = 100.0 * float((actual - whatif).sum()) / total_s
    slowdown = float(np.median(rows["ratio"]))
    if not is_material(pattern, cost_pct, slowdown):
        return None
    first = rows.iloc[0]
    cause = None
    if kind == "host":
        waited, paused = _host_excesses(rows)
        cause = "contention" if waited.sum() > paused.sum() else "pause"
    return Straggler(
        rank=int(first["rank"]), kind=kind, axis=None, first_step=int(rows["step"].min()),
        last_step=int(rows["step"].max()), slowdown=round(slowdown, 3),
        cost_pct=round(cost_pct, 2), pattern=pattern, slow_steps=len(rows),
        step_time_s=float(np.median(actual)), whatif_step_time_s=float(np.median(whatif)),
        candidates=[int(first["rank"])], pp=int(first["pp"]), dp=int(first["dp"]),
        tp=int(first["tp"]), cause=cause,
        steps=sorted(int(s) for s in rows["step"]) if pattern == "transient" else [],
    )  # fmt: skip


def _slow_in(kind_ratios: pd.DataFrame, kinds: pd.Series) -> pd.Series:
    """Per row, whether its ratio in the kind `kinds` names is ≥ MIN_SLOWDOWN."""
    return _in_kind(kind_ratios, kinds) >= MIN_SLOWDOWN


KIND_NOISE_MIN_ROWS = 8
"""Rank-steps a stage needs for the run's own noise in it (`_run_noise`) to be measured."""


def _single_steps(frame: pd.DataFrame, kind_excess: pd.DataFrame, kind_ratios: pd.DataFrame,
                  calm: pd.Series) -> pd.DataFrame:  # fmt: skip
    """Per rank-step of `frame` (rank, step, pp, own ratio and excess, kind, host_s and its
    reference), whether it is a single slow step (`single`), of which kind (`step_kind`), and
    its ratio and excess in that reading (`step_ratio`, `step_excess`).

    Slow in own time: ≥ MIN_SLOWDOWN, ≥ MIN_EXCESS_S, ≥ MAD_K deviations of its peers at that
    step and of the run's own noise in the stage (`_run_noise` of the own-time ratio over the
    `calm` steps, where no rank of the stage is in a chronic stretch: one peer, as at dp 2,
    gives no spread at a step, and a 2-rank DDP job beside another job had scattered
    "compute, transient" steps by noise alone), with the part
    that names its kind alone making it ≥ MIN_SLOWDOWN (a step 1.19x its peers' by 6 ms of
    compute, 8 of host and 5 of transfer is noise; it once opened a pause finding 7 steps
    before the first pause). Else, a data or pause step whose own time the compute's noise
    hides is slow in that part where the part alone stands out against its own noise over the
    run (`_stands_out`), and is read in that part: with a neighbour job on 2 cores, own times of
    190-520 ms hid 200 ms pauses that host time, 1-10 ms at every other step, showed plainly.
    So is a step slow in own time whose largest part is its transfers: a rank's first pause
    (0.27 s outside every phase) fell on a step whose tp transfers stalled 0.4 s more, was read
    as a transfer step, and its finding started at the second pause, 6 steps late (the detection
    matrix beside a timing loop's job, tests/data/pause-beside-a-transfer-stall).
    (Compute is own time's bulk, as noisy in its own column: not judged so.)"""
    ratio, excess = frame["ratio"], frame["excess"]
    noise = _run_noise((ratio - 1.0).where(calm), frame["pp"])
    own_slow = ((ratio >= MIN_SLOWDOWN) & (ratio - 1.0 >= MAD_K * noise)
                & (excess >= np.maximum(MAD_K * frame["own_scale"].fillna(0.0), MIN_EXCESS_S))
                & _slow_in(kind_ratios, frame["kind"]))  # fmt: skip
    apart = pd.DataFrame({"data": kind_excess["data"],
                          "host": frame["host_s"] - frame["host_s_ref"]})  # fmt: skip
    apart_ratios = (1.0 + apart.div(frame["own_s_ref"], axis=0)).clip(0.0, 3.0)
    stands_out = _stands_out(apart, apart_ratios, frame["pp"])
    # a step slow in own time mostly by its transfers (which a rank's own time never reports:
    # links are found from their groups) is read in the part that stands out alone too
    standing = stands_out.any(axis=1) & (~own_slow | (frame["kind"] == "communication"))
    part = apart.where(stands_out, -np.inf).idxmax(axis=1)
    return pd.DataFrame({
        "single": own_slow | standing,
        "step_kind": frame["kind"].where(~standing, part),
        "step_ratio": ratio.where(~standing, _in_kind(apart_ratios, part)),
        "step_excess": excess.where(~standing, _in_kind(apart, part)),
    })  # fmt: skip


def _stands_out(kind_excess: pd.DataFrame, kind_ratios: pd.DataFrame,
                stage: pd.Series) -> pd.DataFrame:  # fmt: skip
    """Per rank-step and kind, whether that kind's time alone stands out from its peers': its
    excess ≥ MAD_K × the run's own noise in that kind (1.4826 × the median absolute deviation
    of every rank-step's excess in the stage: how far a rank's time in that part usually sits
    from its peers') and ≥ MIN_EXCESS_S, and its ratio ≥ MIN_SLOWDOWN. False where the stage
    has fewer than KIND_NOISE_MIN_ROWS rank-steps with peers."""
    noise = _run_noise(kind_excess, stage, unmeasured=np.inf)
    return (kind_excess >= np.maximum(MAD_K * noise, MIN_EXCESS_S)) & (
        kind_ratios >= MIN_SLOWDOWN)  # fmt: skip


STRETCH_T = MAD_K
"""A chronic stretch's level must stand this many standard errors above 1 (see
`_above_the_runs_noise`)."""


def _calm(frame: pd.DataFrame, in_stretch: pd.Series) -> pd.Series:
    """Per rank-step, whether no rank of its stage is in a chronic stretch (or, where given, a
    single slow step: `in_stretch` marks both) at that step: with
    one peer, the peer of a slow rank mirrors it (its ratio falls as the other's rises), so
    the run's noise is measured away from both."""
    return ~in_stretch.groupby([frame["pp"].to_numpy(), frame["step"].to_numpy()]).transform("any")


STRETCH_NOISE_MIN_STEPS = KIND_NOISE_MIN_ROWS
"""Calm steps (not rank-steps) a stage needs for `_above_the_runs_noise` to judge a stretch
against them. A step's ranks are not independent samples of the noise: at dp 2 each rank's
ratio is the inverse of its peer's, so one slow rank-step is two outlying ones. A busy core's
rank (1.34x its peer's time at the median over 31 steps, its peer's core shared with another
job) was judged against the 6 steps before its stretch, 4 of them one rank stalled 0.5-4.2 s or
2-3x (8 of the 12 rank-steps): noise 1.11, its level 0.34 under the bar of 0.75, and it went
unnamed (a timing-loop run of test_contention.py, tests/data/busy-core-after-a-chaotic-start)."""


def _above_the_runs_noise(frame: pd.DataFrame, stretch: pd.Series, stretch_kind: pd.Series,
                          kind_ratios: pd.DataFrame, spikes: pd.Series) -> pd.Series:  # fmt: skip
    """`stretch` (per rank-step, a chronic stretch's id or -1) less the stretches whose level is
    within the run's noise: the median of the stretch's kind's ratio over its n steps must be
    ≥ STRETCH_T standard errors above 1 (1.2533 × the run's noise in that ratio, `_run_noise`
    over the steps of its stage where no stretch is, / √n). Where those steps are fewer than
    STRETCH_NOISE_MIN_STEPS, the stretch is judged against its own spread alone (below): a short
    run whose stretch covers most of it can tell no more. Once such a stretch was not judged at
    all: a healthy 2-rank Lightning job of 16 steps beside a timing loop's job had rank 0
    "compute, chronic" over steps 5-12 (its ratio 0.96-2.05, level 0.28, its spread 0.38: a
    bar of 0.51; 5 calm steps; tests/data/lightning-healthy-crowded). A dp 2 run of varying
    sequence lengths (each rank's own time 0.46-1.69x its peer's, step to step) had rank 0
    "compute, chronic" at 1.24x over 10 steps.
    Nor is the noise measured at `spikes` (the stage's steps where a rank was a single slow step,
    judged against the noise outside stretches): a rank stalled 1-8 s at 3 of the 10 steps
    before its peer's contention stretch made that noise 0.87, and hid the stretch (a
    contention test run beside a training job).
    Nor is the noise taken above the stretch's own (`_stretch_spread`: how far its ratio moves
    step to step over its own steps, the noise over the steps of the finding): the steps
    outside it can hold the rank's fault before its stretch opened and its peer's stalls. A
    busy core's rank, 1.47x over steps 19-39 (its ratio's spread there 0.23), was judged against
    a noise of 0.73 from 14 such steps, 8 of them one rank 2.3-3x, and went unnamed (a run of
    test_contention.py beside test_watch.py's 8 ranks, tests/data/busy-core-beside-its-peers-
    stalls). On 121 stored runs nothing else changed."""
    if not (stretch >= 0).any():
        return stretch
    kinds = stretch.map(stretch_kind).where(stretch >= 0)
    calm = _calm(frame, (stretch >= 0) | spikes)
    stage, steps_of = frame["pp"].to_numpy(), frame["step"].where(calm)
    measured = steps_of.groupby(stage).transform("nunique") >= STRETCH_NOISE_MIN_STEPS
    verdicts = {}
    for kind in kinds.dropna().unique():
        ratio = (kind_ratios[kind] - 1.0).where(calm)
        noise = _run_noise(ratio, frame["pp"]).where(measured, np.inf)  # unmeasured: its own
        mine = kinds == kind
        level = (kind_ratios[kind][mine] - 1.0).groupby(stretch[mine]).median()
        spread = np.minimum(
            noise[mine].groupby(stretch[mine]).first(),
            _stretch_spread(kind_ratios[kind][mine], stretch[mine]),
        )
        steps = stretch[mine].value_counts()
        bar = STRETCH_T * 1.2533 * spread / np.sqrt(steps.reindex(level.index))
        verdicts.update((level >= bar).to_dict())
    return stretch.where(stretch.map(verdicts).fillna(False).astype(bool), -1)


def _stretch_spread(ratio: pd.Series, stretch: pd.Series) -> pd.Series:
    """Per stretch id, 1.4826 × the median absolute deviation of `ratio` over its steps."""
    deviation = (ratio - ratio.groupby(stretch).transform("median")).abs()
    return 1.4826 * deviation.groupby(stretch).median()


def _run_noise(values: pd.Series | pd.DataFrame, stage: pd.Series,
               unmeasured: float = 0.0) -> pd.Series | pd.DataFrame:  # fmt: skip
    """Per rank-step (and column of `values`: excesses or ratios against the peers, NaN where
    left out), the run's noise in it: 1.4826 × the median absolute deviation of the stage's
    rank-steps (a robust standard deviation of how far a rank usually sits from its peers);
    `unmeasured` where the stage has fewer than KIND_NOISE_MIN_ROWS such rank-steps."""
    by_stage = stage.to_numpy()
    median = values.groupby(by_stage).transform("median")
    noise = 1.4826 * (values - median).abs().groupby(by_stage).transform("median")
    measured = values.groupby(by_stage).transform("count") >= KIND_NOISE_MIN_ROWS
    return noise.where(measured, unmeasured).fillna(unmeasured)


def _in_kind(table: pd.DataFrame, kinds: pd.Series) -> pd.Series:
    """Per row, `table`'s entry in the column `kinds` names."""
    columns = table.columns.get_indexer(kinds)
    return pd.Series(table.to_numpy()[np.arange(len(kinds)), columns], index=kinds.index)


def _host_excesses(rows: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Per rank-step, (how much longer its compute waited for a core than its peers', how much
    longer it spent outside every phase), each at least 0."""
    waited = (rows["core_wait_s"] - rows["core_wait_s_ref"]).clip(lower=0)
    paused = (rows["host_s"] - rows["host_s_ref"]).clip(lower=0)
    return waited, paused


def _host_causes(rows: pd.DataFrame) -> pd.Series:
    """Per rank-step, the cause of its host excess: `contention` where it waited for a core
    more than it paused (see `_host_excesses`), else `pause`."""
    waited, paused = _host_excesses(rows)
    return pd.Series(np.where(waited > paused, "contention", "pause"), index=rows.index)


def _per_rank_rolling(frame: pd.DataFrame, values: pd.Series, how: str) -> pd.Series:
    """A centred rolling `how` (median, max, min) over ONSET_WINDOW steps of each rank (a median
    needs 3 values, the others 1). `frame` is sorted by rank, then step."""
    counts = frame["rank"].value_counts(sort=False)
    if counts.nunique() == 1:  # every rank has every step: one [ranks, steps] array
        grid = values.to_numpy(dtype=float).reshape(len(counts), -1)  # [R, S]
        half = ONSET_WINDOW // 2
        padded = np.pad(grid, ((0, 0), (half, half)), constant_values=np.nan)
        windows = np.lib.stride_tricks.sliding_window_view(padded, ONSET_WINDOW, axis=1)
        present = np.sum(~np.isnan(windows), axis=2)  # [R, S]
        if how == "median":
            result = _nanmedian_last_axis(windows)
        else:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows give NaN
                result = getattr(np, f"nan{how}")(windows, axis=2)
        result[present < (3 if how == "median" else 1)] = np.nan
        return pd.Series(result.reshape(-1), index=values.index)
    rolling = values.groupby(frame["rank"], sort=False).rolling(
        ONSET_WINDOW, center=True, min_periods=1 if how != "median" else 3
    )
    return getattr(rolling, how)().reset_index(level=0, drop=True).loc[frame.index]


def _nanmedian_last_axis(windows: np.ndarray) -> np.ndarray:
    """np.nanmedian over the last axis of small windows, by sorting (NaN sorts last): numpy's
    own takes a masked-array path ~10x slower on millions of 5-wide windows."""
    ordered = np.sort(windows, axis=-1)
    present = np.sum(~np.isnan(windows), axis=-1)  # [...]
    low = np.take_along_axis(ordered, np.maximum(present - 1, 0)[..., None] // 2, -1)[..., 0]
    high = np.take_along_axis(ordered, (present // 2)[..., None], -1)[..., 0]
    return np.where(present > 0, (low + high) / 2, np.nan)


def _chronic_stretches(frame: pd.DataFrame) -> pd.Series:
    """Per row, the id of the chronic stretch it belongs to (-1: none).

    A stretch: the rank's rolling median own time ≥ MIN_SLOWDOWN × its peers' reference (and
    ≥ MIN_EXCESS_S above it), gaps shorter than ONSET_WINDOW closed, ≥ CHRONIC_MIN_STEPS long,
    and with at least CHRONIC_SLOW_SHARE of its steps ≥ MIN_SLOWDOWN on their own (a periodic
    pause lifts a rolling median without making most steps slow).
    """
    sustained = (_per_rank_rolling(frame, frame["ratio"], "median") >= MIN_SLOWDOWN) & (
        _per_rank_rolling(frame, frame["excess"], "median") >= MIN_EXCESS_S
    )
    dilated = _per_rank_rolling(frame, sustained.astype(float), "max")
    closed = _per_rank_rolling(frame, dilated, "min") > 0.5
    new_run = (closed != closed.shift()) | (frame["rank"] != frame["rank"].shift())
    run_id = new_run.cumsum()
    elevated = (frame["ratio"] >= MIN_SLOWDOWN) & (frame["excess"] >= MIN_EXCESS_S)
    starts = np.flatnonzero(new_run.to_numpy())  # each run's first row (runs are contiguous)
    length = np.diff(np.append(starts, len(frame)))
    slow_share = np.add.reduceat(elevated.to_numpy(dtype=float), starts) / length
    valid = (closed.to_numpy()[starts] & (length >= CHRONIC_MIN_STEPS)
             & (slow_share >= CHRONIC_SLOW_SHARE))  # fmt: skip
    return run_id.where(np.repeat(valid, length), -1)


def _stretch_kinds(stretch: pd.Series, found_in: dict[int, str],
                   kind_excess: pd.DataFrame) -> pd.Series:  # fmt: skip
    """{id: kind} of every stretch: `found_in`'s where it was read in a kind's own column, else
    the kind with the most excess over it."""
    stretch_kind = kind_excess.clip(lower=0).groupby(stretch).sum().idxmax(axis=1)
    stretch_kind.update(pd.Series(found_in, dtype=object))
    return stretch_kind


def _chronic_in_kind(stretch: pd.Series, stretch_kind: pd.Series,
                     kind_ratios: pd.DataFrame) -> pd.Series:  # fmt: skip
    """`stretch` less the stretches not chronic in their kind: fewer than CHRONIC_SLOW_SHARE of
    their steps slow in that column. A pause every 6 steps on a noisy rank lifted the own-time
    rolling median, and half of the steps were ≥ 1.15x by own-time noise alone, while its host
    time rose only at the pauses. (A stretch read in a kind's own column passes by its making.)"""
    slow_in_kind = _slow_in(kind_ratios, stretch.map(stretch_kind).fillna("compute"))
    share = slow_in_kind[stretch >= 0].groupby(stretch[stretch >= 0]).mean()
    return stretch.where(stretch.map(share).fillna(0.0) >= CHRONIC_SLOW_SHARE, -1)


STRETCH_KINDS = ("compute", "data", "host")
"""The kinds whose own column is searched for chronic stretches that own time hides (a link is
found from its groups' transfers, analysis/links.py)."""


def _with_kind_stretches(
    frame: pd.DataFrame, stretch: pd.Series, kind_excess: pd.DataFrame, kind_ratios: pd.DataFrame
) -> tuple[pd.Series, dict[int, str]]:
    """`stretch` (per rank-step, an own-time chronic stretch's id or -1) with the chronic
    stretches of each of STRETCH_KINDS read in that kind's own column (`_chronic_stretches` of
    its ratio and excess) where they share no step with a stretch of the rank already found;
    and {id: kind} of those added. Own time is the sum of every part, so one part's noise hides
    another's steady excess: an FSDP2 rank sleeping 40 ms in every forward read 0.63-3.7x its
    peer's own time (transfers of 6-216 ms on both ranks, 3 workloads on 2 cores), never
    1.15x over 5 steps, while its compute stood 35-60 ms above its peer's at every step."""
    stretch = stretch.copy()
    found_in: dict[int, str] = {}
    next_id = int(stretch.max()) + 1 if len(stretch) else 0
    for kind in STRETCH_KINDS:
        reading = frame[["rank"]].assign(ratio=kind_ratios[kind], excess=kind_excess[kind])
        found = _chronic_stretches(reading)
        found = found[found >= 0]
        for _, ids in found.groupby(found):
            if (stretch.loc[ids.index] >= 0).any():
                continue
            stretch.loc[ids.index] = next_id
            found_in[next_id] = kind
            next_id += 1
    return stretch, found_in


def refined_onset(ratio: pd.Series, start: int, end: int,
                  excess: pd.Series | None = None) -> int:  # fmt: skip
    """The step where the rank's own-time ratio (indexed by step) shifts up most clearly, near a
    chronic stretch [start, end]: the split that maximises the mean shift times
    sqrt(n_before · n_after / n) (a t-like statistic), searched from 2 × ONSET_WINDOW steps
    before `start` to the last split that leaves CHRONIC_MIN_STEPS // 2 steps after it. A
    rolling window smears the onset by up to half its width, noise just before a fault can join
    its stretch, and the stretch is opened by the rank's own time, which other parts can lift
    long before this part's level changes (8 ranks beside another job: rank 5's own time from
    step 20, its compute 4.3x its peers' from step 33; searched only to start + 10, the split
    read step 30); the split finds the level change itself. A stretch
    with fewer than 3 steps before it keeps the split only when it is a level change: the
    median excess over 1 before the split is under half the median excess after it. Noise in
    the first steps can open a stretch that a later fault continues (two peers' own times
    wander by ±30% here, so a median of three noisy steps can pass any fixed bar), but a rank
    slow from its first steps has no level change to find, and keeps `start`. With `excess`
    (the same part's excess over the peers in seconds, by step), the level must change in it
    too: a rank sleeping 40 ms in every step read as a ratio rising from 1.3x to 2.5x while
    its peer's steps shrank from 148 to 47 ms, and lost its first 5 steps (and its finding).
    The ratio is capped at the stretch's own level (`_capped_at_level`). The excess in seconds
    (capped at the stretch's median) gives the split instead where its rise is the clearer in
    its own noise (`_rise_t`): a loader sleeping 50 ms a step from step 8 read 1.25x its peers'
    own time over steps 8-13, while another job stretched every step to 0.2-0.37 s, and 2.2x
    after; the ratio's split read step 14, the excess rose from ~0 to 50 ms at step 8."""
    ratio = _capped_at_level(ratio.loc[:end], start, end)
    best = _clearest_rise(ratio, start, end)
    if excess is not None:  # the excess in seconds where its rise is the clearer of the two
        in_stretch = np.nanmedian(excess.loc[start:end])
        seconds = excess.loc[:end].clip(upper=in_stretch) if in_stretch > 0 else excess.loc[:end]
        by_seconds = _clearest_rise(seconds, start, end)
        if _rise_t(seconds, by_seconds) > _rise_t(ratio, best):
            best = by_seconds
    if len(ratio.loc[: start - 1]) >= 3:
        return int(best)
    changed = level_change(ratio.loc[: best - 1], ratio.loc[best:])
    if excess is not None:
        changed &= level_change(1.0 + excess.loc[: best - 1], 1.0 + excess.loc[best:end])
    return int(best) if changed else int(start)


def _clearest_rise(series: pd.Series, start: int, end: int) -> int:
    """`refined_onset`'s split of `series` (indexed by step): the one maximising the mean shift
    up times sqrt(n_before · n_after / n), from 2 × ONSET_WINDOW steps before `start`; `start`
    where no split leaves 3 steps before it and CHRONIC_MIN_STEPS // 2 after it."""
    best, best_stat = start, -np.inf
    for candidate in range(start - 2 * ONSET_WINDOW, end + 1):
        before, after = series.loc[: candidate - 1], series.loc[candidate:]
        if len(before) < 3 or len(after) < CHRONIC_MIN_STEPS // 2:
            continue
        n_b, n_a = len(before), len(after)
        stat = (after.mean() - before.mean()) * np.sqrt(n_b * n_a / (n_b + n_a))
        if stat > best_stat:
            best, best_stat = candidate, stat
    return best


def _rise_t(series: pd.Series, split: int) -> float:
    """Welch's t of `series`' rise at `split` (its steps from `split` on against those before):
    how clearly it rose there in its own noise, comparable across series of any unit."""
    before, after = series.loc[: split - 1].dropna(), series.loc[split:].dropna()
    if len(before) < 2 or len(after) < 2:
        return -np.inf
    spread = np.sqrt(before.var() / len(before) + after.var() / len(after))
    rise = after.mean() - before.mean()
    return float(rise / spread) if spread > 0 else (np.inf if rise > 0 else -np.inf)


def _capped_at_level(ratio: pd.Series, start: int, end: int) -> pd.Series:
    """`ratio` (indexed by step) capped at its median over the stretch [start, end]: a split is
    then weighed on the stretch's own scale, where no noisy step outweighs one of the stretch.
    A kind ratio capped at a fixed 3x made a rank 17x slower from step 33 (0.2 s a step on a
    10 ms DDP step) weigh no more than three 2x steps beside the watch's look before it, and
    moved its onset to step 30 in a CI run. Not the median of the stretch's slow steps alone: a
    DDP rank sleeping 0.2 s a step from step 33 read 6x its peer while the peer waited for a
    core (steps 33-39), 27x after; capped at 19x, the split read its onset at step 40."""
    level = np.nanmedian(ratio.loc[start:end])
    return ratio.clip(upper=level) if level > 1.0 else ratio


def level_change(lower, higher) -> bool:
    """Whether a ratio's steps `higher` sit at another level than its steps `lower`: the median
    excess over 1 of `lower` is under half that of `higher` (NaN steps left out)."""
    return bool(np.nanmedian(lower) - 1.0 < 0.5 * (np.nanmedian(higher) - 1.0))


def refined_end(ratio: pd.Series, start: int, end: int) -> int:
    """The last step of a chronic stretch [start, end] before the rank's ratio (indexed by step)
    shifts back down most clearly: `refined_onset`'s mirror, the split maximising the mean
    shift down times sqrt(n_before · n_after / n), searched 2 × ONSET_WINDOW steps either side
    of `end` with at least 3 steps after it, kept only where it is a level change (the median
    excess over 1 after it under half the one from `start` to it). The rolling window and the
    closing of gaps carry a stretch past its last slow step: a rank 1.2-1.44x its one peer's
    compute for 5 steps (its CPU time, beside the watch's look), then at their level, made a
    12-step stretch and a chronic finding. The ratio is capped at the stretch's own level
    (`_capped_at_level`)."""
    ratio = _capped_at_level(ratio.loc[start:], start, end)
    best, best_stat = end, -np.inf
    for candidate in range(max(start, end - 2 * ONSET_WINDOW), end + 2 * ONSET_WINDOW + 1):
        before, after = ratio.loc[:candidate], ratio.loc[candidate + 1 :]
        if before.empty or len(after) < 3:
            continue
        n_b, n_a = len(before), len(after)
        stat = (before.mean() - after.mean()) * np.sqrt(n_b * n_a / (n_b + n_a))
        if stat > best_stat:
            best, best_stat = candidate, stat
    if best_stat == -np.inf:
        return int(end)
    return int(best) if level_change(ratio.loc[best + 1 :], ratio.loc[:best]) else int(end)


CPU_TIME, KERNEL_TIME, OP_TIME, PHASE_TIME = "CPU time", "kernel time", "op time", "time"
"""What a rank's compute was measured as (analysis/diagnosis.py `compute_measure`): the main
thread's CPU time (trainer and `ranktrace run` jobs on CPU), GPU kernels' time (an imported
profiler trace with a GPU timeline), the trace's operations' durations (a per-op trace, a
CPU-only profiler trace), or the host's phase time (a job on GPUs: its phases' wall time)."""


def rank_findings(frame: pd.DataFrame, job_step: pd.Series,
                  compute_measure: str = CPU_TIME) -> list[Straggler]:  # fmt: skip
    """Stragglers of kind compute, data and host (communication is found per group); one per
    rank and kind (transient host: per cause). Chronic when the rank has a chronic stretch of
    that kind (see `_chronic_stretches`; the finding starts with it); else transient: at least
    MIN_STEPS single slow steps of that kind (`_single_steps`).
    `compute_measure`: what compute was measured as, for the evidence's words (CPU_TIME...).
    """
    columns = ["rank", "step", "pp", "dp", "tp", "own_s", "own_s_ref", "own_scale", "host_s",
               "host_s_ref", "core_wait_s", "core_wait_s_ref", "cpu_excess",
               "cpu_ratio"]  # fmt: skip
    kind_columns = [c for column in KIND_COLUMNS.values() for c in (column, f"{column}_ref")]
    frame = frame.join(_cpu_against_peers(frame))
    order = np.lexsort((frame["step"].to_numpy(), frame["rank"].to_numpy()))  # rank, then step
    frame = frame[columns + kind_columns].take(order).reset_index(drop=True)
    ratio = frame["own_s"] / frame["own_s_ref"]
    excess = frame["own_s"] - frame["own_s_ref"]
    kind_excess = pd.DataFrame(
        {kind: frame[column] - frame[f"{column}_ref"] for kind, column in KIND_COLUMNS.items()}
    )
    frame = frame[columns].assign(ratio=ratio, excess=excess,
                                  kind=kind_excess.fillna(-np.inf).idxmax(axis=1))  # fmt: skip
    # Per kind, the own-time ratio the rank would have if only that part of its time differed
    # from its peers': read in the cause's own column, which the noise of the other parts does
    # not blur (a data delay is 0.2 ms before and 50 ms after, while the own-time ratio of two
    # healthy peers wanders by ±30% on a shared machine).
    kind_levels = (1.0 + kind_excess.div(frame["own_s_ref"], axis=0)).clip(lower=0.0)
    kind_ratios = kind_levels.clip(upper=3.0)
    # An own-time stretch not slow in its kind leaves its steps to the kinds' own stretches: a
    # rank whose own time read 1.5-2.7x its peer's by noise from step 6, then 20x from a 0.2 s
    # sleep in every forward over steps 33-50, had one 45-step own-time stretch, slow in its
    # compute at 18 of them, that hid the compute's own 18-step stretch (a live watch, in a
    # timing-loop run): the fault read "transient".
    own = _chronic_stretches(frame)
    own = _chronic_in_kind(own, _stretch_kinds(own, {}, kind_excess), kind_ratios)
    stretch, found_in = _with_kind_stretches(frame, own, kind_excess, kind_ratios)
    stretch_kind = _stretch_kinds(stretch, found_in, kind_excess)
    # the steps where a rank alone was slow, first judged against the noise outside stretches,
    # are no part of the run's noise either (see `_above_the_runs_noise`)
    spikes = _single_steps(frame, kind_excess, kind_ratios, _calm(frame, stretch >= 0))["single"]
    stretch = _above_the_runs_noise(frame, stretch, stretch_kind, kind_ratios, spikes)
    in_stretch = stretch >= 0
    frame = frame.join(
        _single_steps(frame, kind_excess, kind_ratios, _calm(frame, in_stretch | spikes))
    )
    frame["kind"] = frame["step_kind"].where(~in_stretch, stretch.map(stretch_kind))
    evidence = frame[in_stretch | frame["single"]].assign(chronic=in_stretch)
    total_s = job_step.sum()
    findings = []
    kind_ratios.index = pd.MultiIndex.from_frame(frame[["rank", "step"]])
    kind_excess.index = kind_levels.index = kind_ratios.index
    singles, chronic_kinds = [], set()  # single steps judged as transient; chronic (rank, kind)
    for (rank, kind), rows in evidence.groupby(["rank", "kind"], sort=False):
        if not rows["chronic"].any():
            singles.append(rows)
            continue
        chronic_steps = rows.loc[rows["chronic"], "step"]
        level = kind_levels[kind].loc[rank]  # uncapped: each split caps it at its stretch's
        onset = refined_onset(level, chronic_steps.min(), chronic_steps.max(),
                              kind_excess[kind].loc[rank])  # fmt: skip
        end = refined_end(level, onset, chronic_steps.max())
        if end - onset + 1 < CHRONIC_MIN_STEPS:  # its level held too briefly: single steps only
            singles.append(rows[rows["single"]])
            continue
        if kind == "communication":  # a slow link is found from its groups, not here; the
            # stretch's single steps of other kinds are single steps of their own: a pause every
            # 6 steps inside a rank's noisy transfer stretch lost 2 of its 4 steps to it, and
            # was not found (the detection matrix's pause run beside a training job)
            singles.append(rows[rows["single"] & (rows["step_kind"] != kind)])
            continue
        chronic_kinds.add((rank, kind))
        span = rows[rows["step"].between(onset, end)]
        step_up = (
            None
            if kind == "host"
            else escalation(
                span["step"].to_numpy(), span["ratio"].to_numpy(), span["excess"].to_numpy()
            )
        )
        parts = [(span, None)]
        if step_up is not None:  # the same rank slower still from step_up: two findings
            later = span["step"] >= step_up
            parts = [(span[~later], None), (span[later], STEPPED_UP)]
        for part, cause in parts:
            finding = _rank_straggler(part, str(kind), "chronic", job_step, total_s)
            if finding is not None and cause is not None:
                finding = dataclasses.replace(finding, cause=cause)
            if finding is not None:
                finding = _computed_not_waited(finding, frame)
                chronic_kinds.add((rank, finding.kind))  # no transient finding of it beside
            findings += [finding] if finding else []
    # single steps by their own kind (a stretch too brief to be chronic held steps of several:
    # read as its kind, a pause's steps split between host and compute, and none was found)
    steps = pd.concat(singles) if singles else evidence.iloc[:0]
    steps = steps.assign(ratio=steps["step_ratio"], excess=steps["step_excess"])
    peers = PeerSlowSteps(frame[["rank", "pp", "step_ratio"]].assign(
        loose=frame["single"] & ~in_stretch))  # fmt: skip
    steps = steps.assign(step_kind=_computed_steps(steps, frame))
    for (rank, kind), rows in steps.groupby(["rank", "step_kind"], sort=False):
        if kind != "communication" and (rank, kind) not in chronic_kinds:
            findings += _transient_findings(rows, str(kind), job_step, total_s, peers)
    return [_with_evidence(f, frame, kind_ratios, compute_measure) for f in findings]


def _cpu_against_peers(frame: pd.DataFrame) -> pd.DataFrame:
    """Per rank-step, the CPU time of its phases against its peers' reference: `cpu_ratio`
    (NaN where the reference is 0) and `cpu_excess` in seconds; both NaN where no CPU time was
    recorded (GPU jobs, imported traces)."""
    if "work_cpu_s_ref" not in frame:
        return pd.DataFrame({"cpu_ratio": np.nan, "cpu_excess": np.nan}, index=frame.index)
    cpu, reference = frame["work_cpu_s"], frame["work_cpu_s_ref"]
    return pd.DataFrame({"cpu_ratio": cpu / reference.where(reference > 0),
                         "cpu_excess": cpu - reference})  # fmt: skip


COMPUTED_SHARE = 0.5
"""A host finding read as contention is compute where the growth of the rank's CPU time
explains at least this share of its slowdown, in log terms: its own-time ratio to its peers is
its CPU-time ratio times its stretch (wall time per CPU second, against theirs), and a rank
that computes more keeps its share of a shared core (stretch ~1: its waits grow with its CPU
time), while a rank whose core is taken gets less of it (stretch > 1, CPU time near its
peers'). Half: whichever factor is the larger. Measured over the finding's steps (medians): two
ranks computing 20-45 ms more a step, 0.93 and 2.2 (loop28: tests/data/spin-beside-its-core-
waits, spin-read-as-a-busy-core); ranks on a core two busy processes shared, 0.00-0.30, the
largest a rank whose CPU time itself rose 1.19x beside them (1.79x its peer's own time: loop30
run 1, tests/data/busy-core-cpu-inflated)."""


def _computed_not_waited(finding: Straggler, frame: pd.DataFrame) -> Straggler:
    """A host finding read as contention (its wall time above its peers', its CPU time not:
    what its evidence says) is compute where its rank's CPU time grew with its wall time over
    the finding's steps (`_computed`)."""
    if finding.kind != "host" or finding.cause != "contention":
        return finding
    steps = finding.steps or range(finding.first_step, finding.last_step + 1)
    if not _computed(frame, finding.rank, steps):
        return finding
    return dataclasses.replace(finding, kind="compute", cause=None)


def _computed_steps(steps: pd.DataFrame, frame: pd.DataFrame) -> pd.Series:
    """The kinds of a rank's single slow steps (`step_kind`), its steps of host contention
    read as compute where its CPU time grew with its wall time over them (`_computed`): one
    transient finding of its compute, never a second one beside it. (A slow rank's steps split
    between the two kinds, each step by its larger excess: the FSDP2 job's rank computing 40 ms
    more a step had 3 steps of compute and 7 of contention, and the contention turned compute
    made a second compute finding of that rank: loop31 run 1.)"""
    kinds = steps["step_kind"].copy()
    contention = (kinds == "host") & (_host_causes(steps) == "contention")
    for rank, rows in steps[contention].groupby("rank", sort=False):
        if _computed(frame, rank, rows["step"]):
            kinds.loc[rows.index] = "compute"
    return kinds


def _computed(frame: pd.DataFrame, rank: int, steps) -> bool:
    """Whether `rank`'s excess over its peers at `steps` is its computing more rather than its
    waiting for a core: its CPU time's growth explains COMPUTED_SHARE of its slowdown or more,
    by ≥ MIN_EXCESS_S a step (a healthy Lightning job's CPU time of 2-4 ms a step was 1.5x its
    peer's by one millisecond), at the median of the steps. A rank that computes more waits more
    for a shared core too (the kernel's fair scheduler runs the hungrier task less), and those
    waits can outweigh the computing that caused them: an FSDP2 job's rank computing 40 ms more
    a step (its CPU time 2.4x its peer's) waited 0.08-0.23 s more for a core at four steps
    beside a timing loop's job and read "host, contention, transient"; a Lightning job's rank
    computing 20 ms more, "host, contention, chronic" (loop28 runs 1 and 2). A rank whose core
    is taken computes a little more too (its caches shared): 1.19x its peer's CPU time beside two
    busy processes, 1.79x its own time (loop30 run 1, read compute by a rule of CPU time >=
    1.15x its peers')."""
    rows = frame.loc[(frame["rank"] == rank) & frame["step"].isin(steps)]
    cpu_ratio, cpu_excess = rows["cpu_ratio"].median(), rows["cpu_excess"].median()
    own_ratio = rows["ratio"].median()
    if not (cpu_excess >= MIN_EXCESS_S and cpu_ratio > 1.0 and own_ratio > 1.0):
        return False  # NaN (no CPU times) included
    return bool(np.log(cpu_ratio) >= COMPUTED_SHARE * np.log(own_ratio))


STEPPED_UP = "stepped up"
"""The cause of the later part of a chronic stretch that `escalation` split: the same rank
slower still from that step (the earlier part, its own finding where material)."""
ESCALATION_T = 4.0
"""A chronic stretch splits where the rank's own-time ratio to its peers steps up by at least
this many standard errors (Welch's t, each side's own step-to-step spread: the run's noise)...
"""
ESCALATION_MIN_STEPS = CHRONIC_MIN_STEPS // 2
"""...with this many steps on each side..."""


def escalation(steps: np.ndarray, ratio: np.ndarray,
               excess: np.ndarray | None = None) -> int | None:  # fmt: skip
    """The step where a chronic stretch's ratio (`ratio` per step of `steps`, in order) steps up
    most clearly, where it does: the split that maximises Welch's t, at least ESCALATION_T,
    and a level change by refined_onset's rule (the median excess over 1 before it under half
    the one after); with `excess` (the rank's excess over its peers in seconds, per step), a
    level change in it too. Else None: one level. A rank slowed ~2x by another job on its core
    from step 11, then by a fault from step 33, was one finding from step 11 (the fault's onset
    lost). A ratio that rose only because its peer's time fell is one level: a DDP rank
    sleeping 0.2 s a step from step 33 read 6.4x its peer while the peer waited for a core
    (steps 33-39, beside another pytest worker), 27x after, its excess 0.20-0.23 s throughout;
    split there, its chronic finding began at step 40."""
    n = len(ratio)
    best, best_t = None, ESCALATION_T
    for i in range(ESCALATION_MIN_STEPS, n - ESCALATION_MIN_STEPS + 1):
        before, after = ratio[:i], ratio[i:]
        spread = np.sqrt(before.var(ddof=1) / len(before) + after.var(ddof=1) / len(after))
        t = (after.mean() - before.mean()) / spread if spread > 0 else 0.0
        if t > best_t:
            best, best_t = i, t
    if best is None or not level_change(ratio[:best], ratio[best:]):
        return None
    if excess is not None and not level_change(1.0 + excess[:best], 1.0 + excess[best:]):
        return None
    return int(steps[best])


KIND_WORDS = {"data": "data loading", "host": "time outside every phase and collective"}


def kind_words(kind: str, compute_measure: str = CPU_TIME) -> str:
    """A kind of excess, in words, compute's with what it was measured as."""
    if kind == "compute":
        return f"compute (its {compute_measure} in forward, backward and the optimizer)"
    return KIND_WORDS[kind]


def _with_evidence(finding: Straggler, frame: pd.DataFrame, kind_ratios: pd.DataFrame,
                   compute_measure: str) -> Straggler:  # fmt: skip
    """`finding` with the comparison that found it, in words."""
    stage = frame.loc[frame["rank"] == finding.rank, "pp"].iloc[0]
    peers = sorted(int(r) for r in frame.loc[frame["pp"] == stage, "rank"].unique()
                   if r != finding.rank)  # fmt: skip
    steps = finding.steps or list(range(finding.first_step, finding.last_step + 1))
    mine = kind_ratios.loc[finding.rank, finding.kind]
    ratio = float(mine[mine.index.isin(steps)].median())
    own_ratio = finding.slowdown  # a chronic finding's: its own time's
    if finding.steps:  # a transient one's steps may be read in their kind (`_single_steps`)
        mine_own = frame[(frame["rank"] == finding.rank) & frame["step"].isin(steps)]
        own_ratio = float(mine_own["ratio"].median())
    span = (f"in {finding.slow_steps} slow steps from {finding.first_step} to "
            f"{finding.last_step}" if finding.steps else
            f"from step {finding.first_step} to {finding.last_step}")  # fmt: skip
    why = {"contention": ": waiting for a core (its wall time grew, its CPU time did not)",
           "pause": ": pauses outside every phase and collective",
           STEPPED_UP: f", a step up from the level it held before step {finding.first_step}"
           }.get(finding.cause or "", "")  # fmt: skip
    lines = [
        f"its own time (the step less its waits for others) {own_ratio:.2f}x the median "
        f"of its stage's other ranks ({', '.join(map(str, peers))}) {span}",
        f"the excess is in its {kind_words(finding.kind, compute_measure)}, which alone makes "
        f"it {ratio:.2f}x "
        f"them{why}",
    ]
    return dataclasses.replace(finding, evidence=lines)


TRANSIENT_CHANCE = 0.05
"""A rank's scattered slow steps make a transient finding only where so many so slow are
unlikely (binomial tail ≤ 5%) had the rank been, at each of its steps, as likely as its stage's
other ranks were to be a single slow step at least as slow as its least slow one
(`PeerSlowSteps.more_than_chance`). Measured on recorded runs (tests/data): a healthy 4-rank
DDP job's rank 1, 1.49-1.7x in compute at 3 of 11 steps, its peers that slow at 5 of their 33
on a crowded host, 0.23 (named "compute, transient", cost 6.3%: a timing-loop run of
test_a_healthy_job_has_no_finding, ddp-healthy-crowded); noise in two other runs, 0.32 and
0.90; real pauses, 4 of 29 steps, 0.017 (peers that slow at 3 of 87 steps,
pause-beside-a-transfer-stall) and 0.0003 or less in three more. Counted at any slowness (a
first try), a pause run's peers were single slow steps at 7 of 87 (transfer noise at
1.35-1.49x), 0.2, and its pauses were lost (pause-in-a-noisy-link-stretch)."""


@dataclass
class PeerSlowSteps:
    """The single slow steps (outside chronic stretches) of every rank of a run, to judge one
    rank's against its stage's other ranks'."""

    frame: pd.DataFrame
    """Per rank-step: rank, pp, `loose` (a single slow step outside any stretch) and
    `step_ratio` (its slowdown in its own reading)."""

    def more_than_chance(self, rank: int, ratios: pd.Series) -> bool:
        """Whether a rank's slow steps with slowdowns `ratios` are more than chance gives (see
        TRANSIENT_CHANCE): P(Binomial(its steps, p) ≥ len(ratios)) ≤ TRANSIENT_CHANCE, p the
        share of its stage's other ranks' rank-steps that were loose slow steps at least
        min(ratios) slow."""
        mine = self.frame["rank"] == rank
        stage = self.frame["pp"] == self.frame.loc[mine, "pp"].iloc[0]
        peers = self.frame[stage & ~mine]
        if peers.empty:
            return True
        rate = float((peers["loose"] & (peers["step_ratio"] >= ratios.min())).mean())
        steps, slow = int(mine.sum()), len(ratios)
        below = sum(math.comb(steps, k) * rate**k * (1.0 - rate) ** (steps - k)
                    for k in range(slow))  # fmt: skip
        return 1.0 - below <= TRANSIENT_CHANCE


def _transient_findings(rows: pd.DataFrame, kind: str, job_step: pd.Series, total_s: float,
                        peers: PeerSlowSteps) -> list[Straggler]:  # fmt: skip
    """Transient findings over a rank's scattered slow steps of one kind: one per cause, each
    with at least MIN_STEPS steps, more than its peers' slow steps make by chance
    (`PeerSlowSteps.more_than_chance`). Host steps of different causes are not one finding: a
    rank pausing every 6 steps that also waited for a core in one step between (a busy
    machine) has a pause from the first pause on, not from the wait."""
    by_cause = rows.groupby(_host_causes(rows)) if kind == "host" else [(None, rows)]
    findings = []
    for _, steps in by_cause:
        if len(steps) >= MIN_STEPS and peers.more_than_chance(steps["rank"].iloc[0],
                                                               steps["ratio"]):  # fmt: skip
            finding = _rank_straggler(steps, kind, "transient", job_step, total_s)
            findings += [finding] if finding else []
    return findings
