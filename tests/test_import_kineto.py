"""importers/kineto.py over synthetic PyTorch profiler traces in the real Kineto form
(tests/kineto_traces.py): ranks, steps, phases, collectives that pair up across members, NCCL
kernels whose waiting is blocking, GPU compute from kernels, the GPU time split, hosts and
axes as recorded, both record_param_comms forms, a planted slow rank's compute, and a one-line
TraceError naming the file and the problem for each malformed input; one import end to end."""

from __future__ import annotations

import gzip
import json
import shutil

import pandas as pd
import pytest

from ranktrace.importers import parallel
from ranktrace.importers.kineto import read_profiler, read_profiler_dir
from ranktrace.importers.kineto_comms import kernel_op
from ranktrace.importers.kineto_compute import GPU_IDLE
from ranktrace.importers.ops import TraceError
from tests.kineto_traces import (
    ACTIVATION_NELEMS,
    BACKWARD_US,
    COLLECTIVE_US,
    DATA_US,
    FIRST_STEP,
    FORWARD_US,
    GRAD_NELEMS,
    LATENCY_US,
    MEMCPY_US,
    OPTIMIZER_US,
    write_profiler_traces,
)

TIME_TOLERANCE_S = 1e-6  # float64 epoch seconds (~1.8e9) resolve ~0.2 µs


def read(tmp_path, **job) -> tuple[pd.DataFrame, pd.DataFrame]:
    write_profiler_traces(tmp_path, **job)
    return read_profiler_dir(tmp_path)


def comms_of(ops: pd.DataFrame) -> pd.DataFrame:
    return ops[ops["axis"] != ""].assign(end_s=lambda t: t["start_s"] + t["duration_s"])


def compute_seconds(ops: pd.DataFrame) -> pd.DataFrame:
    """Seconds of compute per (worker, step) and compute optype."""
    compute = ops[ops["axis"] == ""]
    return compute.pivot_table("duration_s", ["worker", "step"], "optype", aggfunc="sum")


def edit_trace(path, edit) -> None:
    trace = json.loads(path.read_text())
    edit(trace)
    path.write_text(json.dumps(trace))


def test_every_rank_is_a_worker_with_every_profiled_step(tmp_path):
    ops, workers = read(tmp_path, world_size=4, steps=3, tp=2)
    assert workers["worker"].tolist() == [0, 1, 2, 3]
    assert workers["host"].tolist() == ["node0"] * 4
    expected_steps = {FIRST_STEP, FIRST_STEP + 1, FIRST_STEP + 2}  # the barrier before is dropped
    for _, mine in ops.groupby("worker"):
        assert set(mine["step"]) == expected_steps
    assert (ops["mb"] == -1).all() and (ops["duration_s"] >= 0).all()


@pytest.mark.parametrize("gpu", [True, False])
def test_compute_is_the_planted_work_from_kernels_or_phase_spans_minus_collectives(tmp_path, gpu):
    """GPU traces: the compute kernels and the batch's copy; CPU-only: phase spans."""
    ops, _ = read(tmp_path, world_size=4, steps=2, tp=2, gpu=gpu)
    seconds = compute_seconds(ops[ops["optype"] != GPU_IDLE])
    planted = {"data": MEMCPY_US if gpu else DATA_US, "forward-compute": FORWARD_US,
               "backward-compute": BACKWARD_US, "optimizer": OPTIMIZER_US}  # fmt: skip
    assert sorted(seconds.columns) == sorted(planted)
    for optype, us in planted.items():
        assert seconds[optype].to_numpy() == pytest.approx(us * 1e-6, abs=TIME_TOLERANCE_S)
    idle = {""} if gpu else set()  # GPU idle between steps: host time, in no phase
    assert set(ops["phase"]) == {"data", "forward", "backward", "grad_sync", "optimizer"} | idle


