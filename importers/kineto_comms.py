"""What a PyTorch profiler trace says about one rank's communication calls: its
`record_param_comms` events (PyTorch's `saveNcclMeta` args) read into one row per call, the
collective named by an NCCL kernel, and the rows finished into ranktrace's op, group and peer.

Two forms of `record_param_comms` exist:
- newer (torch 2.x): "Collective name", "In msg nelems" / "Out msg nelems", "dtype",
  "Process Group Name" / "Description" / "Ranks", "Group size", "Seq", "Dst Rank" / "Src Rank";
- older: "Input Dims", "Input type", "Output Dims" or no args at all: no collective name, no
  group, no sequence number. The collective then comes from the NCCL kernel the call launched
  (`ncclKernel_AllReduce_RING_LL_Sum_float`, `ncclDevKernel_SendRecv`, ...: `kernel_op`) and its
  group is the default one (every rank); bytes from the first input's dims and type.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from ranktrace.importers.ops import TraceError

SKIPPED_COLLECTIVES = ("init",)  # communicator set-up, not an exchange
PEER_KEYS = ("Dst Rank", "Src Rank", "Dst", "Src", "dst", "src", "Peer")
GROUP_KEYS = ("Process Group Name", "Process Group Ranks", "Global rank start", "Group size")
# c10::toString(ScalarType) names, as `saveNcclMeta` writes them in "dtype"; the C++ type names
# an older trace's "Input type" holds.
DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4, "Short": 2,
               "Char": 1, "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16,
               "ComplexHalf": 4, "UInt16": 2, "UInt32": 4, "UInt64": 8, "float": 4,
               "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
               "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}  # fmt: skip
# Collective names (record_param_comms "Collective name", NCCL kernel names) → ranktrace's ops.
OP_PATTERNS = (
    ("allreduce", "all_reduce"),
    ("allgather", "all_gather"),
    ("reducescatter", "reduce_scatter"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("barrier", "barrier"),
)
# NCCL's kernel names: `ncclKernel_<Coll>_<Algo>_<Proto>_<Redop>_<type>(...)` (NCCL 2.7-2.18),
# `ncclDevKernel_<Coll>_...` (2.19+), `nccl<Coll><Algo><Proto>Kernel_<redop>_<type>` (older);
# <Coll> of a send/recv group (point-to-point and all-to-all) is SendRecv.
NCCL_PREFIX = re.compile(r"^nccl(?:Dev)?(?:Kernel)?_?")
KERNEL_OPS = {"AllReduce": "all_reduce", "AllGather": "all_gather",
              "ReduceScatter": "reduce_scatter", "Broadcast": "broadcast", "Reduce": "reduce",
              "SendRecv": "all_to_all", "Send": "all_to_all", "Recv": "all_to_all"}  # fmt: skip
"""A send/recv kernel inside a call that names no peer is an all-to-all (the older form names
neither the collective nor a peer; a pipeline's send/recv of that form cannot be read)."""
CALL_COLUMNS = ["ts", "dur", "tid", "name", "bytes", "peer", "local_peer", "ranks", "size",
                "desc", "pg", "pg_seq"]  # fmt: skip
"""Per call: CPU start and duration (µs), thread, collective name ("" in the older form),
payload bytes, point-to-point peer (-1) or its group rank ("Rank", -1), group ranks (None: not
recorded) and "Group size" (0), group description and name, the group's sequence number "Seq"
(-1: not recorded)."""


def comm_rows(events: list, pg_ranks: dict, world: int) -> pd.DataFrame:
    """One row per outermost `record_param_comms` of a thread (CALL_COLUMNS)."""
    rows = []
    for e in events:
        args = e.get("args") or {}
        name = str(args.get("Collective name", ""))
        if name in SKIPPED_COLLECTIVES:
            continue
        pg = str(args.get("Process Group Name", ""))
        recorded = any(key in args for key in GROUP_KEYS) or pg in pg_ranks
        ranks = _group_ranks(args, pg_ranks.get(pg), world) if recorded else None
        peer = next((int(args[key]) for key in PEER_KEYS if key in args), -1)
        seq = args.get("Seq")
        rows.append((
            float(e["ts"]), float(e.get("dur", 0)), str(e.get("tid", "")), name, _bytes(args),
            peer, int(args.get("Rank", -1)), ranks, int(args.get("Group size", 0)),
            str(args.get("Process Group Description", "")), pg,
            int(seq) if isinstance(seq, int | float) and seq >= 0 else -1,
        ))  # fmt: skip
    comms = pd.DataFrame(rows, columns=CALL_COLUMNS).astype({"ts": float, "dur": float})
    comms = comms.sort_values(["tid", "ts"], kind="stable")
    # The outermost record_param_comms of a thread is the call; nested ones are its parts.
    end = comms["ts"] + comms["dur"]
    outer_end = end.groupby(comms["tid"]).cummax().groupby(comms["tid"]).shift()
    return comms[~(end <= outer_end)].reset_index(drop=True)


def _bytes(args: dict) -> int:
    """Payload bytes: element count × dtype size (newer form), else the first input's dims ×
    its type (older form), else 0."""
    if "In msg nelems" in args or "Out msg nelems" in args:
        nelems = max(int(args.get("In msg nelems", 0)), int(args.get("Out msg nelems", 0)))
        dtype = str(args.get("dtype", ""))
        return nelems * (1 if dtype.startswith("Float8") else DTYPE_BYTES.get(dtype, 0))
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not isinstance(dims, list) or not dims:
        return 0
    first = dims[0]
    while isinstance(first, list) and first and isinstance(first[0], list):  # a tensor list
        first = first[0]
    dtype = types[0] if isinstance(types, list) and types else types
    if not isinstance(first, list) or not all(isinstance(d, int) for d in first):
        return 0
    return int(np.prod(first, dtype=np.int64)) * DTYPE_BYTES.get(str(dtype), 0)


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


def op_of(name: str) -> str:
    """ranktrace's op of a record_param_comms "Collective name"."""
    flat = name.lower().replace("_", "")
    if flat.startswith("recv"):
        return "recv"
    return next((op for pattern, op in OP_PATTERNS if pattern in flat), name)


def kernel_op(kernel: str) -> str:
    """ranktrace's op of an NCCL kernel name; "" when the name is not one NCCL gives."""
    prefix = NCCL_PREFIX.match(kernel)
    if not prefix:
        return ""
    rest = kernel[prefix.end() :]
    # the longest collective name the rest starts with (ReduceScatter before Reduce)
    return next((KERNEL_OPS[c] for c in sorted(KERNEL_OPS, key=len, reverse=True)
                 if rest.startswith(c)), "")  # fmt: skip


def finish_calls(comms: pd.DataFrame, rank: int, world: int, path: Path) -> pd.DataFrame:
    """Calls (CALL_COLUMNS with every name known) → optype, op, p2p, peer, group ranks, key,
    group_id, group_size, inferred. A call without a recorded group is on the default group
    (every rank), `inferred`: only its order can match it across ranks, which its key says."""
    inferred = comms["ranks"].isna().to_numpy()
    ranks = [tuple(range(world)) if r is None else r for r in comms["ranks"]]
    names = comms["name"].to_numpy(dtype=object)
    p2p = np.array([n in ("send", "recv") or n.startswith("recv") for n in names], dtype=bool)
    peers = comms["peer"].to_numpy().copy()
    for i in np.flatnonzero(p2p & (peers < 0)):
        peer = _peer_from_group(ranks[i], rank, int(comms["local_peer"].iat[i]))
        if peer is None:
            raise TraceError(
                f"{path.name}: a {names[i]} at ts {comms['ts'].iat[i]} µs names no peer (no "
                f"Dst/Src Rank arg, group {list(ranks[i])[:8]}); re-profile with torch >= 2.4"
            )
        peers[i] = peer
    peers[~p2p] = -1
    sends = names == "send"
    src, dst = np.where(sends, rank, peers), np.where(sends, peers, rank)
    pgs, sizes = comms["pg"].tolist(), comms["size"].tolist()
    keys = [
        f"p2p|{pg}|{s}>{d}" if is_p2p else ("default|inferred" if guess else f"{pg}|{group}")
        for pg, s, d, is_p2p, guess, group in zip(pgs, src, dst, p2p, inferred, ranks,
                                                  strict=True)
    ]  # fmt: skip
    group_id = [min(rank, int(peer)) if is_p2p else min(group, default=rank)
                for peer, is_p2p, group in zip(peers, p2p, ranks, strict=True)]  # fmt: skip
    group_size = [2 if is_p2p else max(len(group), size)
                  for is_p2p, group, size in zip(p2p, ranks, sizes, strict=True)]  # fmt: skip
    return comms.assign(
        ranks=ranks, p2p=p2p, peer=peers, inferred=inferred, optype=names,
        op=[op_of(n) for n in names], key=keys, group_id=group_id, group_size=group_size,
    )  # fmt: skip


def _peer_from_group(ranks: tuple[int, ...], rank: int, local: int) -> int | None:
    """The peer of a send/recv without Dst/Src: the other member of a 2-rank group, else the
    group rank saveNcclMeta stores in "Rank" for send/recv."""
    if len(ranks) == 2 and rank in ranks:
        return ranks[0] if ranks[1] == rank else ranks[1]
    if 0 <= local < len(ranks):
        return ranks[local]
    return None
