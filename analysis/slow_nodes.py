"""Slow nodes: a NIC that sends (or receives) slowly, located from which transfers slow down.

A rate limit on a node's interface slows every transfer whose traffic leaves that node (egress)
or enters it (ingress), for every member of the transfer, and nothing that stays inside a node:
- units: each collective group (its members send and receive: ring algorithms) and each
  pipeline direction src → dst (a pure send or recv moves data one way; a batched send+recv
  both ways), of a kind (`dp`, `pp>` one way, `pp<>` both ways); only units crossing hosts;
- a unit's egress nodes: the hosts of its members whose traffic crosses to another host (a
  directed transfer: the sender's); its ingress nodes likewise (the receiver's);
- a hypothesis "node h sends slowly" predicts slow the units with h among their egress nodes
  ("receives slowly": ingress). Its evidence per step: the geometric mean over kinds of the
  median transfer per call of its predicted units over that of the kind's other units (a kind
  where it slows every unit alike shows nothing: left out). A step supports it at
  ≥ LINK_SLOWDOWN; it holds when chronic (analysis/stragglers.py `chronic_pattern`), and the
  strongest (median evidence from its onset) wins. A saturated egress also delays the ACKs of
  what the node receives, so its incoming transfers slow a little too: the strongest
  hypothesis, not every supported one, is the verdict.
- the strongest hypothesis's host is named (all its ranks) only where the timing separates it
  from every other supported hypothesis on another host: their discriminating units (those one
  predicts and the other not) must show it, two or more of them agreeing (its own slow, the
  rival's not: two independent pairs of nodes) and none of the rival's own slow. Otherwise (the
  same predicted units: a sender and its receiver on two nodes, A → B slow being A's egress or
  B's ingress; too few units to tell) no node is named: `candidates` holds the ranks and
  `candidate_hosts` the nodes the evidence allows, and `ranktrace probe --for RUN` is the check
  that separates them (a confident wrong node is the one answer never given).
Runs with one host (or hosts unknown) have no node findings: their links are analysis/links.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import duckdb
import numpy as np
import pandas as pd

from ranktrace.analysis.links import LINK_SLOWDOWN, communication_straggler
from ranktrace.analysis.peers import WARMUP_STEPS
from ranktrace.analysis.stragglers import MIN_EXCESS_S, MIN_STEPS, Straggler, chronic_pattern

CAUSES = {"egress": "node sends slowly", "ingress": "node receives slowly"}
"""A node hypothesis's direction in words (Straggler.cause)."""

_UNITS_SQL = """
WITH p2p AS (  -- one row per (member, step) of each pipeline direction
    SELECT axis, rank, step, op = 'send_recv' AS both_ways,
           CASE WHEN op = 'recv' THEN peer WHEN op = 'send' THEN rank
                ELSE least(rank, peer) END AS src,
           CASE WHEN op = 'recv' THEN rank WHEN op = 'send' THEN peer
                ELSE greatest(rank, peer) END AS dst,
           -- net of the wait for a core inside the calls, as group_transfers.transfer_net_s
           sum(transfer_s - least(transfer_s, coalesce(
               greatest(0, core_wait_end_ns - core_wait_start_ns) / 1e9, 0))) AS transfer_s,
           count(*) AS calls
    FROM collectives WHERE run_id = $1 AND step >= $2 AND peer >= 0
    GROUP BY ALL
)
SELECT axis || CASE WHEN both_ways THEN '<>' ELSE '>' END AS kind, step,
       median(transfer_s) AS transfer_s, max(calls) AS calls, [src, dst] AS members,
       CASE WHEN both_ways THEN [src, dst] ELSE [src] END AS senders,
       CASE WHEN both_ways THEN [src, dst] ELSE [dst] END AS receivers
FROM p2p GROUP BY ALL
UNION ALL
SELECT axis AS kind, step, coalesce(transfer_net_s, transfer_s), calls, members,
       members AS senders, members AS receivers
FROM group_transfers WHERE run_id = $1 AND step >= $2 AND pair_low < 0
"""


