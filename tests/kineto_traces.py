"""Synthetic PyTorch profiler (Kineto) traces of a small pp × dp × tp job, for importer tests.

`write_profiler_traces` writes one `rank{r}.json` per rank, shaped like `export_chrome_trace` of an
NCCL job: `distributedInfo` with `pg_config`, `baseTimeNanoseconds`, `ProfilerStep#N` spans,
user annotations for data / forward / backward / `Optimizer.step#SGD.step`, `aten::mm` ops,
`autograd::engine::evaluate_function` ops on an autograd thread, and per collective call a
`c10d::*` op, a nested `record_param_comms` with `saveNcclMeta`'s args, an `nccl:*` annotation and
an `ncclDevKernel_*` GPU kernel. Ranks are laid out tp innermost: rank = (p * dp + d) * tp + t.

Every rank runs one program per step on a shared clock: data (DATA_US); per micro-batch, in
the 1F1B order, a forward (recv from the previous stage, FORWARD_US / micro_batches of compute
around a tp all-reduce, send on) and a backward (recv from the next stage, BACKWARD_US /
micro_batches around a tp all-reduce, send back; the last one ends with the dp gradient
all-reduce, inside backward as DDP does); then the optimizer (OPTIMIZER_US and a world
all-reduce). A collective ends at once on all members: the last arrival + COLLECTIVE_US. A send
does not wait (COLLECTIVE_US, as an NCCL launch); a recv ends COLLECTIVE_US after both it and
its send have started. The slow rank's compute lasts `slow_factor` times longer, so the others
wait in the collectives.
"""

from __future__ import annotations

import json
from pathlib import Path

FIRST_STEP = 3  # as after a profiler schedule's wait and warmup steps
BASE_NS = 1_790_000_000_000_000_000  # baseTimeNanoseconds of rank 0
DATA_US, FORWARD_US, BACKWARD_US, OPTIMIZER_US, COLLECTIVE_US = 300.0, 3000, 6000, 1000, 200
GRAD_NELEMS, ACTIVATION_NELEMS = 1 << 20, 1 << 14  # Float gradients, BFloat16 activations


def write_profiler_traces(
    directory: Path,
    world_size: int = 4,
    steps: int = 4,
    tp: int = 1,
    pp: int = 1,
    micro_batches: int = 1,
    slow_rank: int | None = None,
    slow_factor: float = 1.0,
    describe_groups: bool = False,
) -> None:
    """Write `rank{r}.json` for every rank of a `pp × (world_size / (pp*tp)) × tp` job.

    Args:
        micro_batches: per step, run by pipeline stages in the 1F1B order.
        describe_groups: name the subgroups `mesh_tp` / `mesh_dp` / `mesh_pp` (as DeviceMesh does)
            instead of "undefined" (as plain `new_group` does).
    """
    dp = world_size // (tp * pp)
    assert dp * tp * pp == world_size, f"tp={tp} × pp={pp} does not divide {world_size}"
    groups = _groups(world_size, tp, dp, pp, describe_groups)
    programs = {r: _program(r, tp, dp, pp, steps, micro_batches, groups) for r in range(world_size)}
    factor = {r: slow_factor if r == slow_rank else 1.0 for r in range(world_size)}
    events = _Simulation(programs, factor, groups).run()
    Path(directory).mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):
        offset_us = 5_000_000.0 + 1000.0 * rank  # each rank its own ts origin, one epoch clock
        trace = {
            "schemaVersion": 1,
            "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
            "distributedInfo": {
                "backend": "nccl", "rank": rank, "world_size": world_size,
                "pg_count": sum(rank in g["ranks"] for g in groups.values()),
                "pg_config": [_pg_config(n, g) for n, g in groups.items() if rank in g["ranks"]],
                "nccl_version": "2.21.5",
            },
            "host_name": f"node{rank // 8}",
            "baseTimeNanoseconds": BASE_NS - int(offset_us * 1000),
            "traceEvents": _metadata(rank) + [_shift(e, offset_us) for e in events[rank]],
        }  # fmt: skip
        (Path(directory) / f"rank{rank}.json").write_text(json.dumps(trace))


