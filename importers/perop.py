"""Per-op Parquet traces (the schema of straggler research on large training jobs): one row per
operation of one worker, a worker being one (dp_rank, stage) with tensor parallelism folded in.

Columns: dp_rank, stage, rank, step, optype, start_ts, duration (seconds), seq_id, mc, gmc,
mb_id. Only a sample of steps may be present, and a worker may have no rows (lost; the report's
capture names the job's ranks it stood for, `folding`). Mapping into importers/ops.py:
- forward-compute / backward-compute → phases forward / backward, per micro-batch (mb_id);
- forward-send, forward-recv, backward-send, backward-recv → point-to-point on axis pp with the
  worker of the next / previous stage of the same dp_rank; both ends of a transfer share
  (step, direction, seq_id), which gives them one seq (a send and a recv posted together, one
  batched call, keep their two rows: the replay joins them);
- grads-reduce-scatter, params-all-gather → reduce_scatter / all_gather on axis dp over the
  stage's dp_ranks (phase grad_sync / optimizer);
- embedding-grads-all-reduce → all-reduce of the first and last stage of a dp_rank (axis pp,
  phase grad_sync); layernorm-grads-all-reduce → all-reduce over tp, folded into one worker
  (a group of one: its time is all transfer);
- optimizer-clip-main-grad → all-reduce of every worker (axis world, phase optimizer): it holds
  the all-reduce of the gradient norm, a synchronisation point, not compute;
- optimizer → phase optimizer; gc → time outside every phase.
Megatron runs these jobs on GPUs: the replay takes the rendezvous model (analysis/replay_graph.py:
point-to-point on its own stream, sends wait for their peer, launch delays), `REPLAY_MODEL`.
The n-th collective call of a worker on one axis in a step (any type) is instance n of its group.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from ranktrace.analysis.replay_graph import RENDEZVOUS
from ranktrace.importers.ops import OP_COLUMNS, WORKER_COLUMNS, TraceError, check_tables, typed

COLUMNS = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "seq_id", "mc",
           "gmc", "mb_id")  # fmt: skip
COMPUTE = {"forward-compute": "forward", "backward-compute": "backward",
           "optimizer": "optimizer", "gc": ""}  # fmt: skip
P2P = {  # optype: (op, stage offset of the peer, direction)
    "forward-send": ("send", +1, 0), "forward-recv": ("recv", -1, 0),
    "backward-send": ("send", -1, 1), "backward-recv": ("recv", +1, 1),
}  # fmt: skip
COLLECTIVES = {  # optype: (op, axis, phase)
    "grads-reduce-scatter": ("reduce_scatter", "dp", "grad_sync"),
    "params-all-gather": ("all_gather", "dp", "optimizer"),
    "embedding-grads-all-reduce": ("all_reduce", "pp", "grad_sync"),
    "layernorm-grads-all-reduce": ("all_reduce", "tp", "grad_sync"),
    "optimizer-clip-main-grad": ("all_reduce", "world", "optimizer"),
}  # fmt: skip
OPTYPES = (*COMPUTE, *P2P, *COLLECTIVES)
REPLAY_MODEL = RENDEZVOUS


def read_perop(path: Path, pp: int, dp: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(ops, workers) of the per-op trace at `path` for a job of `pp` stages × `dp` replicas.
    A worker the trace has no rows of is not in `workers` (the report's capture names it);
    its neighbours' sends and their groups still name it, by its id in `position_ids`."""
    table = _read(path)
    _check(table, path, pp, dp)
    workers = (
        table.groupby("rank", sort=True)[["stage", "dp_rank"]]
        .first()
        .reset_index()
        .rename(columns={"rank": "worker", "stage": "pp", "dp_rank": "dp"})
        .assign(tp=0, host="")
    )
    worker_of = position_ids(workers, pp, dp)
    ops = _map_ops(table, worker_of, pp, dp)
    check_tables(ops, workers)
    return typed(ops, OP_COLUMNS), typed(workers, WORKER_COLUMNS)


