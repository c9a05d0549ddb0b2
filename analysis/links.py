"""Slow links: communication stragglers found from the transfer time of every process group at
every step (table `group_transfers`), not from one rank's own time.

A bad link (a slow NIC, a congested port) raises the transfer time of every group the rank
takes part in, for all of that group's members, so one group's timing cannot tell which member
is at fault. Per axis, each group's transfer per call is compared with the other groups of that
axis at the same step:
- a group is slow at a step when its transfer per call is ≥ LINK_SLOWDOWN × theirs (and ≥ MAD_K
  deviations and MIN_EXCESS_S above); chronically slow when slow in most steps from its onset,
  clear of its own step-to-step noise from then on (`_one_slowness` of the group alone, the
  error from the steps' effective number, `effective_steps`) and, where BASELINE_STEPS came
  before the onset, ≥ CONFIRM_SLOWDOWN × its own level before it (`_rose_at`);
- a rank in chronically slow groups of two or more axes is the culprit where those of them that
  show one slowness (`_one_slowness`: clear of their noise from the earliest of their onsets)
  still span two axes (a group also holding a rank already found slow in its own time is not
  evidence against the others where that rank's lateness can raise the group's transfer: it
  would raise every group it is in, so it is ruled out only where its groups on other axes,
  without the others, are at their axes' pace: a compute straggler x2.6 beside a slow link, its
  other group at 0.47x while the link's two groups were 2.1x and 2.5x,
  benchmarks/two_faults.py);
- a chronically slow group with neither such a rank nor one slow in its own time: each
  member's groups on the other axes are looked at from the onset on; when exactly one member's
  are elevated (median ≥ CONFIRM_SLOWDOWN × the other groups' and CONFIRM_T standard errors
  clear of the group's own step-to-step noise, and, where BASELINE_STEPS came
  before the onset, ≥ CONFIRM_SLOWDOWN × their own level before it, and showing one slowness
  with the group), that member is the culprit, else the members are reported as candidates;
- transient: steps where the slow groups of two or more axes share exactly one rank, more of
  them than chance gives (`_beyond_chance`); from a chronic finding's onset, a group holding
  its rank (or one of its candidates) is its, not evidence against the group's other members.
The onset is where the slow groups' transfer ratio shifts up most clearly (a change point).
"""

from __future__ import annotations

import dataclasses
import math

import duckdb
import numpy as np
import pandas as pd

from ranktrace.analysis.peers import WARMUP_STEPS, peer_references
from ranktrace.analysis.stragglers import (
    MAD_K,
    MIN_EXCESS_S,
    MIN_STEPS,
    ONSET_WINDOW,
    Straggler,
    chronic_pattern,
    is_material,
    refined_onset,
)

LINK_SLOWDOWN = 1.5
"""A group is slow at a step when its transfer per call is ≥ 1.5× its axis's other groups'."""
CONFIRM_SLOWDOWN = 1.2
"""A candidate's group on another axis confirms it when its median transfer ratio from the
onset on is ≥ 1.2 (the other candidates' groups staying below): a weaker bar than
LINK_SLOWDOWN, applied only where one slow group already points at the candidates."""
CONFIRM_T = 3.0
"""...and only when that median stands clear of the group's own step-to-step spread: the median
of its log ratio over the steps is at least 3 standard errors above 0 (the error from the
steps' own MAD, the run's noise). Beside another pytest worker, rank 1's tp group read a median
1.21x (0.24-4.1x step to step, 15 of 22 steps above 1) while only its dp link was slow: it
blamed rank 1 where nothing separated it from rank 3 (1.4 standard errors)."""
BASELINE_STEPS = 3
"""Steps before the onset (after the warm-up) that let a group's own level before it be
compared with its level after; with fewer, a confirming group is judged against its axis only."""
RATIO_CAP = 3.0
"""Transfer ratios are capped at 3 for change points (microsecond transfers give ratios of 10+)."""

Group = tuple[str, tuple[int, ...]]
"""(axis, member ranks)."""