def _groups(world: int, tp: int, dp: int, pp: int, describe: bool) -> dict[str, dict]:
    """name → {ranks, desc} of the default group and every subgroup, in creation order."""

    def rank(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    families = {
        "tp": [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
    groups = {"0": {"ranks": list(range(world)), "desc": "default_pg", "axis": "world"}}
    for axis, family in families.items():
        for ranks in family:
            if 1 < len(ranks) < world:
                desc = f"mesh_{axis}" if describe else "undefined"
                groups[str(len(groups))] = {"ranks": ranks, "desc": desc, "axis": axis}
    return groups


def _group_of(groups: dict, axis: str, rank: int) -> str:
    """Name of `rank`'s group on `axis`: its subgroup, or the default group when that is all."""
    mine = [n for n, g in groups.items() if g["axis"] == axis and rank in g["ranks"]]
    return mine[0] if mine else "0"


def _program(rank: int, tp: int, dp: int, pp: int, steps: int, micro_batches: int,
             groups: dict) -> list[tuple]:  # fmt: skip
    """The rank's actions: ("open", name) / ("close",) / ("compute", µs, phase) /
    ("coll", group, collective, nelems, dtype) / ("send" | "recv", peer, nelems)."""
    stage = rank // (dp * tp)
    prev, nxt = rank - dp * tp, rank + dp * tp
    tp_group, dp_group = _group_of(groups, "tp", rank), _group_of(groups, "dp", rank)
    tp_all_reduce = [("coll", tp_group, "allreduce", ACTIVATION_NELEMS, "BFloat16")] * (tp > 1)
    forward_us, backward_us = FORWARD_US / micro_batches / 2, BACKWARD_US / micro_batches / 2
    actions: list[tuple] = [("coll", "0", "barrier", 1, "Float")]  # before profiling: dropped
    for step in range(FIRST_STEP, FIRST_STEP + steps):
        actions += [("open", f"ProfilerStep#{step}"),
                    ("open", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"),
                    ("compute", DATA_US, "data"), ("close",)]  # fmt: skip
        for kind, mb in _one_f_one_b(stage, pp, micro_batches):
            if kind == "forward":
                actions += [("open", "forward")]
                actions += [("recv", prev, ACTIVATION_NELEMS)] if stage > 0 else []
                actions += [("compute", forward_us, "forward"), *tp_all_reduce]
                actions += [("compute", forward_us, "forward")]
                actions += [("send", nxt, ACTIVATION_NELEMS)] if stage < pp - 1 else []
            else:
                actions += [("open", "backward")]
                actions += [("recv", nxt, ACTIVATION_NELEMS)] if stage < pp - 1 else []
                actions += [("compute", backward_us, "backward"), *tp_all_reduce]
                actions += [("compute", backward_us, "backward")]
                actions += [("send", prev, ACTIVATION_NELEMS)] if stage > 0 else []
                last = mb == micro_batches - 1  # DDP syncs gradients in the last backward
                actions += [("coll", dp_group, "allreduce", GRAD_NELEMS, "Float")] * (
                    dp > 1 and last
                )
            actions += [("close",)]
        actions += [("open", "Optimizer.step#SGD.step"), ("compute", OPTIMIZER_US, "optimizer"),
                    ("coll", "0", "allreduce", 1, "Float"), ("close",), ("close",)]  # fmt: skip
    return actions


def _one_f_one_b(stage: int, pp: int, micro_batches: int) -> list[tuple[str, int]]:
    """1F1B: pp - stage - 1 warm-up forwards, then forward/backward pairs, then the backwards."""
    warmup = min(pp - stage - 1, micro_batches)
    order = [("forward", mb) for mb in range(warmup)]
    for mb in range(micro_batches - warmup):
        order += [("forward", warmup + mb), ("backward", mb)]
    return order + [("backward", mb) for mb in range(micro_batches - warmup, micro_batches)]


class _Simulation:
    """Every rank's program run on one clock (µs from 0), collecting each rank's Kineto events."""

    def __init__(self, programs: dict, factor: dict, groups: dict) -> None:
        self.programs, self.factor, self.groups = programs, factor, groups
        self.clock = dict.fromkeys(programs, 0.0)
        self.pc = dict.fromkeys(programs, 0)
        self.opened: dict[int, list] = {r: [] for r in programs}
        self.events: dict[int, list[dict]] = {r: [] for r in programs}
        self.calls: dict[tuple, int] = {}  # (rank, group) → calls so far: the "Seq" arg
        self.sent: dict[tuple, list[float]] = {}  # (src, dst) → start times of unreceived sends

    def run(self) -> dict[int, list[dict]]:
        while any(self.next(r) for r in self.programs):
            progressed = [self.local(r) for r in self.programs]
            progressed += [self.communicate(r) for r in self.programs]
            assert any(progressed), "the generated programs deadlock"
        return self.events

    def next(self, rank: int) -> tuple | None:
        program = self.programs[rank]
        return program[self.pc[rank]] if self.pc[rank] < len(program) else None

    def local(self, r: int) -> bool:
        """Run r's annotations and compute up to its next communication."""
        ran = False
        while (action := self.next(r)) and action[0] in ("open", "close", "compute"):
            if action[0] == "open":
                self.opened[r].append((action[1], self.clock[r]))
            elif action[0] == "close":
                name, start = self.opened[r].pop()
                self.events[r] += _annotation(name, start, self.clock[r])
            else:
                dur = action[1] * self.factor[r]
                self.events[r] += _compute(action[2], self.clock[r], dur)
                self.clock[r] += dur
            self.pc[r] += 1
            ran = True
        return ran

    def communicate(self, r: int) -> bool:
        """Finish r's send (it does not wait), its recv once sent, or its collective once every
        member waits in it."""
        action = self.next(r)
        if action and action[0] == "coll":
            members = self.groups[action[1]]["ranks"]
            if any(self.next(m) != action for m in members):
                return False
            end = max(self.clock[m] for m in members) + COLLECTIVE_US
            for m in members:
                self.record(m, None, action, end)
            return True
        if action and action[0] in ("send", "recv"):
            kind, peer, nelems = action
            pair = (r, peer) if kind == "send" else (peer, r)
            call = (kind, _pair_group(self.groups, r, peer), kind, nelems, "BFloat16")
            if kind == "send":
                self.sent.setdefault(pair, []).append(self.clock[r])
                self.record(r, peer, call, self.clock[r] + COLLECTIVE_US)
                return True
            if self.sent.get(pair):
                self.record(
                    r, peer, call, max(self.clock[r], self.sent[pair].pop(0)) + COLLECTIVE_US
                )
                return True
        return False

    def record(self, rank: int, peer: int | None, call: tuple, end: float) -> None:
        group = call[1]
        seq = self.calls[rank, group] = self.calls.get((rank, group), -1) + 1
        self.events[rank] += _collective(call, self.groups[group], rank, peer, seq,
                                         self.clock[rank], end)  # fmt: skip
        self.clock[rank], self.pc[rank] = end, self.pc[rank] + 1


def _pair_group(groups: dict, a: int, b: int) -> str:
    """The pp group holding both ends of a transfer, else the default group."""
    pairs = (n for n, g in groups.items() if g["axis"] == "pp" and {a, b} <= set(g["ranks"]))
    return next(pairs, "0")


def _annotation(name: str, start: float, end: float) -> list[dict]:
    event = {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": start,
             "dur": end - start, "args": {"External id": 1, "Record function id": 0}}  # fmt: skip
    if not name.startswith("ProfilerStep#"):
        return [event]
    on_gpu = {**event, "cat": "gpu_user_annotation", "pid": 0, "tid": 7, "ts": start + 50.0}
    return [event, on_gpu]


def _compute(phase: str, start: float, dur: float) -> list[dict]:
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": start,
               "dur": dur, "args": {"External id": 2, "Sequence number": 0}}]  # fmt: skip
    if phase == "backward":  # the autograd engine runs backward ops on its own thread
        events.append({**events[0], "name": "autograd::engine::evaluate_function: MmBackward0",
                       "tid": 2, "ts": start + 1.0, "dur": max(dur - 2.0, 0.0)})  # fmt: skip
    return events


def _collective(action, group, rank, peer, seq, start, end) -> list[dict]:
    """c10d op ⊃ record_param_comms (saveNcclMeta args), nccl annotation and GPU kernel."""
    kind, name, collective, nelems, dtype = action
    ranks = group["ranks"]
    stride = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    args = {
        "External id": 3, "Record function id": 0, "Collective name": collective,
        "dtype": dtype, "In msg nelems": nelems, "Out msg nelems": nelems,
        "In split size": "[]", "Out split size": "[]", "Global rank start": ranks[0],
        "Global rank stride": stride, "Group size": len(ranks), "Process Group Name": name,
        "Process Group Description": group["desc"],
        "Process Group Ranks": "[" + ", ".join(map(str, ranks)) + "]",
        "Rank": ranks.index(peer if peer is not None else rank), "Seq": seq,
        "Is asynchronized op": 0,
    }  # fmt: skip
    if kind == "send":
        args["Dst Rank"] = peer
    elif kind == "recv":
        args["Src Rank"] = peer
    op = {"send": "c10d::send", "recv": "c10d::recv_"}.get(kind, f"c10d::{collective}_")
    dur = end - start
    base = {"ph": "X", "pid": 1, "tid": 1, "ts": start, "dur": dur}
    kernel = f"ncclDevKernel_{'AllReduce_Sum_f32' if kind == 'coll' else 'SendRecv'}_RING_LL"
    return [
        {**base, "cat": "cpu_op", "name": op, "args": {"External id": 3}},
        {**base, "cat": "cpu_op", "name": "record_param_comms", "args": args},
        {**base, "cat": "user_annotation", "name": f"nccl:{collective}", "args": {}},
        {**base, "cat": "kernel", "name": f"{kernel}(ncclDevComm*, unsigned long, ncclWork*)",
         "pid": 0, "tid": 7, "ts": start + 30.0, "dur": max(dur - 30.0, 1.0), "args": args},
    ]  # fmt: skip


def _pg_config(name: str, group: dict) -> dict:
    return {"pg_name": name, "pg_desc": group["desc"], "backend_config": "cuda:nccl",
            "pg_size": len(group["ranks"]), "ranks": group["ranks"]}  # fmt: skip


def _metadata(rank: int) -> list[dict]:
    return [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "thread 1"}},
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": f"GPU {rank}"}},
    ]


def _shift(event: dict, offset_us: float) -> dict:
    return {**event, "ts": event["ts"] + offset_us}
