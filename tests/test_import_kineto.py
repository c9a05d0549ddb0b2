"""importers/kineto.py over synthetic PyTorch profiler traces (tests/kineto_traces.py): ranks,
steps, phases, collectives that pair up across members, a planted slow rank's compute, and a
one-line TraceError naming the file and the problem for each malformed input. Parsing only."""

from __future__ import annotations

import gzip
import json
import shutil

import pandas as pd
import pytest

from importers import parallel
from importers.kineto import read_profiler_dir
from importers.ops import TraceError
from tests.kineto_traces import (
    BACKWARD_US,
    COLLECTIVE_US,
    DATA_US,
    FIRST_STEP,
    FORWARD_US,
    GRAD_NELEMS,
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


def test_phase_spans_minus_collectives_are_the_planted_compute(tmp_path):
    ops, _ = read(tmp_path, world_size=4, steps=2, tp=2)
    seconds = compute_seconds(ops)
    planted = {"data": DATA_US, "forward-compute": FORWARD_US,
               "backward-compute": BACKWARD_US, "optimizer": OPTIMIZER_US}  # fmt: skip
    assert sorted(seconds.columns) == sorted(planted)
    for optype, us in planted.items():
        assert seconds[optype].to_numpy() == pytest.approx(us * 1e-6, abs=TIME_TOLERANCE_S)
    assert set(ops["phase"]) == {"data", "forward", "backward", "grad_sync", "optimizer"}


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


def gloo_trace(trace):
    """What the gloo backend writes: c10d ops, no record_param_comms (torch 2.13)."""
    events = trace["traceEvents"]
    trace["traceEvents"] = [e for e in events if e.get("name") != "record_param_comms"]


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
    1.6x as long; then a folder missing one rank's trace."""
    from analysis.store import open_reader
    from tests.conftest import ranktrace

    runs_dir, traces = tmp_path / "runs", tmp_path / "traces"
    write_profiler_traces(traces, world_size=8, steps=12, tp=2, pp=2, micro_batches=4,
                          slow_rank=5, slow_factor=1.6)  # fmt: skip
    result = ranktrace("import", "torch-profiler", str(traces), "--name", "profiled",
                       "--runs-dir", str(runs_dir), runs_dir=runs_dir)  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(ranktrace("report", "profiled", "--json", "--runs-dir", str(runs_dir),
                                  runs_dir=runs_dir).stdout)  # fmt: skip
    assert {k: report["layout"][k] for k in ("tp", "pp", "dp")} == {"tp": 2, "pp": 2, "dp": 2}
    (finding,) = report["stragglers"]
    assert (finding["rank"], finding["kind"], finding["pp"], finding["tp"]) == (5, "compute", 1, 1)
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