def group_ratios(groups: pd.DataFrame) -> pd.DataFrame:
    """Every row of `group_transfers` (with a `link_group` id per (axis, members)) with
    `members` as a tuple of ints, `reference` (the axis's other groups' transfer at that step,
    scaled to this group's calls), `ratio`, `excess` (seconds over the reference) and `slow`
    (see the module docstring).

    Per call, because groups of one axis make different numbers of calls (the first and last
    pipeline stages' tp groups also reduce the embedding and the loss).
    """
    calls = groups["calls"].to_numpy(dtype=float)
    per_call = groups["transfer_s"].to_numpy(dtype=float) / calls
    keys = groups.groupby(["step", "axis"], sort=False).ngroup().to_numpy()
    reference, scale = peer_references(per_call, keys)
    excess = (per_call - reference) * calls
    slow = (
        (per_call >= LINK_SLOWDOWN * reference)
        & (per_call - reference >= MAD_K * np.nan_to_num(scale))
        & (excess >= MIN_EXCESS_S)
    )
    firsts = groups.drop_duplicates("link_group")  # one row per group: tuples made once each
    members = dict(
        zip(
            firsts["link_group"],
            firsts["members"].map(lambda m: tuple(int(r) for r in m)),
            strict=True,
        )
    )
    with np.errstate(divide="ignore", invalid="ignore"):  # a group with no transfer: inf/NaN
        ratio = per_call / reference
    return groups.assign(
        members=groups["link_group"].map(members),
        reference=reference * calls,
        ratio=ratio,
        excess=excess,
        slow=slow,
    )


def net_of_core_wait(groups: pd.DataFrame) -> pd.DataFrame:
    """`groups` (rows of `group_transfers`) with `transfer_s` less the members' wait for a core
    inside the calls (`transfer_net_s`), where recorded (CPU ranks; a store written before it
    reads NULL there, a table built by hand may lack it). Links are judged net of that wait, as
    compute is: with a neighbour job on 2 cores, a healthy pp pair's transfers read 1.25 and
    2.38 ms against its axis's 0.31 and 0.39 ms, of which 1.79 and 2.05 ms were waits for a
    core (a false pp link, in a loop run)."""
    if "transfer_net_s" not in groups:
        return groups
    return groups.assign(transfer_s=groups["transfer_net_s"].fillna(groups["transfer_s"]))


def _rows_of(table: pd.DataFrame, keys: list[Group]) -> pd.DataFrame:
    """The rows of `table` that belong to the groups `keys` (matched once per group)."""
    wanted = set(keys)
    firsts = table.drop_duplicates("link_group")
    ids = [g for g, a, m in zip(firsts["link_group"], firsts["axis"], firsts["members"],
                                strict=True) if (a, m) in wanted]  # fmt: skip
    return table[table["link_group"].isin(ids)]


def _onset(table: pd.DataFrame, keys: list[Group], first: int) -> int:
    """Where the groups' mean (capped) transfer ratio shifts up most clearly near `first`, their
    chronic onset: searched over the steps up to 2 × ONSET_WINDOW after it (`refined_onset`
    looks as far before it). A group's chronic onset comes from its own slow steps, not from
    another part's stretch (why a rank's search runs to its stretch's end), so its level
    change lies near it. Searched to the run's end, rank 1's dp link slow from step 8 (its
    group 6.7-123x its peer in 17 of 22 steps, low at 5 steps among the first 12, where the
    delay fell inside a wait for late peers) split at step 20, where every step after is
    slow; its cost over steps 20-29 fell under 5% and the link went unreported (loop22 run 7)."""
    rows = _rows_of(table, keys)
    ratio = rows["ratio"].clip(0.0, RATIO_CAP).groupby(rows["step"]).mean()
    return refined_onset(ratio, first, min(int(ratio.index.max()), first + 2 * ONSET_WINDOW))


def _confirmed(
    table: pd.DataFrame,
    group: Group,
    onset: int,
    slow_ranks: set[int],
    chronic,
    groups: set[Group],
) -> tuple[int, list[Group]] | None:
    """The one member of a chronically slow `group` whose groups on other axes are elevated
    from `onset` on (with those groups), or None when no single member stands out. A group
    holding another rank already found slow (`slow_ranks`) confirms nothing where that rank's
    lateness can raise the group's transfer time (`_lateness_explains`; `chronic`: the
    chronically slow groups, `groups`: every group)."""
    later = table[table["step"] >= onset]
    medians = later.groupby(["axis", "members"])["ratio"].median()
    clear = _clear_of_noise(later)
    rose = _rose_at(table, onset)
    elevated = {}
    for rank in group[1]:
        mine = [
            k
            for k in medians.index
            if k[0] != group[0]
            and rank in k[1]
            and not _lateness_explains(k, slow_ranks, groups, chronic, beside=rank)
        ]
        if mine and all(medians[k] >= CONFIRM_SLOWDOWN and clear[k] and rose.get(k, True)
                        for k in mine) and _one_slowness(table, [group, *mine], chronic) == [
                group, *mine]:  # fmt: skip
            elevated[rank] = mine
    if len(elevated) != 1:
        return None
    ((rank, keys),) = elevated.items()
    return rank, keys


