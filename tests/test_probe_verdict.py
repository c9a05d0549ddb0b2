"""The probe's verdict from pair bandwidths (analysis/probe.py), and probe runs in the store: a
run of kind `probe` is ingested and reported without steps, linked to its job's run, and a store
from before probes gains `runs.kind` (its runs `train`). No processes: the probe's figures are
written as `ranktrace probe` writes them (tests/test_probe.py measures real ones)."""

from __future__ import annotations

import itertools

import duckdb
import pytest

from ranktrace.analysis.ingest import ingest
from ranktrace.analysis.probe import SLOW_FACTOR, linked_probes, verdict
from ranktrace.analysis.run import cached_report
from ranktrace.analysis.store import open_reader, store_path
from ranktrace.app.report_text import format_report
from ranktrace.telemetry.run_record import run_dir, write_run_json
from ranktrace.trainer.probe import pair_rate

FAST, SLOW = 1e9, 1e6  # bytes/s: an unlimited link here, and an 8 Mbit/s one


def pairs_of(ranks: list[dict], rate) -> list[dict]:
    """Every ordered pair measured by `ranks` at `rate(src, dst)` bytes/s."""
    return [{"src": a["rank"], "dst": b["rank"], "bytes_per_s": rate(a["rank"], b["rank"])}
            for a, b in itertools.permutations(ranks, 2)]  # fmt: skip


def one_rank_per_node(n: int) -> list[dict]:
    return [{"rank": r, "host": f"node{r}", "cpu_affinity": [r]} for r in range(n)]


@pytest.mark.parametrize("slow", [0, 1, 2, 3])
def test_a_slow_sender_node_is_named_in_any_position(slow):
    ranks = one_rank_per_node(4)
    result = verdict(pairs_of(ranks, lambda s, d: SLOW if s == slow else FAST), ranks)
    assert result["slow_ranks"] == [slow]
    (sender,) = result["slow_senders"]
    assert (sender["scope"], sender["host"], sender["ratio"]) == ("node", f"node{slow}", 1e-3)
    assert result["slow_receivers"] == [] and result["notes"] == []


def test_a_slow_receiver_node_is_named():
    ranks = one_rank_per_node(4)
    result = verdict(pairs_of(ranks, lambda s, d: SLOW if d == 2 else FAST), ranks)
    assert result["slow_ranks"] == [2] and result["slow_senders"] == []
    assert [r["host"] for r in result["slow_receivers"]] == ["node2"]
    assert result["verdict"].startswith("slow receiver node2 (rank 2)")


def test_a_node_sharing_a_core_with_one_peer_is_not_named():
    """Its pairs with that peer run at half speed; its fastest pair is as fast as any."""
    ranks = one_rank_per_node(4)
    shared = {(0, 1), (1, 0)}
    result = verdict(pairs_of(ranks, lambda s, d: FAST / 3 if (s, d) in shared else FAST), ranks)
    assert result["slow_ranks"] == [] and result["verdict"] == "no slow sender or receiver"


def test_one_slow_path_is_a_note_not_a_node():
    ranks = one_rank_per_node(4)
    result = verdict(pairs_of(ranks, lambda s, d: SLOW if (s, d) == (0, 3) else FAST), ranks)
    assert result["slow_ranks"] == []
    (note,) = result["notes"]
    assert "node0 -> node3" in note and "the path between them" in note


def test_two_nodes_name_the_sender_and_say_it_may_be_the_receiver():
    ranks = [{"rank": r, "host": f"node{r // 2}", "cpu_affinity": [r]} for r in range(4)]
    result = verdict(pairs_of(ranks, lambda s, d: SLOW if s < 2 <= d else FAST), ranks)
    assert result["slow_ranks"] == [0, 1]  # node0's ranks
    assert [s["host"] for s in result["slow_senders"]] == ["node0"]
    (note,) = result["notes"]
    assert "node0's egress or node1's ingress" in note


def test_a_slow_rank_inside_a_node_is_named_unless_its_ranks_share_cores():
    ranks = [{"rank": r, "host": "node0", "cpu_affinity": [r]} for r in range(4)]
    pairs = pairs_of(ranks, lambda s, d: SLOW if s == 3 else FAST)
    result = verdict(pairs, ranks)
    assert result["slow_ranks"] == [3]
    assert [(s["scope"], s["ranks"]) for s in result["slow_senders"]] == [("rank", [3])]
    crowded = [{**r, "cpu_affinity": [0, 1]} for r in ranks]  # 4 ranks on 2 cores
    result = verdict(pairs, crowded)
    assert result["slow_ranks"] == []
    assert any("4 ranks share 2 cores" in note for note in result["notes"])