@dataclass(frozen=True)
class Unit:
    """One transfer unit: its kind (axis, `pp>` a direction, `pp<>` both ways) and the hosts
    whose traffic it moves across nodes."""

    kind: str
    egress: frozenset[str]
    ingress: frozenset[str]


def _crossing(ranks: list[int], others: list[int], host: dict[int, str]) -> frozenset[str]:
    """Hosts of `ranks` that have traffic to a member of `others` on another host."""
    return frozenset(host[r] for r in ranks if any(host[o] != host[r] for o in others))


def slow_node_findings(con: duckdb.DuckDBPyConnection, run_id: str, frame: pd.DataFrame,
                       job_step: pd.Series, host: dict[int, str],
                       ) -> tuple[list[Straggler], list[str]]:  # fmt: skip
    """(findings, notes): slow sending or receiving nodes of a run on two or more known hosts
    (see the module docstring); `host`: each rank's host."""
    if len({h for h in host.values() if h}) < 2 or not all(host.values()):
        return [], []
    rows = con.execute(_UNITS_SQL, [run_id, WARMUP_STEPS]).df()
    if rows.empty:
        return [], []
    rows["members"] = rows["members"].map(lambda m: tuple(int(r) for r in m))
    units = {}
    for (kind, members), group in rows.groupby(["kind", "members"]):
        first = group.iloc[0]
        units[(kind, members)] = Unit(
            kind, _crossing([int(r) for r in first["senders"]], list(members), host),
            _crossing([int(r) for r in first["receivers"]], list(members), host),
        )  # fmt: skip
    crossing = {k: u for k, u in units.items() if u.egress or u.ingress}
    rows = rows[[(k, m) in crossing for k, m in zip(rows["kind"], rows["members"], strict=True)]]
    if rows.empty:
        return [], []
    # [steps, units]: transfer per call (units make different numbers of calls)
    per_call = (rows["transfer_s"] / rows["calls"]).to_numpy()
    grid = pd.Series(per_call, index=pd.MultiIndex.from_arrays(
        [rows["step"], rows["kind"], rows["members"]])).unstack([1, 2])  # fmt: skip
    evidence = {}
    for h in sorted(set(host.values())):
        for direction in ("egress", "ingress"):
            predicted = frozenset(k for k, u in crossing.items() if h in getattr(u, direction))
            contrast = _contrast(grid, crossing, predicted)
            if contrast is not None:
                evidence[(h, direction)] = (predicted, contrast)
    chronic = {}
    for hypothesis, (_, contrast) in evidence.items():
        slow_steps = contrast.index[contrast >= LINK_SLOWDOWN].tolist()
        if len(slow_steps) >= MIN_STEPS:
            pattern, onset = chronic_pattern(slow_steps)
            if pattern == "chronic":
                chronic[hypothesis] = (onset, float(contrast.loc[onset:].median()))
    if not chronic:
        return [], []
    winner = max(chronic, key=lambda h: (chronic[h][1], h))
    onset = chronic[winner][0]
    rivals = [h for h in chronic if h[0] != winner[0]
              and not _separates(grid.loc[onset:], crossing, evidence[winner][0],
                                 evidence[h][0])]  # fmt: skip
    return _verdict(run_id, winner, rivals, chronic, evidence, grid, host, job_step, frame)


def _contrast(grid: pd.DataFrame, crossing: dict, predicted: frozenset) -> pd.Series | None:
    """Per step, how much slower the units a hypothesis predicts slow run than the others of
    their kind: the geometric mean over kinds of median(predicted) / median(the others); None
    when no kind has both (a hypothesis slowing every unit of a kind alike predicts nothing
    timing can see)."""
    logs = []
    for kind in {u.kind for u in crossing.values()}:
        slow, rest = _split_kind(grid, kind, predicted)
        if slow and rest:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = grid[slow].median(axis=1) / grid[rest].median(axis=1)
            logs.append(np.log(ratio.clip(lower=1e-6, upper=1e6)))
    if not logs:
        return None
    return np.exp(pd.concat(logs, axis=1).mean(axis=1)).dropna()


