"""Probe runs (`ranktrace probe`): which node (or rank) sends or receives slowly, from the
bandwidth of every ordered pair, and the probes linked to a training run.

A node is a slow sender when every pair it sends to another node is much slower than the pairs
it takes no part in (median, SLOW_FACTOR); a slow receiver likewise for the pairs it receives.
Comparing a node with the pairs it is not in keeps one slow node from setting the reference, and
taking its fastest pair (not its median) keeps a node sharing a CPU with one peer from being
named. Inside a node the same holds for its ranks over its intra-node pairs, at a wider margin
(INTRA_NODE_FACTOR), and not at all on a host with more ranks than cores. With two nodes (or
two ranks) there are no other pairs: a slow direction A -> B is A's egress or B's ingress, and
the sender is named with a note saying so.
"""

from __future__ import annotations

import json
import statistics

import duckdb

from ranktrace.telemetry.names import RUN_KIND_PROBE

SLOW_FACTOR = 0.5
"""A node sends (receives) slowly when even its fastest pair is below this share of the median
of the pairs it takes no part in."""
INTRA_NODE_FACTOR = 0.25
"""The same for a rank among its node's ranks. Inside a node a transfer is a memory copy (gloo:
through loopback TCP) that CPU scheduling alone moves by 2x: two ranks of an otherwise quiet
2-core machine measured 0.47x between the directions. A degraded device link is slower still."""


def _mb(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e6:.3g} MB/s"


def _slow_sides(
    rates: dict[tuple, float], units: list, factor: float
) -> tuple[list, list, list[str]]:
    """(slow senders, slow receivers, notes) among `units`, from `rates[(src, dst)]` (bytes/s)
    of their ordered pairs, slow meaning below `factor` x the reference. Each finding: (unit,
    its pairs' median, the reference median)."""
    senders, receivers, notes = [], [], []
    if len(units) == 2:
        a, b = units
        if (a, b) in rates and (b, a) in rates:
            for src, dst in ((a, b), (b, a)):
                if rates[(src, dst)] < factor * rates[(dst, src)]:
                    senders.append((src, rates[(src, dst)], rates[(dst, src)]))
                    notes.append(
                        f"{src} -> {dst} at {_mb(rates[(src, dst)])} is "
                        f"{rates[(src, dst)] / rates[(dst, src)]:.2g}x the reverse direction: "
                        f"{src}'s egress or {dst}'s ingress (two cannot tell which; a third "
                        f"would); naming the sender {src}"
                    )  # fmt: skip
        return senders, receivers, notes
    for unit in units:
        others = [r for (s, d), r in rates.items() if unit not in (s, d)]
        if not others:
            continue
        reference = statistics.median(others)
        for found, side in ((senders, 0), (receivers, 1)):
            own = [r for pair, r in rates.items() if pair[side] == unit]
            if own and max(own) < factor * reference:
                found.append((unit, statistics.median(own), reference))
    named_senders = {unit for unit, *_ in senders}
    named_receivers = {unit for unit, *_ in receivers}
    typical = statistics.median(rates.values()) if rates else 0.0
    for (src, dst), rate in sorted(rates.items()):
        if rate < factor * typical and src not in named_senders and dst not in named_receivers:
            notes.append(
                f"{src} -> {dst} at {_mb(rate)} is {rate / typical:.2g}x the median pair, while "
                f"{src}'s other sends and {dst}'s other receives are not: the path between them"
            )  # fmt: skip
    return senders, receivers, notes


