"""Read PyTorch profiler (Kineto) Chrome traces, one file per rank, into the ops/workers tables.

Input: a folder of `*.json` / `*.json.gz` files that `torch.profiler` wrote on every rank of one
job (`export_chrome_trace` or `tensorboard_trace_handler`). What each file gives:

- rank and world size: `distributedInfo.rank` / `.world_size`; full rank lists and descriptions
  of the rank's process groups: `distributedInfo.pg_config`; host: `host_name`, else the
  `<host>_<pid>.<ns>.pt.trace.json` name `tensorboard_trace_handler` gives the file, else "".
- times: `baseTimeNanoseconds` (epoch offset, 0 when absent) + `ts`; `ts` and `dur` in µs.
- steps: CPU `ProfilerStep#N` spans. An operation belongs to the step whose span holds its start;
  operations outside every step are dropped.
- collectives: CPU `record_param_comms` events, the outermost one per call, whose args carry the
  collective name, element counts, dtype and process group (PyTorch `saveNcclMeta`). The NCCL
  backend records them; gloo does not (torch 2.13: only `c10d::allreduce_`-style ops without a
  group), so such a trace is refused rather than imported without its communication. On NCCL the
  CPU event spans the call (launch), not the device kernel. optype: the "Collective name"
  (`allreduce`, `_allgather_base`, ...); op: the same as ranktrace names it (`all_reduce`, ...).

Heuristics, as the profiler names neither parallel axes nor phases:

- axis of a collective: a word of its group description (`mesh_tp` → tp; tp/tensor → tp;
  dp/ddp/fsdp/hsdp/data → dp; pp/pipe/pipeline → pp); else a group of every rank → world; else a
  group of consecutive ranks → tp when the job also has groups of strided ranks (a dp × tp mesh)
  and dp when it has none (dp × pp); strided → dp. send/recv → pp.
- phase spans: user annotations and Python functions named like `*forward*`, `*backward*`,
  `*optimizer*` (`Optimizer.step#AdamW.step`) or `enumerate(DataLoader)*` (data), and the
  `autograd::engine::evaluate_function*` ops (backward). Nested or overlapping spans of a worker
  are trimmed so the outer, earlier one owns the time.
- phase of a collective: pp → pipeline_wait; dp → grad_sync; tp → the enclosing phase span
  (forward or backward, else forward); world → forward in forward, grad_sync in backward (DDP on
  the default group), data in data, else optimizer.
- compute: each phase span minus the time inside collectives, as `forward-compute`,
  `backward-compute`, `optimizer` or `data` ops (one per gap between collectives); a step of a
  worker with no phase span gives `compute` ops (phase forward) covering its ProfilerStep span
  minus collectives.
- seq: a call's index among the worker's calls in the same step on its process group (send/recv:
  on its directed pair, sender → receiver), numbered across steps. Members of a group make the
  same calls in the same order, so one instance gets one seq on all of them. The trace's own
  `Seq` is not used: p2p calls share it across peers.
- workers: a rank's position in its tp/dp/pp group, from groups with a known axis (the largest
  one where several); 0 on an axis without groups; dp = rank when the job shows no such group.
"""

from __future__ import annotations

import gzip
import itertools
import json
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from importers.intervals import disjoint, lookup, minus
from importers.ops import OP_COLUMNS, WORKER_COLUMNS, TraceError, check_tables, typed
from importers.parallel import map_files

PARAM_COMMS = "record_param_comms"
STEP_PREFIX = "ProfilerStep#"
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function"
CPU_CATEGORIES = ("cpu_op", "user_annotation", "python_function")
COMPUTE_OPTYPES = {"forward": "forward-compute", "backward": "backward-compute",
                   "optimizer": "optimizer", "data": "data"}  # fmt: skip
# c10::toString(ScalarType) names, as `saveNcclMeta` writes them in "dtype".
DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4, "Short": 2,
               "Char": 1, "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16,
               "ComplexHalf": 4, "UInt16": 2, "UInt32": 4, "UInt64": 8}  # fmt: skip
