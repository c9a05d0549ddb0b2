"""Multi-node on one machine: two network-namespace "nodes" (tools/netnodes.py), torchrun with
c10d rendezvous across them, gloo over real TCP hops between the nodes. The trainer must match
the single-process run and every rank's telemetry must land in one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from analysis.store import open_reader
from tests.conftest import REPO, cli_env, ranktrace
from tools.netnodes import NetnsCluster, NetnsUnavailable

LOSS_RTOL = 1e-5  # as tests/test_parity.py: fp32, same global batch, other summation order
RANKS_PER_NODE = 2
TRAIN = ["--tp", "2", "--dp", "2", "--steps", "6", "--precision", "fp32", "--data", "synthetic",
         "--seq-len", "32"]  # fmt: skip


@pytest.fixture(scope="module")
def two_nodes():
    try:
        with NetnsCluster(2) as cluster:
            yield cluster
    except NetnsUnavailable as error:
        pytest.skip(f"no network namespaces here: {error}")


def torchrun_on_nodes(cluster: NetnsCluster, runs_dir, *args: str, timeout: float = 240):
    """`torchrun ... -m trainer ARGS` on every node of `cluster`; returns each node's output."""
    endpoint = f"{cluster.nodes[0].address}:29400"
    procs = []
    for node in cluster.nodes:
        env = {**cli_env(), "GLOO_SOCKET_IFNAME": "eth0"}  # the node's own interface
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(cluster.nodes)),
                "--nproc-per-node", str(RANKS_PER_NODE), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", os.path.basename(str(runs_dir)),
                "--rdzv-conf", f"is_host={int(node.index == 0)}",
                "-m", "trainer", *args, "--runs-dir", str(runs_dir)]  # fmt: skip
        procs.append(cluster.popen(node.index, argv, env=env, cwd=REPO, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT))  # fmt: skip
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append((proc.returncode, out))
    return outputs


def test_tp_inside_nodes_dp_across_matches_one_process(two_nodes, tmp_path):
    runs_dir = tmp_path / "runs"
    outputs = torchrun_on_nodes(two_nodes, runs_dir, *TRAIN, "--run-name", "two-nodes")
    for code, out in outputs:
        assert code == 0, out[-3000:]
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
