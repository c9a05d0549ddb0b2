"""Synthetic PyTorch profiler (Kineto) traces of a small pp × dp × tp job, for importer tests.

`write_profiler_traces` writes one file per rank, shaped like `export_chrome_trace` of an NCCL
job on GPUs (the real Kineto form): `distributedInfo` with `pg_config`, `deviceProperties`,
`baseTimeNanoseconds`, `ProfilerStep#N` spans, user annotations for data / forward / backward /
`Optimizer.step#SGD.step`, and for every GPU operation a CPU op (`aten::mm`, `aten::copy_`,
`autograd::engine::evaluate_function` on an autograd thread for backward) around its CUDA
runtime launch (`cudaLaunchKernel` / `cudaMemcpyAsync`, "correlation"), the GPU activity
("kernel" / "gpu_memcpy" with device, stream, correlation) and its `ac2g` flow. A collective
call is a `c10d::*` op ⊃ `record_param_comms` ⊃ its launch, an `nccl:*` annotation, and an NCCL
kernel on the NCCL stream: `ncclDevKernel_*` with the newer record_param_comms args
(`comms_form="new"`), `ncclKernel_*_RING_LL_Sum_float` with the older ones ("Input Dims",
"Input type", "Output Dims": `"old"`) or none (`"bare"`). `gpu=False` writes a CPU-only trace
instead: each op spans its work, no runtime or GPU events. Ranks are laid out tp innermost:
rank = (p * dp + d) * tp + t.

Every rank runs one program per step on a shared clock: data (DATA_US of host work, then on a
GPU a MEMCPY_US host-to-device copy); per micro-batch, in the 1F1B order, a forward (recv from
the previous stage, FORWARD_US / micro_batches of compute around a tp all-reduce, an all-to-all
on the default group when `all_to_all`, send on) and a backward (recv from the next stage,
BACKWARD_US / micro_batches around a tp all-reduce, send back; the last one ends with the dp
gradient all-reduce, inside backward as DDP does); then the optimizer (an optional `stall_us`
wait of its kernel on an event, OPTIMIZER_US and a world all-reduce) and, on a GPU, a
`cudaDeviceSynchronize`.

On a GPU the host launches (LAUNCH_US each) and runs ahead; a kernel starts LATENCY_US after its
launch at the earliest, once the kernel before it has ended. A collective's kernels end at once
on all members: the last member's start + COLLECTIVE_US; a send's kernel does not wait
(COLLECTIVE_US), a recv's ends COLLECTIVE_US after both it and its send have started. On a CPU
the same holds for the calls themselves. The slow rank's compute lasts `slow_factor` times
longer, so the others wait in the collectives; the host-slow rank's data loading lasts
`host_factor` times longer (the GPU waits for its host).
"""

from __future__ import annotations

import json
from pathlib import Path