def _clear_of_noise(rows: pd.DataFrame) -> pd.Series:
    """Per group of `rows` (rows of the link table): whether the median of its log transfer
    ratio over the steps is ≥ CONFIRM_T standard errors above 0, the error estimated from the
    steps themselves (1.2533 · 1.4826 · MAD / √n, a median's error under normal noise), n the
    steps' effective number (`effective_steps`): a neighbour's burst of contention holds for
    several steps, and steps that move together are fewer samples than steps."""
    rows = rows.sort_values("step")
    keys = [rows["axis"], rows["members"]]
    log_ratio = np.log(rows["ratio"].clip(lower=1e-9))
    median = log_ratio.groupby(keys).median()
    mad = (log_ratio - log_ratio.groupby(keys).transform("median")).abs().groupby(keys).median()
    count = log_ratio.groupby(keys).agg(effective_steps)
    error = 1.2533 * 1.4826 * mad / np.sqrt(count)
    return median >= CONFIRM_T * error


def effective_steps(series: pd.Series) -> float:
    """The number of independent samples a series of per-step values (in step order) is worth:
    n (1 - ρ) / (1 + ρ), ρ its lag-1 autocorrelation (negative taken as 0), values beyond 3
    MADs clipped first so that one outlying step does not set ρ. A healthy tp group beside a
    rank's pauses read 1.65x its peer over 18 steps (3.4 standard errors by n), but its slow
    steps came in a run of five at 3.2-8.6x: ρ 0.59, 1.7 standard errors (a false link)."""
    values = series.to_numpy(dtype=float)
    n = len(values)
    if n < 3:
        return float(n)
    center = np.median(values)
    spread = 3 * 1.4826 * np.median(np.abs(values - center))
    centred = np.clip(values, center - spread, center + spread)
    centred = centred - centred.mean()
    power = float((centred * centred).sum())
    rho = float((centred[1:] * centred[:-1]).sum()) / power if power > 0 else 0.0
    rho = min(max(rho, 0.0), 0.9)
    return n * (1 - rho) / (1 + rho)


def _one_slowness(table: pd.DataFrame, keys: list[Group],
                  onsets: dict[Group, int]) -> list[Group]:  # fmt: skip
    """The groups of `keys` that show one slowness: those clear of their own noise
    (`_clear_of_noise`) from the earliest onset among them (`onsets`: the chronically slow
    groups'). A bad link slows every group of its rank from one step on; a group slow only
    from later on is another slowness, no evidence that the rank the two share is at fault.
    In a stored detection run whose only fault was rank 1's dp link from step 8, rank 1's tp
    group read 0.6-3.6x its axis's other group, >= 1.5x in 9 of the 15 steps from step 15:
    4.1 standard errors clear of its noise from there, 1.8 from step 8. A CI run beside
    another pytest worker, where such a group counted as a second slow axis, blamed rank 1
    where nothing separated it from rank 3."""
    first = min(onsets[k] for k in keys if k in onsets)
    rows = _rows_of(table, keys)
    clear = _clear_of_noise(rows[rows["step"] >= first])
    return [k for k in keys if bool(clear.get(k, False))]


def _rose_at(table: pd.DataFrame, onset: int) -> dict[Group, bool]:
    """Per group with BASELINE_STEPS before `onset`: whether its own transfer per call from
    the onset on is ≥ CONFIRM_SLOWDOWN × before it. A group is elevated against its axis's
    others also when they got faster at the onset: the link fault's sleeps on one rank gave
    the cores it shared back to its other group, whose transfers fell to 0.82x while the
    suspect's stayed at 1.02x its own (a wrong rank blamed for a one-axis link, in CI here)."""
    per_call = table["transfer_s"] / table["calls"]
    early = table["step"] < onset
    before = per_call[early].groupby([table["axis"][early], table["members"][early]])
    after = per_call[~early].groupby([table["axis"][~early], table["members"][~early]])
    counts, before_median, after_median = before.size(), before.median(), after.median()
    return {
        key: bool(after_median[key] >= CONFIRM_SLOWDOWN * before_median[key])
        for key in after_median.index
        if counts.get(key, 0) >= BASELINE_STEPS and before_median[key] > 0
    }


