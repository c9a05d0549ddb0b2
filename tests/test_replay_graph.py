"""The what-if replay's graph evaluation (analysis/replay_graph.py): the host-serial model against
the call-by-call event replay it replaces (the same step times on real runs and on an imported
trace under any gap and transfer durations, a step whose calls wait on each other in a cycle left
to the event replay), and hand-timed steps of both models: the rendezvous model's send that
waits for its peer, its in-order communication stream, its joins and launch delays."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ranktrace.analysis import replay_timeline
from ranktrace.analysis.replay import event_replay, ideal_durations, replay
from ranktrace.analysis.replay_graph import COMPUTE, GROUP, HOST_SERIAL, RECV, RENDEZVOUS, SEND
from ranktrace.analysis.replay_timeline import Timeline, load_timeline
from ranktrace.analysis.run import report
from ranktrace.analysis.store import open_reader
from ranktrace.importers.importing import import_ops
from ranktrace.importers.perop import REPLAY_MODEL, read_perop
from tests.perop_traces import Job, simulate, write_trace

TOLERANCE_S = 1e-9


def assert_graph_equals_event_replay(timeline: Timeline) -> None:
    """Graph and event replay agree on every step, for the recorded, the ideal and randomly
    scaled gaps, each with the recorded and randomly scaled transfers."""
    assert timeline.graph.irregular_steps == []
    rng = np.random.default_rng(7)
    recorded = timeline.entries["duration_s"].to_numpy()
    scaled = recorded * rng.uniform(0.2, 3.0, recorded.size)
    transfers = (
        timeline.transfer_s,
        timeline.transfer_s * rng.uniform(0.3, 5.0, timeline.transfer_s.size),
    )
    for gaps in (recorded, ideal_durations(timeline.entries), scaled):
        for transfer in transfers:
            fast = replay(timeline, gaps, transfer)
            slow = [event_replay(timeline, step, gaps, transfer) for step in fast.index]
            assert len(fast) == timeline.entries["step"].nunique()
            np.testing.assert_allclose(fast.to_numpy(), slow, rtol=0, atol=TOLERANCE_S)


@pytest.mark.parametrize("run_name", ["slow", "other"])  # pp=2 dp=2 and tp=2 dp=2
def test_graph_equals_event_replay_on_real_runs(dash_runs_dir, run_name):
    con = open_reader(dash_runs_dir)
    try:
        run_id = con.execute("SELECT run_id FROM runs WHERE name = ?", [run_name]).fetchone()[0]
        timeline = load_timeline(con, run_id)
    finally:
        con.close()
    assert timeline is not None and timeline.sampled_every == 1
    assert_graph_equals_event_replay(timeline)


def test_graph_equals_event_replay_on_an_imported_trace(tmp_path):
    job = Job(steps=4, slow_worker=(1, 2), sequence_spread=0.3)
    path = write_trace(simulate(job), tmp_path / "trace.parquet")
    ops, workers = read_perop(path, job.pp, job.dp)
    runs_dir = tmp_path / "runs"
    imported = import_ops(runs_dir, ops, workers, "t", {"tp": 1, "pp": job.pp, "dp": job.dp}, {})
    con = open_reader(runs_dir)
    try:
        timeline = load_timeline(con, imported.run_id)
    finally:
        con.close()
    # A stage's reduce-scatter and all-gather are two instances of its dp group, not one:
    # per analysed step, 2 dp instances per stage, each with all dp members.
    calls = timeline.entries[timeline.entries["kind"] == GROUP]
    dp_calls = calls[timeline.instance_axis[calls["instance"]] == "dp"]
    per_step = dp_calls.groupby("step")["instance"].nunique()
    assert (per_step == 2 * job.pp).all()
    assert (timeline.size[dp_calls["instance"]] == job.dp).all()
    assert_graph_equals_event_replay(timeline)


def test_a_run_over_the_call_budget_is_replayed_on_every_kth_step(tmp_path, monkeypatch):
    """Past MAX_REPLAY_CALLS the replay keeps every k-th step (k the smallest that fits): S and
    the slow worker's share stay close to what the whole run gives."""
    job = Job(steps=13, slow_worker=(2, 1), slow_factor=1.5)
    path = write_trace(simulate(job), tmp_path / "trace.parquet")
    runs_dir = tmp_path / "runs"
    layout = {"tp": 1, "pp": job.pp, "dp": job.dp}
    imported = import_ops(
        runs_dir, *read_perop(path, job.pp, job.dp), "t", layout, {"replay_model": REPLAY_MODEL}
    )  # as `ranktrace import` says
    whole = imported.report
    assert whole["slowdown_detail"]["sampled_every"] == 1
    con = open_reader(runs_dir)
    try:
        (calls,) = con.execute("SELECT count(*) FROM collectives WHERE step >= 1").fetchone()
        monkeypatch.setattr(replay_timeline, "MAX_REPLAY_CALLS", calls // 3 - 1)
        sampled = report(con, imported.run_id)
        timeline = load_timeline(con, imported.run_id)
    finally:
        con.close()
    assert timeline.sampled_every == 4  # just over a third of the calls fit; 12 steps
    assert sorted(timeline.entries["step"].unique()) == [1, 5, 9]
    assert sampled["slowdown_detail"]["steps"] == 3
    assert sampled["slowdown"] == pytest.approx(whole["slowdown"], rel=0.03)
    (cause,) = sampled["slowdown_by_cause"]
    assert cause["rank"] == job.worker(2, 1)
    assert cause["share_pct"] == pytest.approx(whole["slowdown_by_cause"][0]["share_pct"], abs=10)


def hand_timeline(
    ranks: dict[int, list[tuple[str, float]]], transfer_s: list[float], model: str = HOST_SERIAL
) -> Timeline:
    """One step (step 1) from per-rank programs: ("compute", seconds), ("send" | "recv" |
    "group", instance)."""
    kinds = {"compute": COMPUTE, "send": SEND, "recv": RECV, "group": GROUP}
    rows = [
        {"step": 1, "rank": rank, "pp": 0, "kind": kinds[what],
         "duration_s": value if what == "compute" else 0.0,
         "instance": -1 if what == "compute" else int(value), "label": "forward"}
        for rank, program in ranks.items() for what, value in program
    ]  # fmt: skip
    entries = pd.DataFrame(rows)
    calls = entries[entries["kind"] != COMPUTE]
    return Timeline(
        entries=entries,
        transfer_s=np.array(transfer_s),
        size=np.bincount(calls["instance"], minlength=len(transfer_s)),
        instance_axis=np.array(["pp"] * len(transfer_s), dtype=object),
        call_instance=calls["instance"].to_numpy(),
        call_rank=calls["rank"].to_numpy(),
        measured_step_s=pd.Series({1: 0.0}),
        sampled_every=1,
        model=model,
    )


def test_hand_timed_send_recv_and_group():
    # rank 0 sends at 1.0 and goes on after the transfer: 1.5 + 2.0 = 3.5 at the group; rank 1
    # receives at max(3.0, 1.0) + 0.5 = 3.5 and reaches the group at 3.75. The group ends at
    # 3.75 + 0.25 = 4.0; rank 0 ends at 4.5, rank 1 at 5.0: the step.
    timeline = hand_timeline(
        {
            0: [("compute", 1.0), ("send", 0), ("compute", 2.0), ("group", 1), ("compute", 0.5)],
            1: [("compute", 3.0), ("recv", 0), ("compute", 0.25), ("group", 1), ("compute", 1.0)],
        },
        transfer_s=[0.5, 0.25],
    )
    assert timeline.graph.irregular_steps == []
    gaps = timeline.entries["duration_s"].to_numpy()
    assert replay(timeline, gaps, timeline.transfer_s)[1] == pytest.approx(5.0)
    assert event_replay(timeline, 1, gaps, timeline.transfer_s) == pytest.approx(5.0)


def test_calls_waiting_in_a_cycle_take_the_event_replay():
    # rank 0 joins group 0 then 1, rank 1 group 1 then 0: neither group can start first. The
    # event replay ends the earliest-waiting rank's group with the members it has: group 0 at
    # 1.0 + 0.5, group 1 at max(1.5, 2.0) + 0.5 = 2.5, group 0 again for rank 1: 2.5 + 0.5.
    timeline = hand_timeline(
        {
            0: [("compute", 1.0), ("group", 0), ("group", 1)],
            1: [("compute", 2.0), ("group", 1), ("group", 0)],
        },
        transfer_s=[0.5, 0.5],
    )
    assert timeline.graph.irregular_steps == [1]
    gaps = timeline.entries["duration_s"].to_numpy()
    assert replay(timeline, gaps, timeline.transfer_s)[1] == pytest.approx(3.0)


# A send that must wait for its peer, and the point-to-point stream's order: rank 0 sends to
# rank 1, which posts its recv at 3.0, then receives from rank 2, which sent at 0.1.
WAITING_SEND = {
    0: [("compute", 1.0), ("send", 0), ("recv", 1), ("compute", 1.0)],
    1: [("compute", 3.0), ("recv", 0), ("compute", 0.5)],
    2: [("compute", 0.1), ("send", 1), ("compute", 0.1)],
}


def test_a_rendezvous_send_waits_for_its_peer_and_holds_the_stream():
    # Rendezvous: transfer 0 ends at max(1.0, 3.0) + 0.5 = 3.5; rank 0's recv posts after it, at
    # 3.5, and ends at max(3.5, 0.1) + 0.5 = 4.0; its compute follows: 5.0. Host-serial: the send
    # ends 0.5 after 1.0, the recv at max(1.5, 0.1) + 0.5 = 2.0, rank 0 at 3.0; rank 1 at
    # max(3.0, 1.0) + 0.5 + 0.5 = 4.0.
    for model, step in ((RENDEZVOUS, 5.0), (HOST_SERIAL, 4.0)):
        timeline = hand_timeline(WAITING_SEND, transfer_s=[0.5, 0.5], model=model)
        gaps = timeline.entries["duration_s"].to_numpy()
        assert replay(timeline, gaps, timeline.transfer_s)[1] == pytest.approx(step), model


def test_a_recv_gates_the_compute_after_it_and_a_send_does_not():
    # Rank 0: its compute after the send runs from 1.0 (3.0 at its end) while the send waits for
    # rank 1's recv at 4.0 (done 4.25): the rank ends 4.25. Rank 1's compute after its recv
    # waits for it: 4.25 + 1.0 = 5.25.
    timeline = hand_timeline(
        {0: [("compute", 1.0), ("send", 0), ("compute", 2.0)],
         1: [("compute", 4.0), ("recv", 0), ("compute", 1.0)]},
        transfer_s=[0.25], model=RENDEZVOUS,
    )  # fmt: skip
    gaps = timeline.entries["duration_s"].to_numpy()
    assert replay(timeline, gaps, timeline.transfer_s)[1] == pytest.approx(5.25)


def test_launch_delays_postpone_a_call_and_whatever_waits_on_it():
    # A group of two: rank 0 arrives at 1.0 plus its call's launch delay, rank 1 at 2.0; the
    # group ends 0.25 after the later one, rank 1's compute 1.0 after that.
    timeline = hand_timeline(
        {0: [("compute", 1.0), ("group", 0)], 1: [("compute", 2.0), ("group", 0),
                                                  ("compute", 1.0)]},
        transfer_s=[0.25], model=RENDEZVOUS,
    )  # fmt: skip
    gaps = timeline.entries["duration_s"].to_numpy()
    delays = np.zeros(len(gaps))
    for delay, step in ((0.5, 3.25), (1.5, 3.75)):
        delays[1] = delay  # rank 0's group call
        assert replay(timeline, gaps, timeline.transfer_s, delays)[1] == pytest.approx(step)
