"""What a profiled job's collectives say once every rank's trace is read: each call's axis, phase
and seq (they need the whole job's groups), and every rank's mesh coordinates. Heuristics, as the
profiler names no parallel axes:

- axis of a collective: a word of its group description (`mesh_tp` → tp; tp/tensor → tp;
  dp/ddp/fsdp/hsdp/data → dp; pp/pipe/pipeline → pp); else a group of every rank → world; else a
  group of consecutive ranks → tp when the job also has groups of strided ranks (a dp × tp mesh)
  and dp when it has none (dp × pp); strided → dp. send/recv → pp.
- phase of a collective: pp → pipeline_wait; dp → grad_sync; tp → the enclosing phase span
  (forward or backward, else forward); world → forward in forward, grad_sync in backward (DDP on
  the default group), data in data, else optimizer.
- seq: the group's "Seq" where every call on the group records it (members number their calls
  on a group alike, so a call missing from one rank's window shifts nothing); else a call's
  index among the worker's calls in the same step on its group (send/recv: on its directed
  pair, sender → receiver), numbered across steps. Groups the store cannot tell apart (the same
  axis and lowest rank: two process groups of the same ranks, both directions of a send/recv
  pair) interleave their numbers: seq × their count + the group's index among them. Calls
  without a recorded group (older record_param_comms) must be the same on every rank in each
  step, else TraceError: their order is all that matches them.
- workers: a rank's position in its tp/dp/pp group, from groups with a known axis (the largest
  one where several; pg_config's described groups count); 0 on an axis without groups; pp from
  chains of send/recv peers when no group names pp; dp = rank when the job shows no such group,
  or when the groups leave ranks with the same (pp, dp, tp).
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pandas as pd

from ranktrace.importers.ops import WORKER_COLUMNS, TraceError

AXIS_WORDS = {"tp": "tp", "tensor": "tp", "dp": "dp", "ddp": "dp", "fsdp": "dp", "hsdp": "dp",
              "data": "dp", "pp": "pp", "pipe": "pp", "pipeline": "pp"}  # fmt: skip


def axis_word(description: str) -> str:
    """The word of a process group's description that names its axis, "" when none."""
    words = re.split(r"[^a-z0-9]+", description.lower())
    return next((w for w in words if w in AXIS_WORDS), "")


def _consecutive(ranks: tuple[int, ...]) -> bool:
    return all(b - a == 1 for a, b in itertools.pairwise(ranks))


def job_collectives(comms: pd.DataFrame, world: int) -> pd.DataFrame:
    """Axis, phase and seq of every collective call (all ranks' rows)."""
    groups = comms.loc[~comms["p2p"], ["key", "ranks", "desc", "group_size"]].drop_duplicates("key")
    plain = [
        r
        for r, d, n in zip(groups["ranks"], groups["desc"], groups["group_size"], strict=True)
        if not axis_word(d) and n < world
    ]
    strided = any(not _consecutive(r) for r in plain)
    axis_of = {}
    for key, ranks, desc, size in groups.itertuples(index=False):
        if word := axis_word(desc):
            axis_of[key] = AXIS_WORDS[word]
        elif size >= world:
            axis_of[key] = "world"
        else:
            axis_of[key] = "tp" if _consecutive(ranks) and strided else "dp"
    comms["axis"] = [
        ("pp" if p2p else axis_of[k]) for k, p2p in zip(comms["key"], comms["p2p"], strict=True)
    ]
    comms["phase"] = [
        _collective_phase(a, e) for a, e in zip(comms["axis"], comms["enclosing"], strict=True)
    ]
    _check_inferred_order(comms, world)
    order = comms["step"] * (int(comms["idx"].max()) + 1 if len(comms) else 1) + comms["idx"]
    by_order = order.groupby(comms["key"]).rank(method="dense").fillna(0).astype("int64") - 1
    numbered = (comms["pg_seq"] >= 0) & ~comms["p2p"]
    by_seq = numbered.groupby(comms["key"]).transform("all")  # every call of the group has one
    seq = np.where(by_seq, comms["pg_seq"], by_order).astype("int64")
    # The store keys an instance by (axis, lowest rank, pair, seq): process groups of the same
    # ranks (the default group and a new_group of every rank) and both directions of a pair
    # would share it. Interleave their numbers: seq × groups sharing it + the group's index.
    sharing = comms.groupby(["axis", "group_id"])["key"]
    count = sharing.transform("nunique").to_numpy()
    index = sharing.transform(lambda k: pd.Categorical(k, sorted(k.unique())).codes).to_numpy()
    comms["seq"] = seq * count + index
    comms["mb"] = -1
    return comms


