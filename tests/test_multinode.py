"""Multi-node on one machine: network-namespace "nodes" (tools/netnodes.py), torchrun with c10d
rendezvous across them, gloo over real TCP hops between the nodes, and a real slow NIC (a tbf
rate limit on one node's interface).

- 2 nodes × 2 ranks: the trainer matches the single-process run; every rank's telemetry lands
  in one run, with its node and clock offset.
- 2 nodes, the link between them limited: TP inside the nodes gives an inter-node bandwidth
  finding (dp) and no straggler; TP across the nodes (--rank-order dp-tp-pp) is flagged, and the
  comparison of the two changes one axis and shows the TP cost.
- 4 nodes × 1 rank, pp2 dp2: nothing on a healthy run; one node's NIC limited → that node's rank
  is the communication straggler, as only the groups holding it slow down.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from analysis.run import compare, report
from analysis.store import open_reader
from tests.conftest import REPO, cli_env, ranktrace
from tools.netnodes import NetnsCluster, NetnsUnavailable

LOSS_RTOL = 1e-5  # as tests/test_parity.py: fp32, same global batch, other summation order
TRAIN = ["--tp", "2", "--dp", "2", "--steps", "6", "--precision", "fp32", "--data", "synthetic",
         "--seq-len", "32"]  # fmt: skip
SLOW_LINK = "8mbit"  # 1 MB/s, about 1/100 of the namespaces' unlimited TCP here
SLOW_LINK_TRAIN = [*TRAIN, "--model", "tiny"]
FOUR_NODE_TRAIN = ["--pp", "2", "--dp", "2", "--model", "tiny", "--steps", "20",
                   "--data", "synthetic"]  # fmt: skip
SLOW_NIC = "8mbit"


@pytest.fixture(scope="module")
def two_nodes():
    try:
        with NetnsCluster(2) as cluster:
            yield cluster
    except NetnsUnavailable as error:
        pytest.skip(f"no network namespaces here: {error}")


def torchrun_on_nodes(
    cluster: NetnsCluster, runs_dir, *args: str, ranks_per_node: int = 2, timeout: float = 240
):
    """`torchrun ... -m trainer ARGS` on every node of `cluster` (the command docs/multinode.md
    shows); asserts every node's torchrun exited 0."""
    template = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(cluster.nodes)),
                "--nproc-per-node", str(ranks_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", "{node0}:29400", "--rdzv-id", os.path.basename(str(runs_dir)),
                "--rdzv-conf", "is_host={is_host}",
                "-m", "trainer", *args, "--runs-dir", str(runs_dir)]  # fmt: skip
    env = {**cli_env(), "GLOO_SOCKET_IFNAME": "eth0"}  # the node's own interface
    for code, out in cluster.run_everywhere(template, timeout, env=env, cwd=REPO):
        assert code == 0, out[-3000:]


def ingested_reports(runs_dir, *names: str) -> list[dict]:
    """Ingest `runs_dir` and return the report of each named run."""
    assert ranktrace("ingest", "--runs-dir", str(runs_dir), runs_dir=runs_dir).returncode == 0
    con = open_reader(runs_dir)
    try:
        return [report(con, name) for name in names]
    finally:
        con.close()


def recorded_losses(con, name: str) -> list[float]:
    """The losses run `name` recorded (its run.json)."""
    row = con.execute("SELECT run_json FROM runs WHERE name = ?", [name]).fetchone()
    return json.loads(row[0])["losses"]


def test_tp_inside_nodes_dp_across_matches_one_process(two_nodes, tmp_path):
    runs_dir = tmp_path / "runs"
    torchrun_on_nodes(two_nodes, runs_dir, *TRAIN, "--run-name", "two-nodes")
    (record_path,) = runs_dir.glob("*/run.json")
    record = json.loads(record_path.read_text())
    reference = ranktrace("train", *TRAIN[4:], "--run-name", "one", runs_dir=tmp_path / "ref")
    assert reference.returncode == 0, reference.stdout[-2000:]
    expected = reference.run()["losses"]
    assert record["losses"] == pytest.approx(expected, rel=LOSS_RTOL)
    assert ranktrace("ingest", "--runs-dir", str(runs_dir), runs_dir=runs_dir).returncode == 0
    con = open_reader(runs_dir)
    try:
        ranks = con.execute("SELECT rank, host, tp, dp, clock_offset_ns FROM ranks "
                            "ORDER BY rank").fetchall()  # fmt: skip
        steps = con.execute("SELECT count(*), count(DISTINCT rank) FROM steps").fetchone()
        cross = con.execute(
            "SELECT axis, count(*) FROM collectives WHERE complete GROUP BY axis ORDER BY axis"
        ).fetchall()
    finally:
        con.close()
    assert [r[0] for r in ranks] == [0, 1, 2, 3]
    hosts = {rank: host for rank, host, *_ in ranks}
    assert sorted(set(hosts.values())) == ["node0", "node1"]
    # TP innermost: each tp pair shares a node; the dp pairs cross nodes.
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and hosts[0] != hosts[2]
    assert all(offset is not None for *_, offset in ranks)  # measured against rank 0
    assert steps == (4 * 6, 4)
    assert {axis for axis, _ in cross} >= {"tp", "dp", "world"}  # every instance matched up
    (topology,) = [r["topology"] for r in ingested_reports(runs_dir, "two-nodes")]
    assert topology["groups"]["tp"] == {"groups": 2, "crossing_nodes": 0}
    assert topology["groups"]["dp"] == {"groups": 2, "crossing_nodes": 2}
    assert topology["flags"] == []