def verdict(pairs: list[dict], ranks: list[dict]) -> dict:
    """Slow senders and receivers (nodes, and ranks inside a node), the ranks they name, and
    notes, from a probe's `pairs` ({src, dst, bytes_per_s}) and `ranks` ({rank, host})."""
    host = {r["rank"]: r["host"] for r in ranks}
    nodes: dict[str, list[int]] = {}
    for rank in sorted(host):
        nodes.setdefault(host[rank], []).append(rank)
    between: dict[tuple[str, str], list[float]] = {}  # one pair per two nodes, or more
    for p in pairs:
        if host[p["src"]] != host[p["dst"]]:
            between.setdefault((host[p["src"]], host[p["dst"]]), []).append(p["bytes_per_s"])
    inter = {hosts: statistics.median(rates) for hosts, rates in between.items()}
    findings = {"slow_senders": [], "slow_receivers": []}
    senders, receivers, notes = _slow_sides(inter, list(nodes), SLOW_FACTOR)
    notes = [f"between nodes: {note}" for note in notes]
    for key, found in (("slow_senders", senders), ("slow_receivers", receivers)):
        findings[key] += [_finding("node", h, nodes[h], rate, ref) for h, rate, ref in found]
    for name, members in nodes.items():
        intra = {(p["src"], p["dst"]): p["bytes_per_s"] for p in pairs
                 if host[p["src"]] == host[p["dst"]] == name}  # fmt: skip
        senders, receivers, intra_notes = _slow_sides(intra, members, INTRA_NODE_FACTOR)
        notes += [f"inside {name}: rank {note}" for note in intra_notes]
        cores = {core for r in ranks if r["host"] == name for core in r.get("cpu_affinity", [])}
        if cores and len(members) > len(cores):  # ranks take turns on the cores
            sides = (("send", senders), ("receive", receivers))
            found = [f"rank {r} {side}s at {rate / ref:.2g}x"
                     for side, rs in sides for r, rate, ref in rs]  # fmt: skip
            notes.append(
                f"inside {name}: {len(members)} ranks share {len(cores)} cores, so CPU scheduling "
                f"sets the rates between them: no finding there"
                + (f" ({', '.join(found)} of the others)" if found else "")
            )  # fmt: skip
            continue
        for key, found in (("slow_senders", senders), ("slow_receivers", receivers)):
            findings[key] += [_finding("rank", name, [r], rate, ref) for r, rate, ref in found]
    if len(nodes) == 1:
        notes.append(f"every rank is on {next(iter(nodes))}: only pairs inside it were measured")
    slow = sorted({r for found in findings.values() for f in found for r in f["ranks"]})
    return {"slow_ranks": slow, **findings, "notes": notes,
            "nodes": [{"host": h, "ranks": members} for h, members in nodes.items()],
            "verdict": verdict_text(findings)}  # fmt: skip


def _finding(scope: str, host: str, ranks: list[int], rate: float, reference: float) -> dict:
    return {"scope": scope, "host": host, "ranks": ranks, "bytes_per_s": rate,
            "reference_bytes_per_s": reference, "ratio": rate / reference}  # fmt: skip


def verdict_text(findings: dict) -> str:
    """One line: who sends or receives slowly, at what rate against what reference."""
    parts = []
    for key, side in (("slow_senders", "sender"), ("slow_receivers", "receiver")):
        for f in findings[key]:
            who = (f"{f['host']} (rank{'s' if len(f['ranks']) > 1 else ''} "
                   f"{', '.join(map(str, f['ranks']))})" if f["scope"] == "node"
                   else f"rank {f['ranks'][0]} on {f['host']}")  # fmt: skip
            parts.append(f"slow {side} {who}: {_mb(f['bytes_per_s'])}, {f['ratio']:.2g}x the "
                         f"{_mb(f['reference_bytes_per_s'])} of the pairs without it")  # fmt: skip
    return "; ".join(parts) if parts else "no slow sender or receiver"


def _probe_body(record: dict) -> dict:
    """The `probe` section of a probe run's report: its verdict and pairs."""
    measured = record.get("probe") or {}
    ranks = measured.get("ranks", [])
    host = {r["rank"]: r["host"] for r in ranks}
    pairs = [
        {"src": p["src"], "dst": p["dst"], "src_host": host.get(p["src"]),
         "dst_host": host.get(p["dst"]), "intra_node": host.get(p["src"]) == host.get(p["dst"]),
         "bytes": p["bytes"], "messages": p.get("messages", 1), "bytes_per_s": p["bytes_per_s"],
         "seconds": p["seconds"]}
        for p in measured.get("pairs", [])
    ]  # fmt: skip
    settings = ("backend", "world_size", "max_bytes", "repeats", "pair_seconds", "duration_s")
    return {**verdict(pairs, ranks), "pairs": pairs,
            **{key: measured.get(key) for key in settings}}  # fmt: skip


def probe_report(row: dict) -> dict:
    """The report of a probe run (`ranktrace report PROBE_RUN`): its verdict and pairs."""
    record = row["record"]
    return {
        "run_id": row["run_id"], "name": row["name"], "status": row["status"],
        "kind": RUN_KIND_PROBE, "for": record.get("for"), "probe": _probe_body(record),
        # A probe trains nothing; the keys run lists read are there, empty.
        "stragglers": [], "imbalances": [],
    }  # fmt: skip


def linked_probes(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict]:
    """Summaries of the probe runs made `--for` this run, oldest first (none in a store from
    before probes, whose `runs` has no `kind`)."""
    try:
        rows = con.execute(
            "SELECT run_id, name, started_at, run_json FROM runs WHERE kind = ? "
            "AND json_extract_string(run_json, '$.for') = ? ORDER BY started_at",
            [RUN_KIND_PROBE, run_id],
        ).fetchall()
    except duckdb.Error:  # BinderException: no `kind` column yet
        return []
    summaries = []
    for probe_id, name, started_at, run_json in rows:
        body = _probe_body(json.loads(run_json))
        keep = ("slow_ranks", "slow_senders", "slow_receivers", "notes", "verdict")
        summaries.append({"run_id": probe_id, "name": name, "started_at": started_at,
                          **{key: body[key] for key in keep}})  # fmt: skip
    return summaries
