"""Which node `ranktrace report` names when one node's NIC is slow, whatever the shaping: every
node position, egress and ingress, tbf bursts and rates swept, 4 nodes × 1 rank and 2 × 2.
Network-namespace nodes (tools/netnodes.py), torchrun across them, pp2 dp2 (tiny model,
synthetic data); needs root (ip netns, tc).

    python benchmarks/node_localization.py [--shapes 4x1,2x2] [--bursts 32kbit,128kbit,512kbit]
        [--rates 4mbit,8mbit,16mbit] [--sides egress,ingress] [--steps 14] [--healthy 2]
        [--seq-len 64] [--no-probe]

Each run is one of:
- `located`: the stragglers name exactly the slow node (its ranks, the node in `hosts`);
- `candidates`: no node named, and `candidate_hosts` hold the slow node and at most half the
  nodes; then `ranktrace probe --for RUN`, under the same shaping, is asked to separate them
  (`probe`: the slow node among its slow senders or receivers, the side limited);
- `inseparable`: on two nodes, both as candidates: A's slow egress and B's slow ingress slow
  exactly the same transfers (A -> B), and a probe of the one pair measures the same direction,
  so no timing separates them (the physical limit; not probed);
- `unjudged`: on two nodes, nothing named, and the report's `inter_node_unjudged` note says the
  run holds no reference for its crossing transfers (every one crosses both NICs) and points at
  the probe (the job's timing cannot judge it; the benchmark does not probe these);
- `missed`: the job was slowed and nothing was named (nor said to be unjudged);
- `wrong`: a node named that is not the slow one, or candidates without it, or other ranks;
- `not slowed`: the job's median step under 5% above the shape's healthy runs' (the shaping
  did not measurably slow it), whatever was named.
Targets (issue 26): 0 `wrong`; 4x1 egress >= 90% `located`. Prints one row per run and a table
per shape and side, with the candidate-only rate.

`--seq-len` sets the pipeline transfers' size (2 sequences x seq-len x 64 hidden x 2 bytes: 16 KB
at the default 64, 128 KB at 512). A transfer that fits in the tbf burst leaves the bucket at line
rate, so where the pipeline's transfers are under the burst only the two-member dp all-reduce
shows the shaping, and its two ends slow alike: no timing of the job separates them (the probe
does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ranktrace.tools.netnodes import NetnsCluster  # noqa: E402
from ranktrace.trainer.config import TrainConfig  # noqa: E402

TRAIN = ["--pp", "2", "--dp", "2", "--model", "tiny", "--data", "synthetic"]
SLOWED = 1.05
"""A shaping that leaves the median step under 5% above the healthy runs' did not slow the job."""
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0",
       "PYTHONPATH": str(REPO)}  # fmt: skip


def torchrun(cluster: NetnsCluster, runs_dir: Path, per_node: int, name: str, steps: int,
             seq_len: int) -> None:  # fmt: skip
    """The job on every node (docs/multinode.md's launch line), then ingested."""
    template = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(cluster.nodes)),
                "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", "{node0}:29400", "--rdzv-id", name,
                "--rdzv-conf", "is_host={is_host}", "-m", "ranktrace.trainer", *TRAIN,
                "--steps", str(steps), "--seq-len", str(seq_len), "--run-name", name,
                "--runs-dir", str(runs_dir)]  # fmt: skip
    for code, out in cluster.run_everywhere(template, 400, env=ENV, cwd=REPO):
        if code != 0:
            raise RuntimeError(f"{name} failed: {out[-1500:]}")
    cli("ingest", "--runs-dir", str(runs_dir))


def probe(cluster: NetnsCluster, runs_dir: Path, per_node: int, job: str) -> dict:
    """`ranktrace probe --for JOB` on every node; its report's probe block."""
    template = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(cluster.nodes)),
                "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", "{node0}:29400", "--rdzv-id", f"probe-{job}",
                "--rdzv-conf", "is_host={is_host}", "-m", "ranktrace.app.cli", "probe",
                "--runs-dir", str(runs_dir), "--pair-seconds", "0.3", "--name", f"probe-{job}",
                "--for", job]  # fmt: skip
    for code, out in cluster.run_everywhere(template, 300, env=ENV, cwd=REPO):
        if code != 0:
            raise RuntimeError(f"probe of {job} failed: {out[-1500:]}")
    cli("ingest", "--runs-dir", str(runs_dir))
    return report(runs_dir, f"probe-{job}")["probe"]


def cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "ranktrace.app.cli", *args], capture_output=True,
                          text=True, cwd=REPO, env=ENV).stdout  # fmt: skip


def report(runs_dir: Path, name: str) -> dict:
    return json.loads(cli("report", name, "--runs-dir", str(runs_dir), "--json"))


def verdict(result: dict, slow_host: str, n_nodes: int, slowed: bool) -> str:
    """The run's class (module docstring), before any probe."""
    if not slowed:
        return "not slowed"
    nodes = {n["host"]: sorted(n["ranks"]) for n in result["topology"]["nodes"]}
    findings = result["stragglers"]
    if not findings:
        return "unjudged" if result["topology"].get("inter_node_unjudged") else "missed"
    if len(findings) != 1:
        return "wrong"
    (finding,) = findings
    if finding.get("hosts"):
        return "located" if finding["hosts"] == [slow_host] else "wrong"
    hosts = finding.get("candidate_hosts") or []
    if n_nodes == 2 and sorted(hosts) == sorted(nodes) and slow_host in hosts:
        return "inseparable"
    if slow_host in hosts and len(hosts) <= n_nodes // 2:
        expected = sorted(r for h in hosts for r in nodes[h])
        return "candidates" if sorted(finding["candidates"]) == expected else "wrong"
    ranks = [finding["rank"]] if finding["rank"] is not None else finding["candidates"]
    return "located" if sorted(ranks) == nodes[slow_host] else "wrong"  # a link, by its rank