FIRST_STEP = 3  # as after a profiler schedule's wait and warmup steps
BASE_NS = 1_790_000_000_000_000_000  # baseTimeNanoseconds of rank 0
DATA_US, FORWARD_US, BACKWARD_US, OPTIMIZER_US, COLLECTIVE_US = 300.0, 3000, 6000, 1000, 200
MEMCPY_US = 100.0  # the batch's host-to-device copy (GPU traces)
LAUNCH_US, LATENCY_US = 10.0, 5.0  # host time of one launch; launch to earliest kernel start
GRAD_NELEMS, ACTIVATION_NELEMS = 1 << 20, 1 << 14  # Float gradients, BFloat16 activations
COMPUTE_STREAM, NCCL_STREAM = 7, 20
GEMM = "sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize96x128x32_stage4_warpsize2x2x1_tensor"
OLD_TYPES = {"Float": "float", "BFloat16": "c10::BFloat16"}  # older "Input type" names
KERNEL_COLL = {"allreduce": "AllReduce", "barrier": "AllReduce", "all_to_all": "SendRecv",
               "send": "SendRecv", "recv": "SendRecv"}  # fmt: skip


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
    gpu: bool = True,
    comms_form: str = "new",
    all_to_all: bool = False,
    all_to_all_group: bool = False,
    host_slow_rank: int | None = None,
    host_factor: float = 1.0,
    stall_us: float = 0.0,
    naming: str = "rank",
    host_names: bool = True,
    ranks_per_node: int = 8,
) -> list[Path]:
    """Write one trace per rank of a `pp × (world_size / (pp*tp)) × tp` job; returns the files.

    Args:
        micro_batches: per step, run by pipeline stages in the 1F1B order.
        describe_groups: name the subgroups `mesh_tp` / `mesh_dp` / `mesh_pp` (as DeviceMesh does)
            instead of "undefined" (as plain `new_group` does).
        gpu: the GPU form (module docstring); False: a CPU-only trace.
        comms_form: "new", "old" or "bare" record_param_comms args (module docstring).
        all_to_all_group: run the all-to-all on a group of its own of every rank (`new_group`)
            rather than on the default group.
        stall_us: per step, the optimizer's kernel waits this long after the kernel before it,
            launched already (GPU traces).
        naming: file names: "rank" (`rank{r}.json`), "handler" (tensorboard_trace_handler's
            `{host}_{pid}.{ns}.pt.trace.json`) or "other" (`worker{r}_step.json`).
        host_names: record `host_name` (`node{rank // ranks_per_node}`).
    """
    dp = world_size // (tp * pp)
    assert dp * tp * pp == world_size, f"tp={tp} × pp={pp} does not divide {world_size}"
    groups = _groups(world_size, tp, dp, pp, describe_groups)
    if all_to_all_group:
        groups["a2a"] = {"ranks": list(range(world_size)), "desc": "undefined", "axis": "a2a"}
    programs = {r: _program(r, tp, dp, pp, steps, micro_batches, groups, all_to_all, stall_us)
                for r in range(world_size)}  # fmt: skip
    factor = {r: slow_factor if r == slow_rank else 1.0 for r in range(world_size)}
    host = {r: host_factor if r == host_slow_rank else 1.0 for r in range(world_size)}
    events = _Simulation(programs, factor, host, groups, gpu, comms_form).run()
    Path(directory).mkdir(parents=True, exist_ok=True)
    files = []
    for rank in range(world_size):
        offset_us = 5_000_000.0 + 1000.0 * rank  # each rank its own ts origin, one epoch clock
        node = f"node{rank // ranks_per_node}"
        trace = {
            "schemaVersion": 1,
            "deviceProperties": [{"id": 0, "name": "Tesla V100-SXM2-32GB",
                                  "computeMajor": 7, "computeMinor": 0}] if gpu else [],
            "distributedInfo": {
                "backend": "nccl", "rank": rank, "world_size": world_size,
                "pg_count": sum(rank in g["ranks"] for g in groups.values()),
                "pg_config": [_pg_config(n, g) for n, g in groups.items() if rank in g["ranks"]],
                "nccl_version": "2.21.5",
            },
            **({"host_name": node} if host_names else {}),
            "baseTimeNanoseconds": BASE_NS - int(offset_us * 1000),
            "traceEvents": _metadata(rank) + [_shift(e, offset_us) for e in events[rank]],
        }  # fmt: skip
        name = {"rank": f"rank{rank}.json", "other": f"worker{rank}_step.json",
                "handler": f"{node}_{4242 + rank}.{BASE_NS}.pt.trace.json"}[naming]  # fmt: skip
        (Path(directory) / name).write_text(json.dumps(trace))
        files.append(Path(directory) / name)
    return files


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
             groups: dict, all_to_all: bool, stall_us: float) -> list[tuple]:  # fmt: skip
    """The rank's actions: ("open", name) / ("close",) / ("compute", µs, phase) / ("data", µs) /
    ("stall", µs) / ("sync",) / ("coll", group, collective, nelems, dtype) /
    ("send" | "recv", peer, nelems)."""
    stage = rank // (dp * tp)
    prev, nxt = rank - dp * tp, rank + dp * tp
    tp_group, dp_group = _group_of(groups, "tp", rank), _group_of(groups, "dp", rank)
    tp_all_reduce = [("coll", tp_group, "allreduce", ACTIVATION_NELEMS, "BFloat16")] * (tp > 1)
    a2a_group = "a2a" if "a2a" in groups else "0"
    exchange = [("coll", a2a_group, "all_to_all", ACTIVATION_NELEMS, "BFloat16")] * all_to_all
    forward_us, backward_us = FORWARD_US / micro_batches / 2, BACKWARD_US / micro_batches / 2
    actions: list[tuple] = [("coll", "0", "barrier", 1, "Float")]  # before profiling: dropped
    for step in range(FIRST_STEP, FIRST_STEP + steps):
        actions += [("open", f"ProfilerStep#{step}"),
                    ("open", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"),
                    ("data", DATA_US), ("close",)]  # fmt: skip
        for kind, mb in _one_f_one_b(stage, pp, micro_batches):
            if kind == "forward":
                actions += [("open", "forward")]
                actions += [("recv", prev, ACTIVATION_NELEMS)] if stage > 0 else []
                actions += [("compute", forward_us, "forward"), *tp_all_reduce, *exchange]
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
        actions += [("open", "Optimizer.step#SGD.step"), ("stall", stall_us),
                    ("compute", OPTIMIZER_US, "optimizer"), ("coll", "0", "allreduce", 1, "Float"),
                    ("close",), ("sync",), ("close",)]  # fmt: skip
    return actions


def _one_f_one_b(stage: int, pp: int, micro_batches: int) -> list[tuple[str, int]]:
    """1F1B: pp - stage - 1 warm-up forwards, then forward/backward pairs, then the backwards."""
    warmup = min(pp - stage - 1, micro_batches)
    order = [("forward", mb) for mb in range(warmup)]
    for mb in range(micro_batches - warmup):
        order += [("forward", warmup + mb), ("backward", mb)]
    return order + [("backward", mb) for mb in range(micro_batches - warmup, micro_batches)]


class _Simulation:
    """Every rank's program run on one clock (µs from 0), collecting each rank's Kineto events.
    Per rank: `host` (the CPU thread's clock) and, on a GPU, `device` (when its last kernel
    ends) and `stall` (a wait the next kernel makes)."""

    def __init__(self, programs: dict, factor: dict, host_factor: dict, groups: dict, gpu: bool,
                 comms_form: str) -> None:  # fmt: skip
        self.programs, self.factor, self.host_factor = programs, factor, host_factor
        self.groups, self.gpu, self.form = groups, gpu, comms_form
        self.host = dict.fromkeys(programs, 0.0)
        self.device = dict.fromkeys(programs, 0.0)
        self.stall = dict.fromkeys(programs, 0.0)
        self.correlation = dict.fromkeys(programs, 0)
        self.pc = dict.fromkeys(programs, 0)
        self.opened: dict[int, list] = {r: [] for r in programs}
        self.events: dict[int, list[dict]] = {r: [] for r in programs}
        self.calls: dict[tuple, int] = {}  # (rank, group) → calls so far: the "Seq" arg
        self.sent: dict[tuple, list[float]] = {}  # (src, dst) → starts of unreceived sends

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
        """Run r's annotations, compute and data up to its next communication."""
        ran = False
        while (action := self.next(r)) and action[0] not in ("coll", "send", "recv"):
            kind = action[0]
            if kind == "open":
                self.opened[r].append((action[1], self.host[r]))
            elif kind == "close":
                name, start = self.opened[r].pop()
                self.events[r].append(_annotation(name, start, self.host[r]))
            elif kind == "compute":
                self.compute(r, action[1] * self.factor[r], action[2])
            elif kind == "data":
                self.data(r, action[1] * self.host_factor[r])
            elif kind == "stall":
                self.stall[r] += action[1]
            elif kind == "sync" and self.gpu:
                waited = max(self.host[r], self.device[r])
                self.events[r].append(_runtime("cudaDeviceSynchronize", self.host[r],
                                               waited - self.host[r], None))  # fmt: skip
                self.host[r] = waited
            self.pc[r] += 1
            ran = True
        return ran

    def compute(self, r: int, dur: float, phase: str) -> None:
        h = self.host[r]
        op = _cpu_op("aten::mm", h, dur if not self.gpu else LAUNCH_US)
        self.events[r].append(op)
        if phase == "backward":  # the autograd engine runs backward ops on its own thread
            self.events[r].append({**op, "name": "autograd::engine::evaluate_function: "
                                   "MmBackward0", "tid": 2})  # fmt: skip
        if not self.gpu:
            self.host[r] += dur
            return
        start = self.queue(r)
        self.launch(r, "cudaLaunchKernel", "kernel", GEMM, start, dur, COMPUTE_STREAM,
                    tid=2 if phase == "backward" else 1)  # fmt: skip
        self.device[r] = start + dur
        self.host[r] += LAUNCH_US

    def data(self, r: int, dur: float) -> None:
        """Host work (data loading), then on a GPU the batch's copy to the device."""
        if not self.gpu:
            self.events[r].append(_cpu_op("aten::mm", self.host[r], dur))
            self.host[r] += dur
            return
        self.host[r] += dur
        self.events[r].append(_cpu_op("aten::copy_", self.host[r], LAUNCH_US))
        start = self.queue(r)
        self.launch(r, "cudaMemcpyAsync", "gpu_memcpy", "Memcpy HtoD (Pageable -> Device)",
                    start, MEMCPY_US, COMPUTE_STREAM)  # fmt: skip
        self.device[r] = start + MEMCPY_US
        self.host[r] += LAUNCH_US

    def queue(self, r: int) -> float:
        """When a kernel r launches now can start (and consume its pending stall)."""
        start = max(self.device[r] + self.stall[r], self.host[r] + LATENCY_US)
        self.stall[r] = 0.0
        return start

    def launch(self, r: int, call: str, category: str, name: str, start: float, dur: float,
               stream: int, tid: int = 1, args: dict | None = None) -> None:  # fmt: skip
        """The runtime launch inside the current host op, the GPU activity and their flow."""
        self.correlation[r] += 1
        c = self.correlation[r]
        h = self.host[r]
        self.events[r] += [
            {**_runtime(call, h + 2.0, LAUNCH_US - 4.0, c), "tid": tid},
            {"ph": "X", "cat": category, "name": name, "pid": 0, "tid": stream, "ts": start,
             "dur": dur, "args": {"External id": c, "device": 0, "context": 1,
                                  "stream": stream, "correlation": c, **(args or {})}},
            {"ph": "s", "id": c, "pid": 1, "tid": tid, "ts": h + 2.0, "cat": "ac2g",
             "name": "ac2g"},
            {"ph": "f", "id": c, "pid": 0, "tid": stream, "ts": start, "cat": "ac2g",
             "name": "ac2g", "bp": "e"},
        ]  # fmt: skip

    def communicate(self, r: int) -> bool:
        """Finish r's send (it does not wait), its recv once sent, or its collective once every
        member reached it."""
        action = self.next(r)
        if action and action[0] == "coll":
            members = self.groups[action[1]]["ranks"]
            if any(self.next(m) != action for m in members):
                return False
            ready = {m: self.ready(m) for m in members}
            end = max(ready.values()) + COLLECTIVE_US
            for m in members:
                self.record(m, None, action, ready[m], end)
            return True
        if action and action[0] in ("send", "recv"):
            kind, peer, nelems = action
            pair = (r, peer) if kind == "send" else (peer, r)
            call = (kind, _pair_group(self.groups, r, peer), kind, nelems, "BFloat16")
            if kind == "send":
                ready = self.ready(r)
                self.sent.setdefault(pair, []).append(ready)
                self.record(r, peer, call, ready, ready + COLLECTIVE_US)
                return True
            if self.sent.get(pair):
                ready = self.ready(r)
                self.record(
                    r, peer, call, ready, max(ready, self.sent[pair].pop(0)) + COLLECTIVE_US
                )
                return True
        return False

    def ready(self, r: int) -> float:
        """When r's part of a call starts: its kernel's start on a GPU, else now."""
        return self.queue(r) if self.gpu else self.host[r]

    def record(self, rank: int, peer: int | None, call: tuple, start: float, end: float) -> None:
        group = call[1]
        seq = self.calls[rank, group] = self.calls.get((rank, group), -1) + 1
        args = _comm_args(call, self.groups[group], rank, peer, seq, self.form)
        h = self.host[rank]
        cpu_end = h + LAUNCH_US if self.gpu else end
        self.events[rank] += _call_events(call, args, h, cpu_end)
        if self.gpu:
            self.launch(rank, "cudaLaunchKernel", "kernel", _nccl_kernel(call, self.form), start,
                        end - start, NCCL_STREAM)  # fmt: skip
            self.device[rank] = end
            self.host[rank] += LAUNCH_US
        else:
            self.host[rank] = end
        self.pc[rank] += 1


def _pair_group(groups: dict, a: int, b: int) -> str:
    """The pp group holding both ends of a transfer, else the default group."""
    pairs = (n for n, g in groups.items() if g["axis"] == "pp" and {a, b} <= set(g["ranks"]))
    return next(pairs, "0")


def _annotation(name: str, start: float, end: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": start,
            "dur": end - start, "args": {"External id": 1, "Record function id": 0}}  # fmt: skip


def _cpu_op(name: str, start: float, dur: float) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": start,
            "dur": dur, "args": {"External id": 2, "Sequence number": 0}}  # fmt: skip