MIN_SEPARATING_UNITS = 2
"""Units that must speak for a winning hypothesis against a rival (its own slow, the rival's
not): two independent pairs of nodes agreeing, not one transfer either could explain."""


def _separates(grid: pd.DataFrame, crossing: dict, mine: frozenset, theirs: frozenset) -> bool:
    """Whether the timing tells hypothesis `mine` (the units it predicts slow) from `theirs`,
    from the units only one of them predicts (median over the steps from the onset): each
    unit only `mine` predicts that runs ≥ LINK_SLOWDOWN × and MIN_EXCESS_S a call above the
    units of its kind neither predicts (slow), and each unit only `theirs` predicts that runs
    under LINK_SLOWDOWN × them (fast), is a pair of nodes for `mine`; a unit at ≥ LINK_SLOWDOWN
    × but under MIN_EXCESS_S above is timer noise on a sub-millisecond transfer, evidence for
    neither (a rival's 0.30 ms against 0.13 ms once kept node 2's 12.7 ms sends from naming
    it). Where a kind has no unit neither predicts, its only-mine units against its
    only-theirs units (both count). Separated: at least MIN_SEPARATING_UNITS for `mine`, at
    least one of them slow, and no unit only `theirs` predicts slow. A kind none of whose
    units either hypothesis alone predicts runs MIN_EXCESS_S a call above the others is
    silent, evidence neither way: its transfers are too short for a shaped NIC to show on them
    (a 4-node run's slow egress on node 2 was once named node 3's by pipeline transfers of
    0.34 ms against 0.15 ms, while the all-reduce both nodes share ran 54 ms)."""
    slow_mine = fast_theirs = 0
    for kind in {u.kind for u in crossing.values()}:
        units = [k for k in grid.columns if k[0] == kind]
        only_mine = [k for k in units if k in mine and k not in theirs]
        only_theirs = [k for k in units if k in theirs and k not in mine]
        neither = [k for k in units if k not in mine and k not in theirs]
        with np.errstate(divide="ignore", invalid="ignore"):
            if neither:
                base = grid[neither].median(axis=1)
                excess = grid[only_mine + only_theirs].sub(base, axis=0).median()
                if not (excess >= MIN_EXCESS_S).any():
                    continue  # silent: too short to show a slow NIC
                ratio = grid[only_mine + only_theirs].div(base, axis=0).median()
                slow = (ratio >= LINK_SLOWDOWN) & (excess >= MIN_EXCESS_S)
                if slow[only_theirs].any():
                    return False  # the rival's own evidence
                slow_mine += int(slow[only_mine].sum())
                fast_theirs += int((ratio[only_theirs] < LINK_SLOWDOWN).sum())
            elif only_mine and only_theirs:
                ratio = grid[only_mine].median(axis=1) / grid[only_theirs].median(axis=1)
                gap = grid[only_mine].median(axis=1) - grid[only_theirs].median(axis=1)
                if ratio.median() >= LINK_SLOWDOWN and gap.median() >= MIN_EXCESS_S:
                    slow_mine += len(only_mine)
                    fast_theirs += len(only_theirs)
    return slow_mine >= 1 and slow_mine + fast_theirs >= MIN_SEPARATING_UNITS


def _split_kind(grid: pd.DataFrame, kind: str, predicted: frozenset) -> tuple[list, list]:
    """(the units of `kind` a hypothesis predicts slow, the others of that kind): columns of
    `grid`."""
    units = [k for k in grid.columns if k[0] == kind]
    return [k for k in units if k in predicted], [k for k in units if k not in predicted]


