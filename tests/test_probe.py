"""`ranktrace probe` on network-namespace nodes (tools/netnodes.py), launched as a user launches
it: `torchrun ... $(command -v ranktrace) probe ...` on every node.

4 nodes × 1 rank, one cluster:
- node 1's NIC limited on egress (8 Mbit/s): node 1 is the slow sender, rank 1 the one named;
  its pairs run at ~1 MB/s and every other pair far faster. The probe is linked (`--for`) to a
  small training run, whose report (JSON and text) then shows the probe's verdict.
- node 2 limited on ingress (a tbf on its bridge port): node 2 is the slow receiver.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tests.conftest import REPO, cli_env, ranktrace
from tools.netnodes import NetnsCluster, NetnsUnavailable

pytestmark = pytest.mark.multiprocess  # real rank processes in network namespaces

SLOW_NIC = "8mbit"  # 1 MB/s; unlimited TCP between the namespaces runs at hundreds of MB/s
SLOW_MAX_BYTES_PER_S = 1.2e6  # the tbf rate, plus its burst's share of a short sample
FAST_MIN_BYTES_PER_S = 20e6  # 20x the limit: what every unlimited pair clears here
MEASURE_BUDGET_S = 10  # measuring the 12 pairs at --pair-seconds 0.3: ~4-5 s here
LAUNCH_BUDGET_S = 60  # with torchrun starting 4 ranks on 2 shared cores: 16-25 s here
LAUNCH = (
    "torchrun --nnodes 4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint {node0}:29400 "
    "--rdzv-id {rdzv} --rdzv-conf is_host={is_host} $(command -v ranktrace) probe "
    "--runs-dir {runs_dir} --pair-seconds 0.3 {extra}"
)


@pytest.fixture(scope="module")
def four_nodes():
    try:
        with NetnsCluster(4) as cluster:
            yield cluster
    except NetnsUnavailable as error:
        pytest.skip(f"no network namespaces here: {error}")


def probe_on_nodes(cluster: NetnsCluster, runs_dir, name: str, *extra: str) -> float:
    """The probe's launch line on every node (a shell fills in `$(command -v ranktrace)`, the
    venv's console script); asserts each node's torchrun exited 0; returns the wall time."""
    line = LAUNCH.format(node0="{node0}", is_host="{is_host}", rdzv=name, runs_dir=runs_dir,
                         extra=" ".join(("--name", name, *extra)))  # fmt: skip
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    env = {**cli_env(), "GLOO_SOCKET_IFNAME": "eth0", "PATH": path}
    started = time.monotonic()
    for code, out in cluster.run_everywhere(["sh", "-c", line], 240, env=env, cwd=REPO):
        assert code == 0, out[-3000:]
    return time.monotonic() - started


def report_json(runs_dir, run: str) -> dict:
    result = ranktrace("report", run, "--runs-dir", str(runs_dir), "--json", runs_dir=runs_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_a_slow_sender_node_is_named_and_shown_in_its_jobs_report(four_nodes, tmp_path):
    runs_dir = tmp_path / "runs"
    job = ranktrace("train", "--dp", "2", "--model", "tiny", "--steps", "3", "--data",
                    "synthetic", "--run-name", "job", runs_dir=runs_dir)  # fmt: skip
    assert job.returncode == 0, job.stdout[-2000:]
    job_id = job.run()["run_id"]
    four_nodes.limit(1, SLOW_NIC)
    try:
        wall_s = probe_on_nodes(four_nodes, runs_dir, "egress", "--for", "job")
    finally:
        four_nodes.unlimit(1)
    result = report_json(runs_dir, "egress")
    probe = result["probe"]
    assert result["kind"] == "probe" and result["for"] == job_id
    assert probe["slow_ranks"] == [1]
    (sender,) = probe["slow_senders"]
    assert (sender["scope"], sender["host"], sender["ranks"]) == ("node", "node1", [1])
    assert probe["slow_receivers"] == []
    assert {(p["src"], p["dst"]) for p in probe["pairs"]} == {
        (s, d) for s in range(4) for d in range(4) if s != d
    }
    for pair in probe["pairs"]:
        assert {"src_host", "dst_host", "intra_node", "bytes"} <= set(pair)
        if pair["src"] == 1:
            assert pair["bytes_per_s"] < SLOW_MAX_BYTES_PER_S, pair
        else:
            assert pair["bytes_per_s"] > FAST_MIN_BYTES_PER_S, pair
    assert probe["duration_s"] < MEASURE_BUDGET_S and wall_s < LAUNCH_BUDGET_S
    # The job's report shows the probe made for it, in JSON and in text.
    (linked,) = report_json(runs_dir, "job")["probes"]
    assert (linked["run_id"], linked["slow_ranks"]) == (result["run_id"], [1])
    text = ranktrace("report", "job", "--runs-dir", str(runs_dir), runs_dir=runs_dir).stdout
    assert f"probe {result['run_id']} (egress): slow sender node1 (rank 1)" in text


def test_a_slow_receiver_node_is_named(four_nodes, tmp_path):
    runs_dir = tmp_path / "runs"
    four_nodes.limit(2, SLOW_NIC, "ingress")
    try:
        probe_on_nodes(four_nodes, runs_dir, "ingress")
    finally:
        four_nodes.unlimit(2, "ingress")
    probe = report_json(runs_dir, "ingress")["probe"]
    assert probe["slow_ranks"] == [2] and probe["slow_senders"] == []
    assert [(r["host"], r["ranks"]) for r in probe["slow_receivers"]] == [("node2", [2])]
    slow = {(p["src"], p["dst"]) for p in probe["pairs"] if p["bytes_per_s"] < SLOW_MAX_BYTES_PER_S}
    assert slow == {(0, 2), (1, 2), (3, 2)}