def position_ids(workers: pd.DataFrame, pp: int, dp: int) -> dict[tuple[int, int], int]:
    """{(stage, dp_rank): worker id} of every position of the job, the trace's own ids where
    it has rows. A position without rows takes the id the trace's numbering gives it where the
    trace numbers its workers stage × dp + dp_rank (Megatron's order with tp folded in, as the
    published traces do), else the next id above the trace's."""
    present = {(int(w.pp), int(w.dp)): int(w.worker) for w in workers.itertuples()}
    ordered = all(worker == stage * dp + replica for (stage, replica), worker in present.items())
    next_free = max(present.values()) + 1
    ids = {}
    for stage in range(pp):
        for replica in range(dp):
            if (stage, replica) in present:
                ids[(stage, replica)] = present[(stage, replica)]
            elif ordered:
                ids[(stage, replica)] = stage * dp + replica
            else:
                ids[(stage, replica)], next_free = next_free, next_free + 1
    return ids


def folding(workers: pd.DataFrame, tp: int, pp: int, dp: int) -> dict:
    """run.json's `folded`: the trace's workers and the job's ranks each stands for. A worker
    is one (dp_rank, stage) with its `tp` tensor-parallel ranks folded in; the job's ranks
    are numbered in Megatron's default order (tp innermost, then dp, then pp), so the worker of
    (dp_rank d, stage s) stands for ranks (s × dp + d) × tp ... + tp - 1.
    {"axis": "tp", "ranks_per_worker": tp, "world": tp × pp × dp, "workers": [{"worker",
    "pp", "dp", "ranks": [first, last]}, ...] (every position, with or without rows)}."""
    positions = [{"worker": worker, "pp": stage, "dp": replica,
                  "ranks": [(stage * dp + replica) * tp, (stage * dp + replica + 1) * tp - 1]}
                 for (stage, replica), worker in position_ids(workers, pp, dp).items()]  # fmt: skip
    return {"axis": "tp", "ranks_per_worker": tp, "world": tp * pp * dp, "workers": positions}