AXIS_WORDS = {"tp": "tp", "tensor": "tp", "dp": "dp", "ddp": "dp", "fsdp": "dp", "hsdp": "dp",
              "data": "dp", "pp": "pp", "pipe": "pp", "pipeline": "pp"}  # fmt: skip
# Kineto collective names → the op names ranktrace's own telemetry uses.
OP_PATTERNS = (
    ("allreduce", "all_reduce"),
    ("allgather", "all_gather"),
    ("reducescatter", "reduce_scatter"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("barrier", "barrier"),
)
SKIPPED_COLLECTIVES = ("init",)  # communicator set-up, not an exchange
PEER_KEYS = ("Dst Rank", "Src Rank", "Dst", "Src", "dst", "src", "Peer")
TRACE_HANDLER_NAME = re.compile(r"^(?P<host>.+)_\d+\.\d+\.pt\.trace\.json(\.gz)?$")


class _Worker(NamedTuple):
    host: str
    comms: pd.DataFrame  # one row per collective call, before axis, phase and seq
    compute: pd.DataFrame  # finished compute ops
    described: list[tuple[tuple[int, ...], str]]  # (ranks, axis) of pg_config groups


def read_profiler_dir(directory: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(ops, workers) of every `*.json` / `*.json.gz` trace in `directory` (one per rank).

    Raises TraceError, naming the file, the problem and the fix, for a folder without traces, a
    file that is not a profiler trace or lacks its rank or ProfilerStep spans, two files of one
    rank, disagreeing world sizes, missing ranks, collectives without record_param_comms (gloo)
    and a send/recv whose peer the trace does not name.
    """
    files = _trace_files(Path(directory))
    workers: dict[int, _Worker] = {}
    world, world_file = -1, ""
    for path, (rank, size, worker) in zip(files, map_files(_read_file, files), strict=True):
        if world < 0:
            world, world_file = size, path.name
        elif size != world:
            raise TraceError(
                f"{path.name} says world_size {size} but {world_file} says {world}: "
                "keep only the traces of one job in the folder"
            )
        if not 0 <= rank < world:
            raise TraceError(f"{path.name}: rank {rank} outside world_size {world}")
        if rank in workers:
            raise TraceError(
                f"{path.name}: rank {rank} is also in another file of the folder: "
                "keep one trace per rank (one profiling window)"
            )
        workers[rank] = worker
    missing = sorted(set(range(world)) - set(workers))
    if missing:
        raise TraceError(
            f"{directory}: no trace of rank(s) {missing[:8]} of world_size {world}: "
            "copy every rank's trace into the folder"
        )
    comms = _job_collectives(pd.concat([w.comms for w in workers.values()]), world)
    ops = pd.concat([comms, *(w.compute for w in workers.values())], ignore_index=True)
    ops = ops.sort_values(["worker", "start_s"], kind="stable", ignore_index=True)
    table = _workers_table(workers, comms, world)
    check_tables(ops, table)
    return typed(ops, OP_COLUMNS), typed(table, WORKER_COLUMNS)


def _read_file(path: Path) -> tuple[int, int, _Worker]:
    """(rank, world size, what the trace holds) of one rank's file."""
    trace = _load(path)
    rank, size = _identity(trace, path)
    return rank, size, _read_worker(trace, path, rank, size)


def _trace_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise TraceError(
            f"{directory}: no such folder; pass the folder of per-rank profiler traces"
        )
    files = sorted(p for p in directory.iterdir() if p.name.endswith((".json", ".json.gz")))
    if not files:
        raise TraceError(
            f"{directory}: no *.json or *.json.gz trace; pass the folder that "
            "torch.profiler wrote one trace per rank into"
        )
    return files


def _load(path: Path) -> dict:
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError, bad gzip, bad UTF-8
        raise TraceError(
            f"{path.name}: not a JSON trace ({e}); export it with "
            "prof.export_chrome_trace() or tensorboard_trace_handler"
        ) from e
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(
            f"{path.name}: no traceEvents list, so not a PyTorch profiler trace; "
            "export it with prof.export_chrome_trace()"
        )
    return trace


def _identity(trace: dict, path: Path) -> tuple[int, int]:
    info = trace.get("distributedInfo")
    if not isinstance(info, dict) or "rank" not in info:
        raise TraceError(
            f"{path.name}: no distributedInfo.rank; profile after "
            "torch.distributed.init_process_group so each trace names its rank"
        )
    if "world_size" not in info:
        raise TraceError(
            f"{path.name}: no distributedInfo.world_size; profile after "
            "torch.distributed.init_process_group"
        )
    return int(info["rank"]), int(info["world_size"])


def _read_worker(trace: dict, path: Path, rank: int, world: int) -> _Worker:
    steps, spans, comm_events, c10d_op = _classify(trace["traceEvents"])
    if not steps:
        raise TraceError(
            f"{path.name}: no ProfilerStep#N spans; profile with a schedule and call "
            "prof.step() once per training step"
        )
    if c10d_op and not comm_events:
        raise TraceError(
            f"{path.name}: collectives ({c10d_op}) without record_param_comms metadata, which "
            "the gloo backend does not record; import a trace of an NCCL run, or record this "
            "job with ranktrace's own telemetry"
        )
    steps.sort(key=lambda s: s[1])
    step_no, step_start, dur = (np.array(column) for column in zip(*steps, strict=True))
    step_end = step_start + dur
    pg = _pg_config(trace)
    comms = _comm_rows(comm_events, rank, world, {n: r for n, (r, _) in pg.items()}, path)
    comms["step"] = lookup(comms["ts"].to_numpy(), step_start, step_end, step_no, -1)
    comms = comms[comms["step"] >= 0].sort_values("ts", kind="stable")
    span_phase, span_start, span_end = disjoint(spans)
    comms["enclosing"] = lookup(comms["ts"].to_numpy(), span_start, span_end, span_phase, "")
    comms["idx"] = comms.groupby(["key", "step"]).cumcount()
    span_step = lookup(span_start, step_start, step_end, step_no, -1)
    bare = ~np.isin(step_no, span_step)  # a step without phase spans is one "compute" span
    inside = span_step >= 0
    compute = _compute_ops(
        np.concatenate([span_phase[inside], np.full(bare.sum(), "compute", dtype=object)]),
        np.concatenate([span_step[inside], step_no[bare]]),
        np.concatenate([span_start[inside], step_start[bare]]),
        np.concatenate([span_end[inside], step_end[bare]]),
        comms,
    )
    base_s = float(trace.get("baseTimeNanoseconds", 0)) / 1e9
    compute["start_s"] += base_s
    comms["start_s"] = base_s + comms["ts"] * 1e-6
    comms["duration_s"] = comms["dur"] * 1e-6
    comms["worker"] = compute["worker"] = rank
    described = [(r, AXIS_WORDS[w]) for r, desc in pg.values() if (w := _axis_word(desc))]
    return _Worker(_host(trace, path), comms, compute, described)


def _compute_ops(phase, step, start, end, comms: pd.DataFrame) -> pd.DataFrame:
    """The phase spans (µs) minus the collectives' time: compute ops, start_s from the trace's 0."""
    index, start, end = minus(
        start, end, comms["ts"].to_numpy(), (comms["ts"] + comms["dur"]).to_numpy()
    )
    phase = phase[index]
    return pd.DataFrame({
        "step": step[index], "optype": [COMPUTE_OPTYPES.get(p, "compute") for p in phase],
        "phase": np.where(phase == "compute", "forward", phase), "mb": -1,
        "start_s": start * 1e-6, "duration_s": (end - start) * 1e-6, "op": "", "axis": "",
        "group_id": -1, "group_size": 0, "peer": -1, "seq": -1, "bytes": 0,
    })  # fmt: skip


def _classify(events: list) -> tuple[list, list, list, str]:
    """One pass: (ProfilerStep (n, ts, dur), phase spans, record_param_comms, a c10d op name)."""
    steps, spans, comms, c10d_op = [], [], [], ""
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("cat") not in CPU_CATEGORIES:
            continue
        name = e.get("name", "")
        if name == PARAM_COMMS:
            comms.append(e)
        elif name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX) :].isdigit():
            steps.append((int(name[len(STEP_PREFIX) :]), float(e["ts"]), float(e.get("dur", 0))))
        elif name.startswith("c10d::"):
            c10d_op = name
        elif phase := _span_phase(name, e["cat"]):
            spans.append((phase, float(e["ts"]), float(e.get("dur", 0))))
    return steps, spans, comms, c10d_op