def test_inside_a_node_a_2x_gap_is_scheduling_not_a_finding():
    """Two local ranks on a quiet 2-core machine measured 0.47x between the directions."""
    ranks = [{"rank": r, "host": "node0", "cpu_affinity": [r]} for r in range(2)]
    result = verdict(pairs_of(ranks, lambda s, d: 0.96e9 if s == 0 else 2.06e9), ranks)
    assert result["slow_ranks"] == [] and result["notes"][:1] == [
        "every rank is on node0: only pairs inside it were measured"
    ]
    assert verdict(pairs_of(ranks, lambda s, d: FAST / 5 if s == 0 else FAST), ranks)[
        "slow_ranks"
    ] == [0]


def test_the_slow_factor_is_a_clear_margin():
    ranks = one_rank_per_node(3)
    almost = verdict(pairs_of(ranks, lambda s, d: FAST * (SLOW_FACTOR + 0.05) if s == 0
                              else FAST), ranks)  # fmt: skip
    assert almost["slow_ranks"] == []


def write_probe_run(runs_dir, run_id: str, job_id: str | None, slow: int) -> None:
    """A probe run's directory as `ranktrace probe` leaves it."""
    ranks = one_rank_per_node(4)
    pairs = [{**p, "bytes": 4096, "messages": 1, "seconds": [0.1]}
             for p in pairs_of(ranks, lambda s, d: SLOW if s == slow else FAST)]  # fmt: skip
    probe = {"backend": "gloo", "world_size": 4, "ranks": ranks, "pairs": pairs,
             "max_bytes": 4096, "repeats": 1, "pair_seconds": 0.1, "duration_s": 1.0}  # fmt: skip
    record = {"run_id": run_id, "name": "probe", "status": "completed", "kind": "probe",
              "for": job_id, "world_size": 4, "started_at": 1.0, "finished_at": 2.0,
              "probe": probe}  # fmt: skip
    write_run_json(run_dir(runs_dir, run_id), record)


def test_a_probe_run_is_stored_and_reported_without_steps(runs_dir):
    write_probe_run(runs_dir, "probe-1", job_id="job-1", slow=1)
    ingest(runs_dir)
    con = open_reader(runs_dir)
    try:
        (kind,) = con.execute("SELECT kind FROM runs WHERE run_id = 'probe-1'").fetchone()
        result = cached_report(con, "probe")
        (linked,) = linked_probes(con, "job-1")
    finally:
        con.close()
    assert kind == "probe" and result["kind"] == "probe" and result["for"] == "job-1"
    assert result["probe"]["slow_ranks"] == [1]
    assert {"src", "dst", "bytes_per_s", "src_host", "dst_host", "intra_node"} <= set(
        result["probe"]["pairs"][0]
    )
    assert (linked["run_id"], linked["slow_ranks"]) == ("probe-1", [1])
    text = format_report(result)
    assert "verdict: slow sender node1 (rank 1)" in text and "node1     node0" in text


def test_a_store_from_before_probes_gains_the_kind_column(runs_dir):
    write_probe_run(runs_dir, "probe-1", job_id="job-1", slow=0)
    ingest(runs_dir)
    con = duckdb.connect(str(store_path(runs_dir)))  # make it a store from before `kind`
    con.execute("ALTER TABLE runs DROP COLUMN kind")
    con.execute("UPDATE runs SET run_json = json_object('run_id', run_id)")  # a training run's
    con.execute("DELETE FROM store_schema")
    con.close()
    con = open_reader(runs_dir)
    try:
        assert linked_probes(con, "job-1") == []  # read as it is: no `kind`, no probes
    finally:
        con.close()
    write_probe_run(runs_dir, "probe-2", job_id="job-1", slow=0)
    ingest(runs_dir)  # the one writer upgrades the store
    con = open_reader(runs_dir)
    try:
        kinds = dict(con.execute("SELECT run_id, kind FROM runs").fetchall())
        linked = [p["run_id"] for p in linked_probes(con, "job-1")]
    finally:
        con.close()
    assert kinds == {"probe-1": "train", "probe-2": "probe"} and linked == ["probe-2"]


def test_a_pairs_rate_is_its_fastest_sample():
    """Samples of a slow-NIC test run in a timing loop (`ranktrace probe` beside other jobs on
    2 cores): an unlimited pair sized at one 127 KB message a sample after a stalled warm-up,
    whose samples the host delayed by up to 76 ms, and a pair limited to ~1 MB/s. The median
    read the unlimited pair at 13.8 MB/s; its fastest sample at 375 MB/s, its link's pace."""
    unlimited = pair_rate(127690, [0.07620, 0.009846, 0.009249, 0.0003427, 0.002540])
    limited = pair_rate(60516, [0.05955, 0.06333, 0.06330, 0.05955, 0.06338])
    assert unlimited > 300e6 and 0.9e6 < limited < 1.1e6, (unlimited, limited)
