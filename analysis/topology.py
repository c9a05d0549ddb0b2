"""Where the ranks sit and what the network costs: nodes (hosts), which parallel groups cross
nodes, and collective bandwidth inside a node versus between nodes.

- Hosts unknown: a rank without a host (an imported trace that names none) leaves every rank's
  node unknown; the block then says so (`hosts_known` false) and has no nodes, no node
  crossings, no layout flag and no bandwidth by locality: nothing per node can be told.

- Layout flag: a TP group spread over several nodes ("TP crosses nodes: put TP innermost").
  TP all-reduces every layer's activations, so it needs the node's fast links.
- Bandwidth per locality: a collective is intra-node when every member of its group (both ends
  of a point-to-point transfer) is on one host, else inter-node. Bus bandwidth as nccl-tests
  defines it (bytes over transfer time, times 2(n-1)/n for an all-reduce and (n-1)/n for an
  all-gather or reduce-scatter of the full buffer), so one figure compares ops and group sizes.
- Inter-node bandwidth finding: every inter-node collective is slow, none an outlier (a slow
  link shared by all of them, not one bad NIC, which analysis/links.py reports as a straggler):
  inter-node bandwidth ≤ MAX_INTER_INTRA_RATIO × that of intra-node collectives no larger than
  the inter-node ones (message size matters: 32 KiB all-reduces reach a tenth of what 400 KiB
  ones do on the same link), and inter-node transfers take ≥ MIN_INTER_NODE_SHARE_PCT of the
  step.
"""

from __future__ import annotations

import duckdb
import numpy as np
import pandas as pd

from ranktrace.analysis.peers import WARMUP_STEPS
from ranktrace.analysis.replay_timeline import MAX_REPLAY_CALLS

MAX_INTER_INTRA_RATIO = 0.5
"""Inter-node bus bandwidth at most half the intra-node one is a finding..."""
MIN_INTER_NODE_SHARE_PCT = 10.0
"""...when inter-node transfers also take ≥ 10% of the ranks' step time."""
BUS_FACTOR_SQL = """CASE op
    WHEN 'all_reduce' THEN 2.0 * (group_size - 1) / group_size
    WHEN 'all_gather' THEN 1.0 * (group_size - 1) / group_size
    WHEN 'reduce_scatter' THEN 1.0 * (group_size - 1) / group_size
    ELSE 1.0 END"""
"""Bytes on the busiest link per byte of buffer (nccl-tests' bus bandwidth); 1 for P2P."""

_LOCATED_SQL = f"""
WITH hosts AS (SELECT rank, host FROM ranks WHERE run_id = $run),
located AS (
    SELECT c.*, h.host, ph.host AS peer_host, {BUS_FACTOR_SQL} AS bus_factor
    FROM collectives c JOIN hosts h USING (rank) LEFT JOIN hosts ph ON ph.rank = c.peer
    WHERE c.run_id = $run AND c.axis <> 'world' AND c.complete AND c.step >= $warmup
          AND (c.step - $warmup) % $every = 0
),
group_hosts AS (
    SELECT axis, group_id, count(DISTINCT host) AS n_hosts FROM located WHERE peer < 0
    GROUP BY ALL
)
SELECT l.*, CASE WHEN l.peer >= 0 THEN l.host <> l.peer_host ELSE g.n_hosts > 1 END
            AS inter_node
FROM located l LEFT JOIN group_hosts g USING (axis, group_id)
"""
"""Every complete collective call of run $run after warm-up (of every $every-th step), with
`inter_node` and `bus_factor`."""