def _verdict(run_id: str, winner: tuple, rivals: list, chronic: dict, evidence: dict,
             grid: pd.DataFrame, host: dict, job_step: pd.Series, frame: pd.DataFrame):  # fmt: skip
    """(findings, notes): the winning hypothesis's node, or, where `rivals` (supported
    hypotheses on other hosts the timing cannot separate from it) remain, their ranks and
    hosts as candidates."""
    onset, strength = chronic[winner]
    node, direction = winner
    moving = {"egress": "leaving", "ingress": "entering"}[direction]
    lines = [f"the transfers whose traffic is {moving} {node} run {strength:.2f}x the others of "
             f"their kind from step {onset}"]  # fmt: skip
    doing = {"egress": "sends slowly", "ingress": "receives slowly"}
    if not rivals:
        lines.append(f"no other node's sending or receiving explains them: the transfers only "
                     f"{node}'s {direction} would slow are slow, those only another node's "
                     "would slow are not (two or more pairs of nodes agreeing)")  # fmt: skip
        ranks = sorted(r for r, h in host.items() if h == node)
        finding = _node_straggler(ranks, direction, grid.loc[onset:], evidence[winner][0],
                                  job_step, frame, hosts=[node],
                                  node_hypotheses=_hypotheses([winner], host))  # fmt: skip
        return ([dataclasses.replace(finding, evidence=lines)] if finding else []), []
    hosts = sorted({node, *(h for h, _ in rivals)})
    either = " or ".join([f"{node} {doing[direction]}",
                          *(f"{h} {doing[d]}" for h, d in rivals)])  # fmt: skip
    lines.append(f"{either}: the timing cannot separate them; `ranktrace probe --for {run_id}` "
                 "measures each pair's bandwidth in each direction")  # fmt: skip
    ranks = sorted(r for r, h in host.items() if h in hosts)
    finding = _node_straggler(ranks, None, grid.loc[onset:], evidence[winner][0], job_step,
                              frame, candidate_hosts=hosts,
                              node_hypotheses=_hypotheses([winner, *rivals], host))  # fmt: skip
    if finding is None:  # not material: no finding, and no note naming nodes on its own
        return [], []
    return [dataclasses.replace(finding, evidence=lines)], [lines[-1]]


def _hypotheses(hypotheses: list[tuple[str, str]], host: dict) -> list[dict]:
    """Straggler.node_hypotheses of (node, direction) pairs, in their order."""
    return [{"host": node, "ranks": sorted(r for r, h in host.items() if h == node),
             "cause": CAUSES[direction]} for node, direction in hypotheses]  # fmt: skip


def _node_straggler(ranks: list[int], direction: str | None, grid: pd.DataFrame,
                    predicted: frozenset, job_step: pd.Series, frame: pd.DataFrame,
                    **where) -> Straggler | None:  # fmt: skip
    """The finding over `grid`'s steps (from its onset): per step, the excess of the slowest
    predicted unit of each kind over the median of the kind's other units, summed. `where`:
    `hosts` (the node named) or `candidate_hosts`."""
    excess, ratios = [], []
    for kind in {k[0] for k in predicted}:
        slow, rest = _split_kind(grid, kind, predicted)
        if slow and rest:
            reference = grid[rest].median(axis=1)
            excess.append((grid[slow].max(axis=1) - reference).clip(lower=0.0).rename(kind))
            ratios.append((grid[slow].median(axis=1) / reference).rename(kind))
    per_step = pd.concat(excess, axis=1).sum(axis=1)
    per_step = per_step[per_step > 0]
    if per_step.empty:
        return None
    slowdown = float(pd.concat(ratios, axis=1).max(axis=1).median())
    axis_excess = pd.concat(excess, axis=1).sum()
    axis_excess.index = [kind.rstrip("<>") for kind in axis_excess.index]
    cause = CAUSES.get(direction)
    per_axis = axis_excess.groupby(level=0).sum()
    return communication_straggler(ranks, per_step, slowdown, per_axis, "chronic", job_step,
                                   frame, cause=cause, **where)  # fmt: skip