def test_collectives_carry_group_bytes_and_a_seq_shared_by_their_members(tmp_path):
    ops, _ = read(tmp_path, world_size=4, steps=3, tp=2)
    comms = comms_of(ops)
    assert set(comms["optype"]) == {"allreduce"} and set(comms["op"]) == {"all_reduce"}
    instances = comms.groupby(["axis", "group_id", "seq"])
    assert (instances.size() == instances["group_size"].first()).all()  # every member, once
    for column in ("step", "bytes", "op", "group_size"):
        assert (instances[column].nunique() == 1).all(), column
    ends = instances["end_s"].agg(lambda e: e.max() - e.min())
    assert (ends < TIME_TOLERANCE_S).all()  # one instance ends at once on its members
    grad_sync = comms[comms["phase"] == "grad_sync"]
    assert set(grad_sync["axis"]) == {"dp"} and set(grad_sync["bytes"]) == {GRAD_NELEMS * 4}
    per_group_and_step = comms.groupby(["worker", "axis", "step"]).size().unstack("axis")
    assert (per_group_and_step == {"tp": 2, "dp": 1, "world": 1}).all().all()


def test_axes_come_from_rank_lists_or_from_group_descriptions(tmp_path):
    for describe in (False, True):
        folder = tmp_path / str(describe)
        ops, workers = read(folder, world_size=8, steps=1, tp=2, describe_groups=describe)
        groups = comms_of(ops).groupby("axis")["group_id"].unique()
        assert sorted(groups["tp"]) == [0, 2, 4, 6]  # consecutive pairs
        assert sorted(groups["dp"]) == [0, 1]  # strided: {0, 2, 4, 6} and {1, 3, 5, 7}
        assert list(groups["world"]) == [0]
        assert workers["tp"].tolist() == [r % 2 for r in range(8)]
        assert workers["dp"].tolist() == [r // 2 for r in range(8)]


def test_data_parallel_on_the_default_group_syncs_gradients_in_backward(tmp_path):
    ops, workers = read(tmp_path, world_size=4, steps=2)
    comms = comms_of(ops)
    assert set(comms["axis"]) == {"world"}
    by_phase = comms.groupby("phase")["bytes"].unique()
    assert list(by_phase["grad_sync"]) == [GRAD_NELEMS * 4]  # DDP's all-reduce in backward
    assert list(by_phase["optimizer"]) == [4]  # the grad-norm all-reduce in Optimizer.step
    assert workers["dp"].tolist() == [0, 1, 2, 3] and set(workers["pp"]) == {0}


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("with_peer_args", [True, False])
def test_in_a_1f1b_pipeline_each_send_pairs_with_one_recv(tmp_path, pp, with_peer_args):
    micro_batches, steps, dp = 2, 2, 2
    write_profiler_traces(tmp_path, world_size=pp * dp, steps=steps, pp=pp,
                          micro_batches=micro_batches)  # fmt: skip
    if not with_peer_args:  # older traces: the other member of a 2-rank group, or "Rank"

        def strip_peers(trace):
            for event in trace["traceEvents"]:
                for key in ("Dst Rank", "Src Rank"):
                    event.get("args", {}).pop(key, None)

        for path in tmp_path.glob("*.json"):
            edit_trace(path, strip_peers)
    ops, _ = read_profiler_dir(tmp_path)
    comms = comms_of(ops)
    p2p = comms[comms["axis"] == "pp"]
    assert set(p2p["optype"]) == {"send", "recv"} and set(p2p["phase"]) == {"pipeline_wait"}
    transfers = (pp - 1) * dp * micro_batches * 2 * steps  # both directions
    assert set(p2p["group_size"]) == {2} and len(p2p) == 2 * transfers
    sends = p2p[p2p["optype"] == "send"].rename(columns={"worker": "src", "peer": "dst"})
    recvs = p2p[p2p["optype"] == "recv"].rename(columns={"worker": "dst", "peer": "src"})
    pairs = sends.merge(recvs, on=["src", "dst", "group_id", "seq"], suffixes=("", "_recv"))
    assert len(pairs) == len(sends) == len(recvs) == transfers
    assert (pairs["step"] == pairs["step_recv"]).all()
    assert (pairs["end_s_recv"] >= pairs["start_s"]).all()  # a recv ends after its send starts
    assert set(pairs["src"] - pairs["dst"]) == {dp, -dp}  # stage to stage
    # Stages make different numbers of calls, yet group instances still pair up.
    instances = comms[comms["axis"] != "pp"].groupby(["axis", "group_id", "seq"])
    assert (instances.size() == instances["group_size"].first()).all()
    assert (instances["step"].nunique() == 1).all()


def test_a_record_param_comms_nested_in_another_is_part_of_that_call(tmp_path):
    ops, _ = read(tmp_path, world_size=4, steps=2, tp=2)

    def nest(trace):
        calls = [e for e in trace["traceEvents"] if e.get("name") == "record_param_comms"]
        trace["traceEvents"] += [{**e, "ts": e["ts"] + 1.0, "dur": e["dur"] - 2.0} for e in calls]

    for path in tmp_path.glob("*.json"):
        edit_trace(path, nest)
    pd.testing.assert_frame_equal(read_profiler_dir(tmp_path)[0], ops)


def test_a_slow_rank_computes_longer_by_the_planted_factor_and_others_wait(tmp_path):
    factor, slow = 1.5, 2
    ops, _ = read(tmp_path, world_size=4, steps=3, tp=2, slow_rank=slow, slow_factor=factor)
    seconds = compute_seconds(ops)
    for optype in ("forward-compute", "backward-compute"):
        ratio = seconds.loc[slow, optype] / seconds.drop(index=slow, level="worker")[optype].max()
        assert ratio.to_numpy() == pytest.approx(factor, rel=1e-3)
    waits = comms_of(ops).groupby("worker")["duration_s"].sum()
    assert waits.idxmin() == slow  # the others wait for it in their collectives
    own_wait = COLLECTIVE_US * 1e-6 * 4 * 3  # tp ×2, dp, world: only the transfer itself
    assert waits[slow] == pytest.approx(own_wait, abs=TIME_TOLERANCE_S * 12)


def test_gzipped_traces_named_by_the_tensorboard_handler_give_their_host(tmp_path):
    write_profiler_traces(tmp_path / "plain", world_size=2, steps=1)
    for rank in range(2):
        trace = json.loads((tmp_path / "plain" / f"rank{rank}.json").read_text())
        del trace["host_name"]
        name = f"gpu-node-{rank}_4242.1790000000000000000.pt.trace.json.gz"
        with gzip.open(tmp_path / name, "wt") as f:
            json.dump(trace, f)
    shutil.rmtree(tmp_path / "plain")
    _, workers = read_profiler_dir(tmp_path)
    assert workers["host"].tolist() == ["gpu-node-0", "gpu-node-1"]


def blocking_of(ops: pd.DataFrame) -> pd.DataFrame:
    """The collectives with `blocking_s`: how long each waited for its instance's last member
    (the latest start among them minus its own), as the store splits it."""
    comms = comms_of(ops)
    last = comms.groupby(["axis", "group_id", "seq"])["start_s"].transform("max")
    return comms.assign(blocking_s=last - comms["start_s"])


def test_a_gpu_collective_is_its_nccl_kernel_and_peers_wait_in_it_for_a_late_rank(tmp_path):
    """The record_param_comms event spans only the launch; the NCCL kernel runs from its rank's
    arrival until the last member's arrival + the transfer: the waiting is blocking."""
    factor, slow, steps = 1.5, 2, 3
    ops, _ = read(tmp_path, world_size=4, steps=steps, slow_rank=slow, slow_factor=factor)
    comms = blocking_of(ops)
    transfer_s = COLLECTIVE_US * 1e-6
    own = comms[comms["worker"] == slow]
    assert own["duration_s"].to_numpy() == pytest.approx(transfer_s, abs=TIME_TOLERANCE_S)
    assert own["blocking_s"].to_numpy() == pytest.approx(0.0, abs=TIME_TOLERANCE_S)
    peers = comms[comms["worker"] != slow]
    lateness_s = {"grad_sync": (factor - 1) * (FORWARD_US + BACKWARD_US) * 1e-6,
                  "optimizer": (factor - 1) * OPTIMIZER_US * 1e-6}  # fmt: skip
    for phase, late_s in lateness_s.items():
        waited = peers[peers["phase"] == phase]
        assert len(waited) == 3 * steps  # three peers, one call per step
        assert waited["blocking_s"].to_numpy() == pytest.approx(late_s, abs=TIME_TOLERANCE_S)
        assert waited["duration_s"].to_numpy() == pytest.approx(
            late_s + transfer_s, abs=TIME_TOLERANCE_S
        )
    compute = compute_seconds(ops)  # GPU kernels, the slow rank's planted factor
    ratio = compute.loc[slow, "backward-compute"] / compute.loc[0, "backward-compute"]
    assert ratio.to_numpy() == pytest.approx(factor, rel=1e-6)


def test_gpu_time_splits_each_rank_span_as_the_trace_was_built(tmp_path):
    """2 ranks: rank 1 loads each batch 3x as long (the GPU waits for its host, and rank 0
    waits for it in every gradient all-reduce); the optimizer's kernel waits 150 µs on an
    event after it was launched (kernel wait)."""
    steps, stall_us, host_factor = 3, 150.0, 3.0
    write_profiler_traces(tmp_path, world_size=2, steps=steps, stall_us=stall_us,
                          host_slow_rank=1, host_factor=host_factor)  # fmt: skip
    trace = read_profiler(tmp_path)
    late_us = (host_factor - 1) * DATA_US
    between_steps_us = {0: DATA_US + LATENCY_US, 1: host_factor * DATA_US + LATENCY_US}
    comm_us = {0: 2 * COLLECTIVE_US + late_us, 1: 2 * COLLECTIVE_US}
    for rank in (0, 1):
        parts_us = {
            "compute_pct": steps * (FORWARD_US + BACKWARD_US + OPTIMIZER_US),
            "communication_pct": steps * comm_us[rank], "memory_pct": steps * MEMCPY_US,
            "idle_host_wait_pct": (steps - 1) * between_steps_us[rank],
            "idle_kernel_wait_pct": steps * stall_us, "idle_other_pct": 0.0,
        }  # fmt: skip
        span_us = sum(parts_us.values())
        expected = {key: 100 * us / span_us for key, us in parts_us.items()}
        expected["idle_pct"] = expected["idle_host_wait_pct"] + expected["idle_kernel_wait_pct"]
        expected["span_s"] = span_us * 1e-6
        assert trace.gpu_time[rank] == pytest.approx(expected, abs=1e-6)
    # The GPU's wait between steps is the step's host time: a host-bound rank's kind is host.
    idle = trace.ops[trace.ops["optype"] == GPU_IDLE]
    assert set(idle["phase"]) == {""}
    for rank in (0, 1):
        waited_s = idle.loc[idle["worker"] == rank, "duration_s"].to_numpy()
        assert waited_s == pytest.approx([between_steps_us[rank] * 1e-6] * (steps - 1))
    assert trace.replay_model == "rendezvous"
    assert read_profiler(_cpu_only(tmp_path / "cpu")).gpu_time is None


def _cpu_only(folder):
    write_profiler_traces(folder, world_size=2, steps=1, gpu=False)
    return folder


def test_without_launch_correlation_nccl_kernels_pair_with_their_calls_in_order(tmp_path):
    write_profiler_traces(tmp_path, world_size=4, steps=2, tp=2)
    columns = ["worker", "step", "op", "axis", "group_id", "seq", "start_s", "duration_s"]
    correlated = comms_of(read_profiler_dir(tmp_path)[0])[columns].reset_index(drop=True)

    def uncorrelate(trace):
        for event in trace["traceEvents"]:
            event.get("args", {}).pop("correlation", None)

    for path in tmp_path.glob("*.json"):
        edit_trace(path, uncorrelate)
    trace = read_profiler(tmp_path)
    ordered = comms_of(trace.ops)[columns].reset_index(drop=True)
    pd.testing.assert_frame_equal(ordered, correlated)
    for split in trace.gpu_time.values():  # no launch known: no idle gap can be classed
        assert split["idle_other_pct"] == pytest.approx(split["idle_pct"]) and split["idle_pct"] > 0


@pytest.mark.parametrize(
    ("naming", "host_names", "hosts"),
    [("rank", True, ["node0", "node0", "node1", "node1"]),  # host_name in the trace
     ("handler", False, ["node0", "node0", "node1", "node1"]),  # {host}_{pid}.{ns}.pt.trace.json
     ("other", False, [""] * 4), ("rank", False, [""] * 4)],
)  # fmt: skip
def test_hosts_come_from_the_trace_or_the_trace_handler_name_else_are_unknown(
    tmp_path, naming, host_names, hosts
):
    _, workers = read(tmp_path, world_size=4, steps=1, naming=naming, host_names=host_names,
                      ranks_per_node=2)  # fmt: skip
    assert workers["host"].tolist() == hosts


def test_a_name_only_like_the_trace_handler_s_gives_no_host(tmp_path):
    """A stem with an underscore, or a short number where torch writes the time: not torch's
    `{gethostname()}_{pid}.{time_ns}` name."""
    files = write_profiler_traces(tmp_path, world_size=2, steps=1, host_names=False)
    files[0].rename(tmp_path / "worker0_step_3.1700.pt.trace.json")
    files[1].rename(tmp_path / "gpu_node_1_4242.1790000000000000000.pt.trace.json")
    assert read_profiler_dir(tmp_path)[1]["host"].tolist() == ["", ""]


def test_a_ddp_job_on_the_default_group_is_data_parallel_over_every_rank(tmp_path):
    _, workers = read(tmp_path, world_size=8, steps=1, all_to_all=True)
    assert workers["dp"].tolist() == list(range(8))
    assert set(workers["tp"]) == {0} and set(workers["pp"]) == {0}


def test_two_groups_of_the_same_ranks_keep_their_collectives_apart(tmp_path):
    """DDP's all-reduces on the default group, the all-to-all on a new_group of every rank:
    both are (world, rank 0) to the store, their instances must not merge."""
    ops, _ = read(tmp_path, world_size=4, steps=2, all_to_all=True, all_to_all_group=True)
    comms = comms_of(ops)
    instances = comms.groupby(["axis", "group_id", "seq"])
    assert (instances.size() == 4).all() and (instances["op"].nunique() == 1).all()
    assert sorted(instances["op"].first().value_counts().items()) == [
        ("all_reduce", 4), ("all_to_all", 2)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("kernel", "op"),
    [("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "all_reduce"),  # NCCL 2.7-2.18
     ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
      "reduce_scatter"),  # NCCL 2.19+
     ("ncclKernel_Reduce_RING_LL_Sum_float(ncclWorkElem)", "reduce"),
     ("ncclAllGatherRingLLKernel_copy_i8(ncclColl)", "all_gather"),  # older NCCL
     ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)", "all_to_all"),
     ("ncclDevKernel_Generic_1(ncclDevKernelArgsStorage<4096ul>)", ""),  # names no collective
     ("void at::native::vectorized_elementwise_kernel<4>", "")],
)  # fmt: skip
def test_an_nccl_kernel_name_tells_its_collective(kernel, op):
    assert kernel_op(kernel) == op