def _lateness_explains(group: Group, slow_ranks: set[int], groups: set[Group], chronic,
                       beside: int | None = None) -> bool:  # fmt: skip
    """Whether a rank of `group` found slow in its own time (`slow_ranks`; not `beside`, the
    member under suspicion) can explain the group's slow transfers. Its lateness would raise
    every group it is in, so it can unless its groups on the other axes (those not holding
    `beside`) are all outside `chronic`, the chronically slow groups; where it has no such
    group, nothing tells, and it can."""
    for slow in (set(group[1]) & slow_ranks) - {beside}:
        others = [g for g in groups
                  if g[0] != group[0] and slow in g[1] and beside not in g[1]]  # fmt: skip
        if not others or any(g in chronic for g in others):
            return True
    return False


def _link_straggler(
    candidates: tuple[int, ...],
    rows: pd.DataFrame,
    pattern: str,
    job_step: pd.Series,
    frame: pd.DataFrame,
) -> Straggler | None:
    """One communication finding from its groups' rows that are above their reference, if
    material. Per step, its excess is the sum over axes of its slowest group's excess."""
    rows = rows[rows["excess"] > 0]
    if rows.empty:
        return None
    per_step = rows.groupby(["step", "axis"])["excess"].max().groupby("step").sum()
    ratio = (rows["transfer_s"] / rows["reference"]).groupby(rows["step"]).max()
    return communication_straggler(candidates, per_step, float(ratio.median()),
                                   rows.groupby("axis")["excess"].sum(), pattern, job_step,
                                   frame)  # fmt: skip


def communication_straggler(
    candidates,
    per_step: pd.Series,
    slowdown: float,
    axis_excess: pd.Series,
    pattern: str,
    job_step: pd.Series,
    frame: pd.DataFrame,
    **extra,
) -> Straggler | None:
    """A communication finding from its excess per step (seconds over its reference, indexed
    by step), its slowdown and its excess per axis, if material; the job's step time less that
    excess is its what-if. `extra`: further Straggler fields (a slow node's `cause`, `hosts`)."""
    actual = job_step.reindex(per_step.index).to_numpy()
    whatif = np.maximum(actual - per_step.to_numpy(), 0.0)
    cost_pct = 100.0 * float((actual - whatif).sum()) / job_step.sum()
    if not is_material(pattern, cost_pct, slowdown):
        return None
    single = candidates[0] if len(candidates) == 1 else None
    coords = frame.loc[frame["rank"] == single].iloc[:1] if single is not None else frame.iloc[:0]
    located = single is not None and not coords.empty
    return Straggler(
        rank=single, kind="communication", axis=str(axis_excess.idxmax()),
        first_step=int(per_step.index.min()), last_step=int(per_step.index.max()),
        slowdown=round(slowdown, 3), cost_pct=round(cost_pct, 2), pattern=pattern,
        slow_steps=len(per_step), step_time_s=float(np.median(actual)),
        whatif_step_time_s=float(np.median(whatif)), candidates=list(candidates),
        axes=sorted(axis_excess.index),
        pp=int(coords["pp"].iloc[0]) if located else None,
        dp=int(coords["dp"].iloc[0]) if located else None,
        tp=int(coords["tp"].iloc[0]) if located else None,
        steps=sorted(int(s) for s in per_step.index) if pattern == "transient" else [], **extra,
    )  # fmt: skip