def test_slow_link_between_nodes_is_bandwidth_and_tp_across_nodes_is_flagged(two_nodes, tmp_path):
    runs_dir = tmp_path / "runs"
    two_nodes.limit(1, SLOW_LINK)
    try:
        torchrun_on_nodes(two_nodes, runs_dir, *SLOW_LINK_TRAIN, "--run-name", "tp-inside")
        torchrun_on_nodes(two_nodes, runs_dir, *SLOW_LINK_TRAIN, "--rank-order", "dp-tp-pp",
                          "--run-name", "tp-across")  # fmt: skip
    finally:
        two_nodes.unlimit(1)
    inside, across = ingested_reports(runs_dir, "tp-inside", "tp-across")
    assert across["settings"]["tp"] == 2  # same layout, other placement: same losses
    for run in (inside, across):
        assert run["stragglers"] == []  # every dp (or tp) group crosses the slow link alike
    # TP inside the nodes: dp crosses them, slowly, for every group: a bandwidth finding.
    finding = inside["topology"]["inter_node_bandwidth"]
    assert finding is not None and finding["axes"] == ["dp"]
    assert finding["ratio"] < 0.5 and finding["inter_node_share_pct"] >= 10
    assert inside["topology"]["flags"] == []
    localities = {(b["locality"], b["axis"]) for b in inside["topology"]["bandwidth"]}
    assert localities == {("intra-node", "tp"), ("inter-node", "dp")}
    # TP across the nodes: flagged, and its all-reduces now pay the slow link.
    (flag,) = across["topology"]["flags"]
    assert flag.startswith("TP crosses nodes: put TP innermost")
    localities = {(b["locality"], b["axis"]) for b in across["topology"]["bandwidth"]}
    assert localities == {("intra-node", "dp"), ("inter-node", "tp")}
    con = open_reader(runs_dir)
    try:
        comparison = compare(con, "tp-inside", "tp-across")
        losses = [recorded_losses(con, name) for name in ("tp-inside", "tp-across")]
    finally:
        con.close()
    assert comparison["differing_axes"] == ["rank_order"] and not comparison["confounded"]
    ratios = {m["metric"]: m["ratio"] for m in comparison["metrics"]}
    assert ratios["tp_comm_s"] > 3 and ratios["step_time_s"] > 1.1
    assert ratios["inter_node_transfer_s"] > 1
    assert losses[1] == pytest.approx(losses[0], rel=LOSS_RTOL)


def test_slow_nic_is_localized_to_its_node_rank(tmp_path):
    runs_dir = tmp_path / "runs"
    try:
        with NetnsCluster(4) as cluster:
            torchrun_on_nodes(cluster, runs_dir, *FOUR_NODE_TRAIN, "--run-name", "healthy",
                              ranks_per_node=1)  # fmt: skip
            cluster.limit(3, SLOW_NIC)
            torchrun_on_nodes(cluster, runs_dir, *FOUR_NODE_TRAIN, "--run-name", "slow-nic",
                              ranks_per_node=1)  # fmt: skip
    except NetnsUnavailable as error:
        pytest.skip(f"no network namespaces here: {error}")
    healthy, slow = ingested_reports(runs_dir, "healthy", "slow-nic")
    assert healthy["stragglers"] == [] and healthy["imbalances"] == []
    assert healthy["topology"]["inter_node_bandwidth"] is None
    assert [n["host"] for n in slow["topology"]["nodes"]] == [f"node{i}" for i in range(4)]
    (finding,) = slow["stragglers"]
    assert (finding["rank"], finding["kind"], finding["axis"]) == (3, "communication", "dp")
    assert finding["pattern"] == "chronic" and finding["cost_pct"] > 20
    # one node's NIC is a straggler, not the network: no bandwidth finding on top
    assert slow["topology"]["inter_node_bandwidth"] is None