def _span_phase(name: str, category: str) -> str:
    if category == "cpu_op":
        return "backward" if name.startswith(AUTOGRAD_PREFIX) else ""
    # A Python function event is "path/file.py(line): function": match the function only.
    lower = name.rsplit("): ", 1)[-1].lower() if category == "python_function" else name.lower()
    if lower.startswith("enumerate(dataloader)"):
        return "data"
    for word in ("optimizer", "backward", "forward"):
        if word in lower:
            return word
    return ""


def _pg_config(trace: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Process group name → (ranks, description), from distributedInfo.pg_config."""
    config = trace["distributedInfo"].get("pg_config") or []
    return {str(g["pg_name"]): (tuple(sorted(int(r) for r in g.get("ranks", []))),
                                str(g.get("pg_desc", "")))
            for g in config if isinstance(g, dict) and "pg_name" in g}  # fmt: skip


def _comm_rows(events: list, rank: int, world: int, pg_ranks: dict, path: Path) -> pd.DataFrame:
    rows = []
    for e in events:
        args = e.get("args") or {}
        name = str(args.get("Collective name", ""))
        if name in SKIPPED_COLLECTIVES:
            continue
        pg = str(args.get("Process Group Name", ""))
        ranks = _group_ranks(args, pg_ranks.get(pg), world)
        p2p = name in ("send", "recv") or name.startswith("recv")
        peer = _peer(args, ranks, rank) if p2p else -1
        if peer is None:
            raise TraceError(
                f"{path.name}: a {name} at ts {e['ts']} µs names no peer (no Dst/Src "
                f"Rank arg, group {list(ranks)[:8]}); re-profile with torch >= 2.4"
            )
        src, dst = (rank, peer) if name == "send" else (peer, rank)
        nelems = max(int(args.get("In msg nelems", 0)), int(args.get("Out msg nelems", 0)))
        dtype = str(args.get("dtype", ""))
        itemsize = 1 if dtype.startswith("Float8") else DTYPE_BYTES.get(dtype, 0)
        rows.append((
            float(e["ts"]), float(e.get("dur", 0)), str(e.get("tid", "")), name, _op(name),
            nelems * itemsize, peer, ranks, str(args.get("Process Group Description", "")), p2p,
            f"p2p|{pg}|{src}>{dst}" if p2p else f"{pg}|{ranks}",
            min(rank, peer) if p2p else min(ranks, default=rank),
            2 if p2p else max(len(ranks), int(args.get("Group size", 0))),
        ))  # fmt: skip
    columns = ["ts", "dur", "tid", "optype", "op", "bytes", "peer", "ranks", "desc", "p2p", "key",
               "group_id", "group_size"]  # fmt: skip
    comms = pd.DataFrame(rows, columns=columns).sort_values(["tid", "ts"], kind="stable")
    # The outermost record_param_comms of a thread is the call; nested ones are its parts.
    end = comms["ts"] + comms["dur"]
    outer_end = end.groupby(comms["tid"]).cummax().groupby(comms["tid"]).shift()
    return comms[~(end <= outer_end)].drop(columns="tid")


def _group_ranks(args: dict, configured: tuple | None, world: int) -> tuple[int, ...]:
    """Global ranks of a call's group: pg_config's list, else the (maybe truncated) arg."""
    if configured:
        return configured
    text = str(args.get("Process Group Ranks", ""))
    listed = tuple(sorted(int(t) for t in re.findall(r"-?\d+", text)))
    size = int(args.get("Group size", len(listed)))
    if "..." in text or not listed:  # saveNcclMeta keeps 30 ranks of longer lists
        start, stride = args.get("Global rank start"), args.get("Global rank stride")
        if start is not None and stride is not None:
            return tuple(range(int(start), int(start) + int(stride) * size, int(stride)))
        if size == world:
            return tuple(range(world))
    return listed


def _peer(args: dict, ranks: tuple[int, ...], rank: int) -> int | None:
    for key in PEER_KEYS:
        if key in args:
            return int(args[key])
    if len(ranks) == 2 and rank in ranks:
        return ranks[0] if ranks[1] == rank else ranks[1]
    local = args.get("Rank")  # for send/recv saveNcclMeta stores the peer's group rank here
    if local is not None and 0 <= int(local) < len(ranks):
        return ranks[int(local)]
    return None


def _op(name: str) -> str:
    flat = name.lower().replace("_", "")
    if flat.startswith("recv"):
        return "recv"
    return next((op for pattern, op in OP_PATTERNS if pattern in flat), name)


def _axis_word(description: str) -> str:
    words = re.split(r"[^a-z0-9]+", description.lower())
    return next((w for w in words if w in AXIS_WORDS), "")


def _consecutive(ranks: tuple[int, ...]) -> bool:
    return all(b - a == 1 for a, b in itertools.pairwise(ranks))


def _job_collectives(comms: pd.DataFrame, world: int) -> pd.DataFrame:
    """Axis, phase and seq of every collective, which need the whole job's groups."""
    groups = comms.loc[~comms["p2p"], ["key", "ranks", "desc", "group_size"]].drop_duplicates("key")
    plain = [
        r
        for r, d, n in zip(groups["ranks"], groups["desc"], groups["group_size"], strict=True)
        if not _axis_word(d) and n < world
    ]
    strided = any(not _consecutive(r) for r in plain)
    axis_of = {}
    for key, ranks, desc, size in groups.itertuples(index=False):
        if word := _axis_word(desc):
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
    order = comms["step"] * (int(comms["idx"].max()) + 1 if len(comms) else 1) + comms["idx"]
    comms["seq"] = order.groupby(comms["key"]).rank(method="dense").fillna(0).astype("int64") - 1
    comms["mb"] = -1
    return comms


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


def _workers_table(workers: dict[int, _Worker], comms: pd.DataFrame, world: int) -> pd.DataFrame:
    """Mesh coordinates from the groups of known axis; dp = rank when there are none."""
    seen = comms.loc[comms["axis"].isin(["tp", "dp"]), ["ranks", "axis"]]
    groups = {*zip(seen["ranks"], seen["axis"], strict=True)}
    groups |= {g for w in workers.values() for g in w.described}
    stages = {} if any(a == "pp" for _, a in groups) else _stages_from_p2p(comms)
    rows = []
    for rank in range(world):
        coords = {}
        for axis in ("pp", "dp", "tp"):
            mine = [r for r, a in groups if a == axis and rank in r]
            coords[axis] = sorted(max(mine, key=len)).index(rank) if mine else 0
        if rank in stages:
            coords["pp"] = stages[rank]
        if not groups and not stages:
            coords["dp"] = rank
        rows.append({"worker": rank, **coords, "host": workers[rank].host})
    return pd.DataFrame(rows, columns=list(WORKER_COLUMNS))


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


def _host(trace: dict, path: Path) -> str:
    if trace.get("host_name"):
        return str(trace["host_name"])
    match = TRACE_HANDLER_NAME.match(path.name)
    return match["host"] if match else ""