def _runtime(name: str, start: float, dur: float, correlation: int | None) -> dict:
    args = {"cbid": 211} | ({"correlation": correlation} if correlation is not None else {})
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": 1, "ts": start,
            "dur": dur, "args": args}  # fmt: skip


def _comm_args(call: tuple, group: dict, rank: int, peer: int | None, seq: int,
               form: str) -> dict:  # fmt: skip
    """record_param_comms args: saveNcclMeta's (newer form), dims and types (older), or none."""
    kind, name, collective, nelems, dtype = call
    if form == "bare":
        return {"External id": 3, "Record function id": 0}
    if form == "old":
        return {"External id": 3, "Record function id": 0, "Input Dims": [[nelems]],
                "Input type": [OLD_TYPES[dtype]], "Output Dims": [[nelems]]}  # fmt: skip
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
    return args


def _call_events(call: tuple, args: dict, start: float, end: float) -> list[dict]:
    """c10d op ⊃ record_param_comms, and the nccl annotation, over [start, end) on the host."""
    kind, _, collective, _, _ = call
    op = {"send": "c10d::send", "recv": "c10d::recv_"}.get(kind, f"c10d::{collective}_")
    base = {"ph": "X", "pid": 1, "tid": 1, "ts": start, "dur": end - start}
    return [
        {**base, "cat": "cpu_op", "name": op, "args": {"External id": 3}},
        {**base, "cat": "cpu_op", "name": "record_param_comms", "args": args},
        {**base, "cat": "user_annotation", "name": f"nccl:{collective}", "args": {}},
    ]


def _nccl_kernel(call: tuple, form: str) -> str:
    """The NCCL kernel's name, as NCCL >= 2.19 (newer form) or older NCCL writes it."""
    coll = KERNEL_COLL[call[2]]
    if form == "new":
        suffix = "" if coll == "SendRecv" else "_Sum_f32_RING_LL"
        return f"ncclDevKernel_{coll}{suffix}(ncclDevComm*, unsigned long, ncclWork*)"
    suffix = "RING_SIMPLE_Sum_int8_t" if coll == "SendRecv" else "RING_LL_Sum_float"
    return f"ncclKernel_{coll}_{suffix}(ncclWorkElem)"


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