def _link_evidence(finding: Straggler, keys: list[Group], located: str | None,
                   frame: pd.DataFrame, run_id: str) -> Straggler:  # fmt: skip
    """`finding` with how its slow groups located it (`located`: "common", one rank in slow
    groups of two axes; "confirmed", the one member of a slow group whose other groups are
    elevated; None, not located: its members are candidates, on their hosts)."""
    groups = "; ".join(f"{axis} group of ranks {', '.join(map(str, members))}"
                       for axis, members in keys)  # fmt: skip
    slow = (f"slow groups ({groups}): transfer per call {finding.slowdown:.2f}x their axis's "
            f"other groups' from step {finding.first_step}")  # fmt: skip
    if located == "common":
        lines = [slow, f"rank {finding.rank} is the one rank common to slow groups of "
                       f"{len({a for a, _ in keys})} axes"]  # fmt: skip
        return dataclasses.replace(finding, evidence=lines)
    if located == "confirmed":
        lines = [slow, f"of the slow group's members, only rank {finding.rank}'s groups on the "
                       f"other axes are elevated too (>= {CONFIRM_SLOWDOWN}x)"]  # fmt: skip
        return dataclasses.replace(finding, evidence=lines)
    hosts = sorted({h for h in frame.loc[frame["rank"].isin(finding.candidates), "host"]
                    .dropna().unique() if h})  # fmt: skip
    lines = [slow, "its members' groups on the other axes single none out: nothing in the "
                   f"timing separates them; `ranktrace probe --for {run_id}` measures each "
                   "pair's bandwidth"]  # fmt: skip
    return dataclasses.replace(finding, evidence=lines, candidate_hosts=hosts)


def _chronic_groups(slow: pd.DataFrame) -> dict[Group, int]:
    """Group -> its onset, for the groups slow in most steps from their onset on."""
    onsets = {}
    for key, rows in slow.groupby(["axis", "members"]):
        steps = sorted(rows["step"].tolist())
        if len(steps) >= MIN_STEPS:
            pattern, first = chronic_pattern(steps)
            if pattern == "chronic":
                onsets[key] = first
    return onsets


TRANSIENT_ALPHA = 0.01
"""A transient link's shared slow steps must be this unlikely (Poisson tail) were its groups
slow independently of each other, each as often as it is: a link failing at the same 3 of 30
steps on both of its rank's groups gives 0.004 (found); the pause run's noise, rank 3's groups
slow in 6 and 8 of 29 steps sharing 4, gave 0.09. A real link's few slow steps among many noisy
ones are not told from chance, and not reported."""


def _beyond_chance(mine: pd.DataFrame, steps: int, shared: int) -> bool:
    """Whether `shared` steps where a rank's groups on two or more axes were slow at once are
    more than its groups (`mine`: their slow rows, over `steps` steps), each slow as often as
    there, make by chance (P <= TRANSIENT_ALPHA under independence): a bad link slows its
    groups at the same steps, noise at any."""
    rates = mine.groupby("axis")["step"].nunique().to_numpy() / steps
    if len(rates) < 2:
        return True
    none = np.prod(1 - rates)
    one = sum(r * np.prod(np.delete(1 - rates, i)) for i, r in enumerate(rates))
    expected = steps * (1 - none - one)  # steps with two or more of its groups slow
    below = sum(math.exp(-expected) * expected**k / math.factorial(k) for k in range(shared))
    return 1.0 - below <= TRANSIENT_ALPHA


def _common_rank_steps(slow: pd.DataFrame, reported: set[int]) -> dict[int, list[int]]:
    """Rank -> the steps where it is the one rank common to the slow groups of every slow axis
    (two or more), `reported` ranks left out."""
    members = slow[["step", "axis", "members"]].explode("members")
    members = members.drop_duplicates().astype({"members": "int64"})
    axes = slow.groupby("step")["axis"].nunique()
    in_all = members.groupby(["step", "members"])["axis"].size()
    steps = in_all.index.get_level_values("step")
    common = in_all[
        (in_all.to_numpy() == axes.reindex(steps).to_numpy()) & (in_all.to_numpy() >= 2)
    ]
    common = common.reset_index()
    single = common.groupby("step")["members"].transform("size") == 1
    common = common[single & ~common["members"].isin(reported)]
    return {int(rank): sorted(int(s) for s in rows["step"])
            for rank, rows in common.groupby("members")}  # fmt: skip