def placement(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """One row per rank: rank, host, pp, dp, tp."""
    return con.execute(
        "SELECT rank, host, pp, dp, tp FROM ranks WHERE run_id = ? ORDER BY rank", [run_id]
    ).df()


def hosts_known(ranks: pd.DataFrame) -> bool:
    """Whether every rank names its host (imported traces may name none)."""
    hosts = ranks["host"]
    return bool(len(ranks)) and not (hosts.isna() | (hosts.astype(str) == "")).any()


def axis_groups(ranks: pd.DataFrame) -> pd.DataFrame:
    """Every parallel group: axis, members (ranks), hosts (distinct, in rank order). Only axes
    whose coordinate takes more than one value have groups of more than one rank: ranks that
    share every coordinate (a placement the trace could not tell) form no group."""
    ordered = ranks.sort_values("rank")
    parts = []
    for axis, others in (("tp", ["pp", "dp"]), ("pp", ["dp", "tp"]), ("dp", ["pp", "tp"])):
        by_members = ordered.groupby(others if ordered[axis].nunique() > 1 else ["rank"])
        groups = by_members.agg(members=("rank", list), hosts=("host", "unique"))
        parts.append(groups.assign(axis=axis, hosts=groups["hosts"].map(list)))
    return pd.concat(parts, ignore_index=True)[["axis", "members", "hosts"]]


def layout_flags(ranks: pd.DataFrame) -> list[str]:
    """What the rank placement gets wrong for the network: TP groups spanning nodes (none when
    the hosts are unknown or the run has no tensor parallelism)."""
    if not hosts_known(ranks):
        return []
    groups = axis_groups(ranks)
    tp_groups = groups[(groups["axis"] == "tp") & (groups["members"].map(len) > 1)]
    crossing = tp_groups[tp_groups["hosts"].map(len) > 1]
    if crossing.empty:
        return []
    per_node = int(ranks.groupby("host")["rank"].count().min())
    tp = len(crossing.iloc[0]["members"])
    example = crossing.iloc[0]
    where = (
        f"{len(crossing)} of {len(tp_groups)} tp groups span nodes (ranks "
        f"{', '.join(map(str, example['members']))} on {', '.join(example['hosts'])})"
    )
    if tp <= per_node:
        return [
            f"TP crosses nodes: put TP innermost. {where}; tp={tp} fits in the {per_node} "
            f"ranks per node: train with --rank-order tp-dp-pp (the default) so every tp "
            f"all-reduce stays on the node's fast links"
        ]
    return [
        f"TP crosses nodes: tp={tp} exceeds the {per_node} ranks per node, so every tp "
        f"all-reduce crosses the network ({where}); use tp <= {per_node} and more pp or dp"
    ]


def located_summary(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """Complete collective calls after warm-up counted per (inter_node, axis, op, bytes,
    bus_factor), with their transfer seconds: the one scan every bandwidth figure reads. A run
    over the replay's call budget is read on every k-th step, as the replay reads it
    (MAX_REPLAY_CALLS), its counts and seconds scaled by k."""
    (calls,) = con.execute(
        "SELECT count(*) FROM collectives WHERE run_id = ? AND step >= ?", [run_id, WARMUP_STEPS]
    ).fetchone()
    every = max(1, -(-int(calls) // MAX_REPLAY_CALLS))
    return con.execute(
        f"""SELECT inter_node, axis, op, bytes, bus_factor, count(*) * $every AS calls,
                   sum(transfer_s) * $every AS transfer_s
            FROM ({_LOCATED_SQL}) GROUP BY ALL""",
        {"run": run_id, "warmup": WARMUP_STEPS, "every": every},
    ).df()


def _bus_bandwidth(calls: pd.DataFrame) -> float | None:
    """Σ bytes × bus factor over Σ transfer seconds of summary rows (None without time)."""
    seconds = calls["transfer_s"].sum()
    moved = (calls["bytes"] * calls["bus_factor"] * calls["calls"]).sum()
    return float(moved / seconds) if seconds > 0 else None


def _median_bytes(calls: pd.DataFrame) -> float | None:
    """The median message size over the calls of summary rows (the mean of the two middle
    ones for an even count, as SQL's median)."""
    sized = calls.dropna(subset=["bytes"]).sort_values("bytes")
    if sized.empty:
        return None
    upto = sized["calls"].cumsum().to_numpy()
    n, values = int(upto[-1]), sized["bytes"].to_numpy(dtype=float)
    lower, upper = (values[np.searchsorted(upto, k, side="right")] for k in ((n - 1) // 2, n // 2))
    return (lower + upper) / 2


def bandwidth_by_locality(summary: pd.DataFrame) -> list[dict]:
    """Per (locality, axis, op) of `located_summary`: calls, median bytes, transfer seconds and
    bus bandwidth (sum of bytes × bus factor over the sum of transfer time), intra-node first."""
    locality = np.where(summary["inter_node"] == True, "inter-node", "intra-node")  # noqa: E712
    rows = [
        {"locality": where, "axis": axis, "op": op, "calls": int(part["calls"].sum()),
         "median_bytes": _median_bytes(part), "transfer_s": float(part["transfer_s"].sum()),
         "bus_bytes_per_s": _bus_bandwidth(part)}
        for (where, axis, op), part in summary.groupby([locality, "axis", "op"], dropna=False)
    ]  # fmt: skip
    return sorted(rows, key=lambda r: (r["locality"] == "inter-node", r["axis"], r["op"]))


def transfer_by_locality(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, float]:
    """Median over steps of the ranks' mean transfer seconds per step, intra- and inter-node
    (`intra_node_transfer_s`, `inter_node_transfer_s`); empty without collectives."""
    row = con.execute(
        f"""WITH per_rank AS (
                SELECT step, rank, sum(transfer_s) FILTER (WHERE NOT inter_node) AS intra,
                       sum(transfer_s) FILTER (WHERE inter_node) AS inter
                FROM ({_LOCATED_SQL}) GROUP BY ALL
            ),
            per_step AS (
                SELECT step, avg(coalesce(intra, 0)) AS intra, avg(coalesce(inter, 0)) AS inter
                FROM per_rank GROUP BY step
            )
            SELECT median(intra), median(inter), count(*) FROM per_step""",
        {"run": run_id, "warmup": WARMUP_STEPS, "every": 1},
    ).fetchone()
    if not row[2]:
        return {}
    return {"intra_node_transfer_s": float(row[0]), "inter_node_transfer_s": float(row[1])}


def matched_bandwidth(summary: pd.DataFrame) -> dict | None:
    """Inter-node bus bandwidth against intra-node collectives no larger than the inter-node
    ones' median size: small messages reach at most the bandwidth of large ones on the same
    link, so a slower inter-node figure against smaller intra-node messages is the network.
    None when either side has no calls."""
    inter = summary[summary["inter_node"] == True]  # noqa: E712 (NULL: neither side)
    size = _median_bytes(inter)
    if size is None:
        return None
    intra = summary[(summary["inter_node"] == False) & (summary["bytes"] <= size)]  # noqa: E712
    inter_bw, intra_bw = _bus_bandwidth(inter), _bus_bandwidth(intra)
    if not inter_bw or not intra_bw:
        return None
    return {"inter": inter_bw, "intra": intra_bw, "inter_median_bytes": size}


def inter_node_share_pct(con: duckdb.DuckDBPyConnection, run_id: str, summary) -> float | None:
    """Inter-node transfer seconds as a share of the ranks' step time, after warm-up."""
    inter = summary.loc[summary["inter_node"] == True, "transfer_s"]  # noqa: E712
    steps = con.execute(
        "SELECT sum(step_time_s) FROM steps WHERE run_id = $run AND step >= $warmup",
        {"run": run_id, "warmup": WARMUP_STEPS},
    ).fetchone()[0]
    return 100.0 * float(inter.sum()) / steps if len(inter) and steps else None


def inter_node_bandwidth_finding(
    con: duckdb.DuckDBPyConnection, run_id: str, summary: pd.DataFrame, blamed_axes: set[str]
) -> dict | None:
    """The inter-node bandwidth finding (module docstring), or None. `blamed_axes`: axes on
    which a communication straggler was found; their slowness is that rank's, not the network's.
    `summary`: the run's `located_summary`."""
    inter_axes = sorted(set(summary.loc[summary["inter_node"] == True, "axis"]))  # noqa: E712
    if not inter_axes or blamed_axes & set(inter_axes):
        return None
    matched = matched_bandwidth(summary)
    if matched is None or matched["inter"] > MAX_INTER_INTRA_RATIO * matched["intra"]:
        return None
    share = inter_node_share_pct(con, run_id, summary)
    if share is None or share < MIN_INTER_NODE_SHARE_PCT:
        return None
    inter, intra = matched["inter"], matched["intra"]
    return {
        "kind": "inter_node_bandwidth",
        "axes": inter_axes,
        "intra_node_bus_bytes_per_s": intra,
        "inter_node_bus_bytes_per_s": inter,
        "ratio": inter / intra,
        "inter_node_share_pct": share,
        "text": (
            f"inter-node bandwidth: {', '.join(inter_axes)} collectives between nodes reach "
            f"{inter / 1e6:.1f} MB/s bus bandwidth vs {intra / 1e6:.1f} MB/s for messages no "
            f"larger ({matched['inter_median_bytes'] / 1024:.0f} KiB) inside a node "
            f"({inter / intra:.2f}x) and take {share:.0f}% of the step time; every inter-node "
            f"group is equally slow, so this is the network, not a straggler"
        ),
    }


def unjudged_inter_node(con: duckdb.DuckDBPyConnection, run_id: str, summary: pd.DataFrame,
                        blamed_axes: set[str]) -> str | None:  # fmt: skip
    """On two nodes (every crossing transfer crosses the same two NICs: no node is a reference
    for the other), where inter-node transfers take ≥ MIN_INTER_NODE_SHARE_PCT of the step time,
    no finding is on their axes and no intra-node messages are as small (`matched_bandwidth`
    None), a note that the timing cannot judge the network or either NIC; else None. A
    2-node run with one node's egress limited (64 KB tbf burst, 8 Mbit) ran 1.30x its healthy
    step, its pipeline send+recvs 10.8 ms a call against 0.9 ms healthy, and read "stragglers:
    none": every crossing transfer crossed the same two NICs, so none was a reference."""
    inter = summary[summary["inter_node"] == True]  # noqa: E712
    axes = sorted(set(inter["axis"]))
    if not axes or blamed_axes & set(axes) or matched_bandwidth(summary) is not None:
        return None
    share = inter_node_share_pct(con, run_id, summary)
    if share is None or share < MIN_INTER_NODE_SHARE_PCT:
        return None
    bandwidth = _bus_bandwidth(inter) or 0.0
    return (f"inter-node transfers ({', '.join(axes)}) take {share:.0f}% of the step time at "
            f"{bandwidth / 1e6:.1f} MB/s bus bandwidth, and nothing in this run is a reference "
            "for them (no messages as small inside a node, and every crossing transfer crosses "
            "both nodes' NICs): a slow network or NIC would look the same; "
            f"`ranktrace probe --for {run_id}` measures each pair of nodes")  # fmt: skip


def topology(con: duckdb.DuckDBPyConnection, run_id: str, blamed_axes: set[str]) -> dict:
    """The `topology` block of a report: whether the hosts are known, nodes, per axis its groups
    and how many cross nodes (None when the hosts are unknown), layout flags, bandwidth per
    locality, the inter-node bandwidth finding (or None) and `inter_node_unjudged` (or None)."""
    ranks = placement(con, run_id)
    if ranks.empty:
        return {"nodes": [], "hosts_known": None, "groups": {}, "flags": [], "bandwidth": [],
                "inter_node_bandwidth": None, "inter_node_unjudged": None}  # fmt: skip
    known = hosts_known(ranks)
    nodes = [
        {"host": host, "ranks": group["rank"].tolist()}
        for host, group in ranks.groupby("host", sort=False)
    ] if known else []  # fmt: skip
    groups = axis_groups(ranks)
    groups = groups[groups["members"].map(len) > 1]  # an axis of degree 1 moves nothing
    per_axis = {
        axis: {"groups": len(part),
               "crossing_nodes": int((part["hosts"].map(len) > 1).sum()) if known else None}
        for axis, part in groups.groupby("axis")
    }  # fmt: skip
    multi_node = len(nodes) > 1
    summary = located_summary(con, run_id) if multi_node else None
    bandwidth = bandwidth_by_locality(summary) if multi_node else []
    finding = (
        inter_node_bandwidth_finding(con, run_id, summary, blamed_axes) if multi_node else None
    )
    return {
        "nodes": nodes,
        "hosts_known": known,
        "groups": per_axis,
        "flags": layout_flags(ranks) if multi_node else [],
        "bandwidth": bandwidth,
        "inter_node_bandwidth": finding,
        "inter_node_unjudged": (
            unjudged_inter_node(con, run_id, summary, blamed_axes)
            if len(nodes) == 2 and finding is None
            else None
        ),
    }