def probed_verdict(cluster, runs_dir: Path, per_node: int, name: str, side: str,
                   slow_host: str) -> str:  # fmt: skip
    """` probe: node named` when `ranktrace probe --for NAME` finds exactly the slow node on
    the limited side, else ` probe: not separated`."""
    found = probe(cluster, runs_dir, per_node, name)
    slow = found["slow_senders" if side == "egress" else "slow_receivers"]
    named = [s["host"] for s in slow] == [slow_host]
    return " probe: node named" if named else " probe: not separated"


def describe(result: dict, baseline: float) -> str:
    """`0.512 s (1.84x) [['node1']]`: the median step, against healthy, and what was named."""
    said = [f.get("hosts") or f.get("candidate_hosts") or f["candidates"]
            for f in result["stragglers"]]  # fmt: skip
    return f"{result['step_time_s']:.3f} s ({result['step_time_s'] / baseline:.2f}x) {said}"


def slow_node_run(cluster, runs_dir: Path, shape: str, shaping: tuple, baseline: float,
                  args) -> tuple[str, bool]:  # fmt: skip
    """Train with node `shaping` = (side, burst, rate, node) limited; (its class, whether a
    probe separated the candidates)."""
    side, burst, rate, node = shaping
    n_nodes, per_node = (int(n) for n in shape.split("x"))
    name = f"{shape}-{side}-{burst}-{rate}-node{node}"
    cluster.limit(node, rate, side, burst)
    try:
        torchrun(cluster, runs_dir, per_node, name, args.steps, args.seq_len)
        result = report(runs_dir, name)
        slowed = result["step_time_s"] >= SLOWED * baseline
        kind = verdict(result, f"node{node}", n_nodes, slowed)
        probed = ""
        if kind == "candidates" and not args.no_probe:
            probed = probed_verdict(cluster, runs_dir, per_node, name, side, f"node{node}")
    finally:
        cluster.unlimit(node, side)
    print(f"  {name:34} {describe(result, baseline)} -> {kind:10}{probed}", flush=True)
    return kind, probed == " probe: node named"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4x1,2x2")
    parser.add_argument("--bursts", default="32kbit,128kbit,512kbit", help="4, 16 and 64 KB")
    parser.add_argument("--rates", default="4mbit,8mbit,16mbit")
    parser.add_argument("--sides", default="egress,ingress")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--healthy", type=int, default=2)
    parser.add_argument(
        "--seq-len",
        type=int,
        default=TrainConfig.seq_len,
        help="tokens per sequence: sets the pipeline transfers' size",
    )
    parser.add_argument("--no-probe", action="store_true", help="skip probing candidate runs")
    args = parser.parse_args()
    runs_dir = Path(tempfile.mkdtemp(prefix="ranktrace-nodes-"))
    print(f"runs in {runs_dir}", flush=True)
    tallies: dict[tuple[str, str], dict[str, int]] = {}
    for shape in args.shapes.split(","):
        n_nodes, per_node = (int(n) for n in shape.split("x"))
        with NetnsCluster(n_nodes) as cluster:
            healthy = []
            for repeat in range(args.healthy):
                name = f"{shape}-healthy-{repeat}"
                torchrun(cluster, runs_dir, per_node, name, args.steps, args.seq_len)
                result = report(runs_dir, name)
                healthy.append(result["step_time_s"])
                print(f"  {name:34} healthy {result['step_time_s']:.3f} s -> named "
                      f"{[f['candidates'] for f in result['stragglers']]}", flush=True)  # fmt: skip
            baseline = statistics.median(healthy)
            for side in args.sides.split(","):
                tally = tallies.setdefault((shape, side), {})
                for burst in args.bursts.split(","):
                    for rate in args.rates.split(","):
                        for node in range(n_nodes):
                            shaping = (side, burst, rate, node)
                            kind, probed = slow_node_run(cluster, runs_dir, shape, shaping,
                                                         baseline, args)  # fmt: skip
                            tally[kind] = tally.get(kind, 0) + 1
                            tally["probe resolved"] = tally.get("probe resolved", 0) + probed
    print(f"\n{'shape':5} {'side':7} {'runs':>4} {'located':>8} {'candid.':>8} {'probe':>6} "
          f"{'insep.':>6} {'unjudg.':>7} {'missed':>6} {'wrong':>6} "
          f"{'not slowed':>10}")  # fmt: skip
    for (shape, side), t in tallies.items():
        runs = sum(v for k, v in t.items() if k != "probe resolved")
        print(f"{shape:5} {side:7} {runs:>4} {t.get('located', 0):>8} {t.get('candidates', 0):>8} "
              f"{t.get('probe resolved', 0):>6} {t.get('inseparable', 0):>6} "
              f"{t.get('unjudged', 0):>7} "
              f"{t.get('missed', 0):>6} {t.get('wrong', 0):>6} "
              f"{t.get('not slowed', 0):>10}")  # fmt: skip
    print(f"runs kept in {runs_dir}")


if __name__ == "__main__":
    main()