def _check_inferred_order(comms: pd.DataFrame, world: int) -> None:
    """Calls without a recorded group or sequence number (older record_param_comms) are matched
    across ranks by their order in the step: every rank must make the same calls in each step."""
    inferred = comms[comms["inferred"]]
    if inferred.empty:
        return
    calls = inferred.sort_values("ts", kind="stable").groupby(["step", "worker"])["op"].agg(tuple)
    for step, per_rank in calls.groupby(level="step"):
        made = {int(w): ops for (_, w), ops in per_rank.items()}
        made.update({w: () for w in range(world) if w not in made})
        reference = made[0]
        for rank, ops in sorted(made.items()):
            if ops != reference:
                raise TraceError(
                    f"step {step}: rank 0 makes {len(reference)} collectives "
                    f"({', '.join(reference[:3])}{', ...' if len(reference) > 3 else ''}) and "
                    f"rank {rank} {len(ops)} ({', '.join(ops[:3])}"
                    f"{', ...' if len(ops) > 3 else ''}), and the trace records no group or "
                    "sequence number to match them by (an older record_param_comms form); "
                    "re-profile with torch >= 2.4"
                )


def _collective_phase(axis: str, enclosing: str) -> str:
    if axis == "pp":
        return "pipeline_wait"
    if axis == "dp":
        return "grad_sync"
    if axis == "tp":
        return enclosing if enclosing in ("forward", "backward") else "forward"
    return {"forward": "forward", "backward": "grad_sync", "data": "data"}.get(
        enclosing, "optimizer"
    )


def workers_table(hosts: dict[int, str], described: set, comms: pd.DataFrame) -> pd.DataFrame:
    """Mesh coordinates from the groups of known axis (those calls ran on and `described`:
    pg_config's (ranks, axis)); dp = rank when there are none, or when they do not give every
    rank its own coordinates (a partial mesh: no axis can be told then)."""
    world = len(hosts)
    seen = comms.loc[comms["axis"].isin(["tp", "dp"]), ["ranks", "axis"]]
    groups = {*zip(seen["ranks"], seen["axis"], strict=True)} | described
    stages = {} if any(a == "pp" for _, a in groups) else _stages_from_p2p(comms)
    rows = []
    for rank in range(world):
        coords = {}
        for axis in ("pp", "dp", "tp"):
            mine = [r for r, a in groups if a == axis and rank in r]
            coords[axis] = sorted(max(mine, key=len)).index(rank) if mine else 0
        if rank in stages:
            coords["pp"] = stages[rank]
        rows.append({"worker": rank, **coords, "host": hosts[rank]})
    table = pd.DataFrame(rows, columns=list(WORKER_COLUMNS))
    if table.duplicated(["pp", "dp", "tp"]).any():
        table[["pp", "dp", "tp"]] = 0
        table["dp"] = table["worker"]
    return table


def _stages_from_p2p(comms: pd.DataFrame) -> dict[int, int]:
    """Pipeline stage per rank from point-to-point transfers when no group names pp: each
    pipeline is a chain of ranks; stage 0 is the end whose first transfer is a send (the first
    micro-batch's activations), stages count along the chain. Empty when the transfers do not
    form chains."""
    p2p = comms[comms["p2p"]]
    if p2p.empty:
        return {}
    neighbours: dict[int, set] = {}
    for rank, peer in zip(p2p["worker"], p2p["peer"], strict=True):
        neighbours.setdefault(int(rank), set()).add(int(peer))
        neighbours.setdefault(int(peer), set()).add(int(rank))
    if any(len(n) > 2 for n in neighbours.values()):
        return {}
    first_op = p2p.sort_values("start_s").groupby("worker")["op"].first()
    stages: dict[int, int] = {}
    for end in sorted(r for r, n in neighbours.items() if len(n) == 1):
        if end in stages or first_op.get(end) != "send":
            continue
        previous, current, stage = None, end, 0
        while current is not None:
            stages[current] = stage
            following = [r for r in neighbours[current] if r != previous]
            previous, current, stage = current, (following[0] if following else None), stage + 1
    return stages
