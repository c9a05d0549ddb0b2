"""Which ranks `ranktrace report` names when one node's NIC is slow, for every node position:
network-namespace nodes (tools/netnodes.py), torchrun across them, one node's egress limited to
8 Mbit/s (tbf; `--ingress` also limits a node's receive side where tools/netnodes.py can).

    python benchmarks/node_localization.py [--runs 2] [--healthy 2] [--steps 20]
                                           [--shapes 4x1,2x2] [--ingress]

Shapes: 4 nodes × 1 rank and 2 nodes × 2 ranks, pp2 dp2 (tiny model, synthetic data). Each
position is trained `--runs` times; a run is right when the report's stragglers name exactly the
slow node's ranks (as `rank` or `candidates`) and nothing else; `--healthy` runs per shape with no
limit are right when nothing is named. Prints one row per run and a table per shape; needs root
(ip netns, tc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ranktrace.tools.netnodes import NetnsCluster  # noqa: E402

TRAIN = ["--pp", "2", "--dp", "2", "--model", "tiny", "--data", "synthetic"]
RATE = "8mbit"


def torchrun(cluster: NetnsCluster, runs_dir: Path, per_node: int, name: str, steps: int) -> None:
    """The job on every node (docs/multinode.md's launch line)."""
    template = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(cluster.nodes)),
                "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", "{node0}:29400", "--rdzv-id", name,
                "--rdzv-conf", "is_host={is_host}", "-m", "ranktrace.trainer", *TRAIN,
                "--steps", str(steps), "--run-name", name, "--runs-dir", str(runs_dir)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0",
           "PYTHONPATH": str(REPO)}  # fmt: skip
    for code, out in cluster.run_everywhere(template, 300, env=env, cwd=REPO):
        if code != 0:
            raise RuntimeError(f"{name} failed: {out[-1500:]}")


def named_ranks(runs_dir: Path, name: str, host: str) -> tuple[list[int], list[int], list[str]]:
    """(ranks on `host`, ranks the stragglers name, the report's notes) of run `name`."""
    argv = [
        sys.executable,
        "-m",
        "ranktrace.app.cli",
        "report",
        name,
        "--runs-dir",
        str(runs_dir),
        "--json",
    ]
    report = json.loads(subprocess.run(argv, capture_output=True, text=True, cwd=REPO).stdout)
    named = [
        [f["rank"]] if f["rank"] is not None else f["candidates"] for f in report["stragglers"]
    ]
    ranks = sorted({rank for ranks in named for rank in ranks})
    (on_host,) = [n["ranks"] for n in report["topology"]["nodes"] if n["host"] == host]
    return sorted(on_host), ranks, report["notes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--healthy", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--shapes", default="4x1,2x2")
    parser.add_argument("--ingress", action="store_true", help="also limit a receive side")
    args = parser.parse_args()
    runs_dir = Path(tempfile.mkdtemp(prefix="ranktrace-nodes-"))
    for shape in args.shapes.split(","):
        nodes, per_node = (int(n) for n in shape.split("x"))
        sides = ["egress", *(["ingress"] if args.ingress else [])]
        right = total = 0
        with NetnsCluster(nodes) as cluster:
            for repeat in range(args.healthy):
                name = f"{shape}-healthy-{repeat}"
                torchrun(cluster, runs_dir, per_node, name, args.steps)
                subprocess.run([sys.executable, "-m", "ranktrace.app.cli", "ingest", "--runs-dir",
                                str(runs_dir)], capture_output=True, cwd=REPO)  # fmt: skip
                _, ranks, _ = named_ranks(runs_dir, name, "node0")
                total += 1
                right += ranks == []
                print(f"  {name:24} healthy -> named {ranks}", flush=True)
            for side in sides:
                for node in range(nodes):
                    for repeat in range(args.runs):
                        name = f"{shape}-{side}-node{node}-{repeat}"
                        limit = cluster.limit if side == "egress" else cluster.limit_ingress
                        limit(node, RATE)
                        try:
                            torchrun(cluster, runs_dir, per_node, name, args.steps)
                        finally:
                            (cluster.unlimit if side == "egress" else cluster.unlimit_ingress)(node)
                        subprocess.run([sys.executable, "-m", "ranktrace.app.cli", "ingest",
                                        "--runs-dir", str(runs_dir)], capture_output=True,
                                       cwd=REPO)  # fmt: skip
                        expected, ranks, notes = named_ranks(runs_dir, name, f"node{node}")
                        total += 1
                        right += ranks == expected
                        print(f"  {name:24} slow node{node} ranks {expected} -> named {ranks}"
                              + (f"  [{notes[-1][:90]}]" if notes else ""), flush=True)  # fmt: skip
        print(f"{shape}: {right}/{total} runs name exactly the slow node's ranks", flush=True)
    print(f"runs kept in {runs_dir}")


if __name__ == "__main__":
    main()