@pytest.mark.parametrize("form", ["new", "old", "bare"])
def test_older_record_param_comms_are_read_from_their_nccl_kernels(tmp_path, form):
    """Older forms name no collective, group or sequence number: the kernel names the
    collective (a SendRecv kernel of a call without a peer: all-to-all), the default group holds
    it, and the order of the calls in the step matches them across ranks."""
    ops, _ = read(tmp_path, world_size=4, steps=2, all_to_all=True, comms_form=form)
    comms = comms_of(ops)
    assert set(comms["axis"]) == {"world"}
    by_phase = comms.groupby("phase")["op"].unique().map(sorted).to_dict()
    assert by_phase == {"forward": ["all_to_all"], "grad_sync": ["all_reduce"],
                        "optimizer": ["all_reduce"]}  # fmt: skip
    instances = comms.groupby(["group_id", "seq"])
    assert (instances.size() == 4).all() and (instances["op"].nunique() == 1).all()
    ends = instances["end_s"].agg(lambda e: e.max() - e.min())
    assert (ends < TIME_TOLERANCE_S).all()  # each instance: one collective on all members
    sizes = {"new": GRAD_NELEMS * 4, "old": GRAD_NELEMS * 4, "bare": 0}
    assert set(comms.loc[comms["phase"] == "grad_sync", "bytes"]) == {sizes[form]}
    a2a = {"new": ACTIVATION_NELEMS * 2, "old": ACTIVATION_NELEMS * 2, "bare": 0}
    assert set(comms.loc[comms["op"] == "all_to_all", "bytes"]) == {a2a[form]}