def _read(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise TraceError(f"{path}: no such file; give the per-op Parquet trace")
    try:
        schema = pq.read_schema(path)
    except Exception as error:  # pyarrow raises several types for a file that is not Parquet
        raise TraceError(f"{path}: not a Parquet file ({error})") from None
    missing = [c for c in COLUMNS if c not in schema.names]
    if missing:
        raise TraceError(
            f"{path}: missing column(s) {', '.join(missing)}; a per-op trace has "
            f"{', '.join(COLUMNS)}"
        )
    return pq.read_table(path, columns=list(COLUMNS)).to_pandas()


def _check(table: pd.DataFrame, path: Path, pp: int, dp: int) -> None:
    """One-line errors for what the mapping cannot take (the fix in each message)."""
    if table.empty:
        raise TraceError(f"{path}: the trace has no rows")
    nulls = [c for c in COLUMNS if c != "mb_id" and table[c].isna().any()]
    if nulls:
        raise TraceError(f"{path}: empty values in column(s) {', '.join(nulls)}")
    unknown = sorted(set(table["optype"].unique()) - set(OPTYPES))
    if unknown:
        raise TraceError(
            f"{path}: unknown optype {unknown[0]!r}{' and others' if len(unknown) > 1 else ''}; "
            f"known: {', '.join(OPTYPES)}"
        )
    negative = table["duration"] < 0
    if negative.any():
        row = table[negative].iloc[0]
        raise TraceError(
            f"{path}: negative duration {row['duration']} ({row['optype']} of rank "
            f"{row['rank']}, step {row['step']}); durations are seconds ≥ 0"
        )
    stages, replicas = set(table["stage"].unique()), set(table["dp_rank"].unique())
    if max(stages) >= pp or min(stages) < 0 or max(replicas) >= dp or min(replicas) < 0:
        raise TraceError(
            f"{path}: stages {sorted(stages)} and dp_ranks {sorted(replicas)} do not fit "
            f"--pp {pp} --dp {dp}; give the job's degrees"
        )
    pairs = table.groupby("rank")[["stage", "dp_rank"]].nunique()
    if (pairs > 1).any(axis=None):
        rank = int(pairs[(pairs > 1).any(axis=1)].index[0])
        raise TraceError(f"{path}: rank {rank} appears with several (dp_rank, stage) pairs")
    positions = table[["stage", "dp_rank"]].drop_duplicates()
    if table["rank"].nunique() != len(positions):
        raise TraceError(f"{path}: {table['rank'].nunique()} ranks for {len(positions)} "
                         "(dp_rank, stage) workers; a worker is one rank")  # fmt: skip


def _map_ops(table: pd.DataFrame, worker_of: dict, pp: int, dp: int) -> pd.DataFrame:
    """The per-op rows in the importers/ops.py form (see the module docstring)."""
    n = len(table)
    optype = table["optype"].to_numpy()
    kind = pd.Categorical(table["optype"], categories=OPTYPES).codes  # (ops,) index in OPTYPES
    stage = table["stage"].to_numpy(dtype=np.int64)
    replica = table["dp_rank"].to_numpy(dtype=np.int64)
    step = table["step"].to_numpy(dtype=np.int64)
    mb = table["mb_id"].fillna(-1).to_numpy(dtype=np.int64)
    nth = table["seq_id"].to_numpy(dtype=np.int64)  # n-th op of its type in the step
    worker = table["rank"].to_numpy(dtype=np.int64)
    phase = np.full(n, "", dtype=object)
    axis = np.full(n, "", dtype=object)
    op = np.full(n, "", dtype=object)
    group_id = np.full(n, -1, dtype=np.int64)
    group_size = np.zeros(n, dtype=np.int64)
    peer = np.full(n, -1, dtype=np.int64)
    seq = np.zeros(n, dtype=np.int64)
    grid = np.full((pp, dp), -1, dtype=np.int64)  # [stage, dp_rank] -> worker (position_ids)
    for (stage_, replica_), w in worker_of.items():
        grid[stage_, replica_] = w
    first_of, last_of, lowest_of_stage = grid[0], grid[pp - 1], grid.min(axis=1)
    for name, phase_name in COMPUTE.items():
        phase[kind == OPTYPES.index(name)] = phase_name
    for name, (p2p_op, offset, direction) in P2P.items():
        rows = np.flatnonzero(kind == OPTYPES.index(name))
        if rows.size == 0:
            continue
        peer_stage = stage[rows] + offset
        if ((peer_stage < 0) | (peer_stage >= pp)).any():
            raise TraceError(f"{name} on a stage with no neighbour in that direction (pp={pp})")
        peers = grid[peer_stage, replica[rows]]
        op[rows], axis[rows], phase[rows] = p2p_op, "pp", "pipeline_wait"
        peer[rows], group_size[rows] = peers, 2
        group_id[rows] = np.minimum(worker[rows], peers)
        seq[rows] = (step[rows] * 2 + direction) * 1_000_000 + nth[rows]
    for name, (coll_op, coll_axis, coll_phase) in COLLECTIVES.items():
        rows = np.flatnonzero(kind == OPTYPES.index(name))
        if rows.size == 0:
            continue
        op[rows], axis[rows], phase[rows] = coll_op, coll_axis, coll_phase
        if coll_axis == "dp":  # the stage's dp_ranks
            group_id[rows] = lowest_of_stage[stage[rows]]
            group_size[rows] = len(first_of)
        elif coll_axis == "world":  # the gradient norm's all-reduce: every worker
            group_id[rows], group_size[rows] = grid.min(), grid.size
        elif coll_axis == "pp":  # first and last stage of one dp_rank
            group_id[rows] = np.minimum(first_of[replica[rows]], last_of[replica[rows]])
            group_size[rows] = 2 if pp > 1 else 1
        else:  # tp, folded into the worker
            group_id[rows], group_size[rows] = worker[rows], 1
    # A group's members issue its collectives in one order: the nth call on an axis in a step,
    # over every collective type (a reduce-scatter and the all-gather after it are two calls).
    rows = np.flatnonzero(kind >= len(COMPUTE) + len(P2P))  # the collectives
    axis_code = pd.factorize(axis[rows])[0]
    start = table["start_ts"].to_numpy()[rows]
    order = np.lexsort((start, axis_code, step[rows], worker[rows]))
    key = np.stack([worker[rows], step[rows], axis_code])[:, order]
    new_group = np.r_[True, (key[:, 1:] != key[:, :-1]).any(axis=0)]
    position = np.arange(len(order))
    nth = position - np.maximum.accumulate(np.where(new_group, position, 0)) + 1
    seq[rows[order]] = step[rows[order]] * 1_000_000 + nth
    return pd.DataFrame({
        "worker": worker, "step": step, "optype": optype, "phase": phase, "mb": mb,
        "start_s": table["start_ts"].to_numpy(dtype=np.float64),
        "duration_s": table["duration"].to_numpy(dtype=np.float64), "op": op,
        "axis": axis, "group_id": group_id, "group_size": group_size, "peer": peer, "seq": seq,
        "bytes": np.zeros(n, dtype=np.int64),
    })  # fmt: skip