def link_findings(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    frame: pd.DataFrame,
    job_step: pd.Series,
    slow_ranks: set[int],
) -> list[Straggler]:
    """Communication stragglers of run `run_id` (see the module docstring); `frame` gives the
    ranks' coordinates, `job_step` the job's step times for the cost, `slow_ranks` the ranks
    already found slow in their own time (compute, data, host)."""
    groups = con.execute(
        "SELECT *, dense_rank() OVER (ORDER BY axis, members) AS link_group FROM group_transfers "
        "WHERE run_id = ? AND step >= ?",
        [run_id, WARMUP_STEPS],
    ).df()
    if groups.empty:
        return []
    table = group_ratios(net_of_core_wait(groups))
    slow = table[table["slow"]]
    # chronic groups clear of their own noise: a healthy tp group at 0.5-8.6x step to step
    # beside another job (1.2 standard errors from it) was a link of ranks 2 and 3 from step 14;
    # and slower than before their onset (`_rose_at`), not only than their axis: a healthy tp
    # group read 3.4x its peer from step 19 because that peer's transfers fell to a third
    # (a neighbour's load moved), its own staying at 1.0x its level before (a false link)
    onsets = {key: first for key, first in _chronic_groups(slow).items()
              if _one_slowness(table, [key], {key: first})
              and _rose_at(table, first).get(key, True)}  # fmt: skip
    groups = set(table.drop_duplicates("link_group")[["axis", "members"]].itertuples(
        index=False, name=None))  # fmt: skip
    counted: dict[int, list[Group]] = {}  # rank -> its chronic groups its lateness explains not
    for axis, members in onsets:
        for rank in members:
            if not _lateness_explains((axis, members), slow_ranks, groups, onsets, beside=rank):
                counted.setdefault(rank, []).append((axis, members))
    culprits = {}  # rank -> the groups that show it: of one slowness, on two or more axes
    for rank, keys in counted.items():
        shown = _one_slowness(table, keys, onsets) if len({a for a, _ in keys}) >= 2 else []
        if len({axis for axis, _ in shown}) >= 2:
            culprits[rank] = shown
    how = {rank: "common" for rank in culprits}  # how each culprit was located
    unlocated = []
    for key in onsets:
        if set(key[1]) & set(culprits) or _lateness_explains(key, slow_ranks, groups, onsets):
            continue  # located, or explained by a slow rank's lateness
        confirmed = _confirmed(table, key, onsets[key], slow_ranks, onsets, groups)
        if confirmed and confirmed[0] not in culprits:
            culprits[confirmed[0]] = [key, *confirmed[1]]
            how[confirmed[0]] = "confirmed"
        elif not confirmed:
            unlocated.append(key)
    findings = []
    for candidates, keys in [((r,), keys) for r, keys in culprits.items()] + [
        (key[1], [key]) for key in unlocated
    ]:
        chronic_keys = [k for k in keys if k in onsets]
        first = sorted(onsets[k] for k in chronic_keys)[len(chronic_keys) // 2]
        onset = _onset(table, chronic_keys, first)
        rows = _rows_of(table, keys)
        finding = _link_straggler(candidates, rows[rows["step"] >= onset], "chronic", job_step,
                                  frame)  # fmt: skip
        if finding:
            located = how.get(candidates[0]) if len(candidates) == 1 else None
            findings.append(_link_evidence(finding, chronic_keys, located, frame, run_id))
    # One slowness, one finding: a rank already named (a culprit) or among the candidates of a
    # chronically slow group gets no transient finding from the same groups' slow steps, and
    # from its onset a group holding one is explained by it, evidence against none of its
    # other members (a 4-node run's node-1 egress named rank 0 from its dp group with rank 1
    # beside a noisy sub-millisecond pipeline transfer).
    since = {rank: min(onsets[k] for k in keys if k in onsets) for rank, keys in culprits.items()}
    for key in unlocated:
        for rank in key[1]:
            since[rank] = min(since.get(rank, onsets[key]), onsets[key])
    explained = np.array([any(step >= since.get(rank, np.inf) for rank in members)
                          for step, members in zip(slow["step"], slow["members"], strict=True)],
                         dtype=bool)  # fmt: skip
    unexplained = slow[~explained]
    reported = set(since)
    analysed = table["step"].nunique()
    for rank, steps in _common_rank_steps(unexplained, reported).items():
        if len(steps) < MIN_STEPS:
            continue
        has_rank = unexplained["members"].map(lambda members, rank=rank: rank in members)
        if not _beyond_chance(unexplained[has_rank], analysed, len(steps)):
            continue
        rows = unexplained[unexplained["step"].isin(steps) & has_rank]
        finding = _link_straggler((rank,), rows, "transient", job_step, frame)
        if finding:
            line = (f"in {len(steps)} steps the slow groups of two or more axes share one "
                    f"rank, {rank}: its transfers {finding.slowdown:.2f}x their axes' other "
                    "groups'")  # fmt: skip
            findings.append(dataclasses.replace(finding, evidence=[line]))
    return findings