def drop_kernel(path, index):
    """Remove the index-th NCCL kernel of a rank's trace (its call then launched nothing)."""

    def edit(trace):
        kernels = sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"
                          and e["name"].startswith("nccl")), key=lambda e: e["ts"])  # fmt: skip
        trace["traceEvents"].remove(kernels[index])

    edit_trace(path, edit)


OLDER_FORM_REFUSED = {  # case: (job, change to its folder, words the message must hold)
    "subgroups it may have run on": (
        {"tp": 2, "comms_form": "old"}, None,
        ["rank0.json", "no process group", "pg_config", "torch >= 2.4"],
    ),
    "ranks making different calls": (
        {"comms_form": "bare", "all_to_all": True},
        lambda d: drop_kernel(d / "rank2.json", 5),  # the barrier, 3 per step: step 4's 2nd
        [f"step {FIRST_STEP + 1}", "rank 2 2", "no group or sequence number", "torch >= 2.4"],
    ),
    "no kernel to name it": (
        {"comms_form": "old", "gpu": False}, None,
        ["rank0.json", "Collective name", "ProfilerActivity.CUDA"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(OLDER_FORM_REFUSED))
def test_an_older_form_that_cannot_be_matched_is_refused_in_one_line(tmp_path, case):
    job, change, words = OLDER_FORM_REFUSED[case]
    write_profiler_traces(tmp_path, world_size=4, steps=2, **job)
    if change:
        change(tmp_path)
    with pytest.raises(TraceError) as error:
        read_profiler_dir(tmp_path)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


def test_no_tp_advice_for_ranks_without_tp_groups_or_whose_hosts_are_unknown():
    """The 8-GPU DDP trace gave every rank the same coordinates and a host per file: the
    placement then made one 8-rank "tp group" across 8 nodes."""
    from ranktrace.analysis.topology import hosts_known, layout_flags

    unplaced = pd.DataFrame({"rank": range(8), "pp": 0, "dp": 0, "tp": 0,
                             "host": [f"worker{r}_step" for r in range(8)]})  # fmt: skip
    assert layout_flags(unplaced) == []
    data_parallel = unplaced.assign(dp=range(8))
    assert layout_flags(data_parallel) == []
    tp_across = unplaced.assign(tp=[r % 2 for r in range(8)], dp=[r // 2 for r in range(8)],
                                host=[f"node{r % 2}" for r in range(8)])  # fmt: skip
    (flag,) = layout_flags(tp_across)  # the flag itself still fires
    assert flag.startswith("TP crosses nodes")
    unknown = tp_across.assign(host="")
    assert not hosts_known(unknown) and layout_flags(unknown) == []


def gloo_trace(trace):
    """What the gloo backend writes: c10d ops, no record_param_comms (torch 2.13), no kernels."""
    events = trace["traceEvents"]
    trace["traceEvents"] = [e for e in events if e.get("name") != "record_param_comms"
                            and e.get("cat") in ("cpu_op", "user_annotation")]  # fmt: skip


def drop_steps(trace):
    trace["traceEvents"] = [
        e for e in trace["traceEvents"] if not e.get("name", "").startswith("ProfilerStep#")
    ]


MALFORMED = {  # case: (change to a folder of 4 rank traces, words the message must hold)
    "missing folder": (lambda d: shutil.rmtree(d), ["no such folder"]),
    "no traces": (lambda d: [p.unlink() for p in d.glob("*.json")], ["no *.json"]),
    "not JSON": (lambda d: (d / "rank1.json").write_text("{oops"), ["rank1.json", "not a JSON"]),
    "no traceEvents": (
        lambda d: (d / "rank2.json").write_text('{"distributedInfo": {"rank": 2}}'),
        ["rank2.json", "no traceEvents"],
    ),
    "no rank": (
        lambda d: edit_trace(d / "rank3.json", lambda t: t["distributedInfo"].pop("rank")),
        ["rank3.json", "distributedInfo.rank"],
    ),
    "two files of one rank": (
        lambda d: shutil.copy(d / "rank1.json", d / "rank1-again.json"),
        ["rank 1", "another file"],
    ),
    "world sizes disagree": (
        lambda d: edit_trace(d / "rank3.json", lambda t: t["distributedInfo"].update(world_size=8)),
        ["rank3.json", "world_size 8", "says 4"],
    ),
    "a rank missing": (lambda d: (d / "rank2.json").unlink(), ["rank(s) [2]", "world_size 4"]),
    "no ProfilerStep": (
        lambda d: edit_trace(d / "rank0.json", drop_steps),
        ["rank0.json", "no ProfilerStep#N"],
    ),
    "gloo collectives": (
        lambda d: [edit_trace(p, gloo_trace) for p in d.glob("*.json")],
        ["rank0.json", "c10d::", "record_param_comms", "gloo"],
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_folder_is_refused_in_one_line_naming_the_problem(tmp_path, case):
    folder = tmp_path / "traces"
    write_profiler_traces(folder, world_size=4, steps=1)
    change, words = MALFORMED[case]
    change(folder)
    with pytest.raises(TraceError) as error:
        read_profiler_dir(folder)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


def test_a_pool_of_processes_reads_the_same_tables_and_raises_the_same_errors(
    tmp_path, monkeypatch
):
    """Big folders are parsed by a pool (importers/parallel.py): forced here on a small one, it
    gives the tables one process gives, and a bad file's one-line error."""
    folder = tmp_path / "traces"
    write_profiler_traces(folder, world_size=4, steps=2, tp=2, slow_rank=1, slow_factor=1.5)
    alone = read_profiler_dir(folder)
    monkeypatch.setattr(parallel, "PARALLEL_MIN_BYTES", 0)
    pooled = read_profiler_dir(folder)
    for one, other in zip(alone, pooled, strict=True):
        pd.testing.assert_frame_equal(one, other)
    (folder / "rank2.json").write_text("{oops")
    with pytest.raises(TraceError, match=r"^rank2\.json: not a JSON trace"):
        read_profiler_dir(folder)


def test_import_finds_the_slow_rank_on_its_stage_and_keeps_nothing_of_a_bad_folder(tmp_path):
    """`ranktrace import torch-profiler` end to end: a tp2 pp2 dp2 job whose rank 5 computes
    1.6x as long (a CPU-only trace: its sends do not wait for their recv, which the GPU
    replay's rendezvous model cannot order); then a folder missing one rank's trace."""
    from ranktrace.analysis.store import open_reader
    from tests.conftest import ranktrace

    runs_dir, traces = tmp_path / "runs", tmp_path / "traces"
    write_profiler_traces(traces, world_size=8, steps=12, tp=2, pp=2, micro_batches=4,
                          slow_rank=5, slow_factor=1.6, gpu=False)  # fmt: skip
    result = ranktrace("import", "torch-profiler", str(traces), "--name", "profiled",
                       "--runs-dir", str(runs_dir), runs_dir=runs_dir)  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(ranktrace("report", "profiled", "--json", "--runs-dir", str(runs_dir),
                                  runs_dir=runs_dir).stdout)  # fmt: skip
    assert {k: report["layout"][k] for k in ("tp", "pp", "dp")} == {"tp": 2, "pp": 2, "dp": 2}
    (finding,) = report["stragglers"]
    assert (finding["rank"], finding["kind"], finding["pp"], finding["tp"]) == (5, "compute", 1, 1)
    assert "its op time in forward" in finding["evidence"][1]  # a profiler's CPU ops' spans
    assert report["slowdown"] > 1.1 and report["slowdown_by_cause"][0]["rank"] == 5
    (traces / "rank3.json").unlink()
    result = ranktrace("import", "torch-profiler", str(traces), "--name", "partial",
                       "--runs-dir", str(runs_dir), runs_dir=runs_dir)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no trace of rank(s) [3]" in result.stderr.strip().splitlines()[-1]
    con = open_reader(runs_dir)
    try:
        assert [r[0] for r in con.execute("SELECT name FROM runs").fetchall()] == ["profiled"]
    finally:
        con.close()


def test_import_of_a_ddp_gpu_trace_without_hosts_counts_nccl_waiting_and_gives_no_node_advice(
    tmp_path,
):
    """The 8-GPU DDP + all-to-all job of issue 18 in the form its trace has: no host names,
    files not named by the trace handler, the older record_param_comms; rank 5 computes 1.5x
    as long. Peers wait for it inside their NCCL kernels: blocking, on the GPU timeline."""
    from ranktrace.analysis.store import open_reader
    from tests.conftest import ranktrace

    runs_dir, traces = tmp_path / "runs", tmp_path / "traces"
    steps, slow, factor = 8, 5, 1.5
    write_profiler_traces(traces, world_size=8, steps=steps, all_to_all=True, comms_form="old",
                          naming="other", host_names=False, slow_rank=slow,
                          slow_factor=factor)  # fmt: skip
    result = ranktrace("import", "torch-profiler", str(traces), "--name", "ddp",
                       "--runs-dir", str(runs_dir), runs_dir=runs_dir)  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "topology: hosts unknown" in text and "TP crosses" not in text
    assert "GPU time per rank" in text
    report = json.loads(ranktrace("report", "ddp", "--json", "--runs-dir", str(runs_dir),
                                  runs_dir=runs_dir).stdout)  # fmt: skip
    assert {k: report["layout"][k] for k in ("tp", "pp", "dp")} == {"tp": 1, "pp": 1, "dp": 8}
    topology = report["topology"]
    assert not topology["hosts_known"] and topology["nodes"] == [] and topology["flags"] == []
    assert report["slowdown_detail"]["replay_model"] == "rendezvous"
    (finding,) = report["stragglers"]
    assert (finding["rank"], finding["kind"]) == (slow, "compute")
    assert "its kernel time in forward" in finding["evidence"][1]  # GPU kernels measured
    assert sorted(report["gpu_time"], key=int) == [str(r) for r in range(8)]
    split = report["gpu_time"][str(slow)]
    assert split["communication_pct"] < min(
        s["communication_pct"] for r, s in report["gpu_time"].items() if r != str(slow)
    )  # the others' kernels wait for it
    con = open_reader(runs_dir)
    try:
        blocking = dict(con.execute(
            "SELECT rank, sum(comm_blocking_s) FROM steps GROUP BY rank ORDER BY rank"
        ).fetchall())  # fmt: skip
    finally:
        con.close()
    late_s = (factor - 1) * (FORWARD_US + BACKWARD_US + OPTIMIZER_US) * 1e-6  # per step
    assert blocking.pop(slow) == pytest.approx(0.0, abs=steps * TIME_TOLERANCE_S)
    assert list(blocking.values()) == pytest.approx([steps * late_s] * 7, rel=1e-3)
