"""Several "nodes" on one machine: Linux network namespaces joined by a bridge, each with its own
address and host name, for rehearsing multi-node training (torchrun across nodes, gloo over
real TCP hops, a rate-limited NIC) without a cluster.

    with NetnsCluster(2) as cluster:                 # needs root (ip netns, tc)
        cluster.limit(1, "8mbit")                    # node 1's NIC: tbf rate limit
        cluster.limit(0, "8mbit", "ingress")         # what node 0 receives (its bridge port)
        proc = cluster.popen(0, ["hostname"])        # runs inside node 0 (UTS namespace too)

Node i is the namespace `<prefix>-n<i>` with interface `eth0` at 10.<net>.0.<i+1>/24 and host name
`node<i>`; the bridge lives in its own namespace `<prefix>-br`, so nothing touches the host's
network. Each node's processes are pinned to their own share of the CPUs (`taskset`), as a node
of their own would have: without it, 4 nodes on 2 cores let the scheduler starve one rank for a
whole run, which the analysis rightly calls a compute straggler.
Everything is deleted on exit, also after a failure. `python tools/netnodes.py N` builds N
nodes and checks TCP across; `python tools/netnodes.py N [--limit I=RATE] -- COMMAND` runs
COMMAND on every node at once (e.g. torchrun, see docs/multinode.md; `--limit-ingress I=RATE`
limits what node I receives).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, a sandbox)."""


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")


def _cpu_share(index: int, n_nodes: int) -> list[int]:
    """Node `index`'s CPUs: a contiguous block of this process's CPUs (nodes share a CPU when
    there are more nodes than CPUs; neighbouring nodes share first)."""
    cpus = sorted(os.sched_getaffinity(0))
    start = index * len(cpus) // n_nodes
    end = max(start + 1, (index + 1) * len(cpus) // n_nodes)
    return cpus[start:end]


@dataclass(frozen=True)
class Node:
    index: int
    netns: str
    address: str
    hostname: str


class NetnsCluster:
    """N namespace nodes on one bridge; a context manager that always cleans up."""

    def __init__(self, n_nodes: int, prefix: str | None = None, pin_cpus: bool = True) -> None:
        self.prefix = prefix or f"rt{secrets.token_hex(2)}"
        self.net = 64 + int(self.prefix[-2:], 16) % 128  # 10.<net>.0.0/24, per cluster
        self.bridge_ns = f"{self.prefix}-br"
        self.nodes = [
            Node(i, f"{self.prefix}-n{i}", f"10.{self.net}.0.{i + 1}", f"node{i}")
            for i in range(n_nodes)
        ]
        self.cpus = [_cpu_share(i, n_nodes) for i in range(n_nodes)] if pin_cpus else None
        self._made: list[str] = []
        self._hosts_dir = ""

    def __enter__(self) -> NetnsCluster:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (ip netns add)")
        try:
            self._build()
        except BaseException as error:
            self.close()
            if isinstance(error, RuntimeError):
                raise NetnsUnavailable(f"cannot build namespace nodes: {error}") from None
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("link", "set", "lo", "up", netns=name)

    def _build(self) -> None:
        self._hosts_dir = tempfile.mkdtemp(prefix=f"{self.prefix}-")
        self._hosts_file = Path(self._hosts_dir) / "hosts"
        names = "".join(f"{node.address} {node.hostname}\n" for node in self.nodes)
        self._hosts_file.write_text(f"127.0.0.1 localhost\n{names}")
        self._add_netns(self.bridge_ns)
        _ip("link", "add", "br0", "type", "bridge", netns=self.bridge_ns)
        _ip("link", "set", "br0", "up", netns=self.bridge_ns)
        for node in self.nodes:
            self._add_netns(node.netns)
            port = f"p{node.index}"
            _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns",
                node.netns, netns=self.bridge_ns)  # fmt: skip
            _ip("link", "set", port, "master", "br0", netns=self.bridge_ns)
            _ip("link", "set", port, "up", netns=self.bridge_ns)
            _ip("addr", "add", f"{node.address}/24", "dev", "eth0", netns=node.netns)
            _ip("link", "set", "eth0", "up", netns=node.netns)

    def close(self) -> None:
        """Delete every namespace this cluster made (their interfaces go with them)."""
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made = []
        if self._hosts_dir:
            shutil.rmtree(self._hosts_dir, ignore_errors=True)

    def command(self, index: int, argv: list[str]) -> list[str]:
        """`argv` as run inside node `index`: its network namespace, its own host name, and an
        /etc/hosts naming every node (as a cluster's DNS would; torch publishes host names)."""
        node = self.nodes[index]
        script = (f'mount --bind {self._hosts_file} /etc/hosts && hostname {node.hostname} '
                  f'&& exec "$@"')  # fmt: skip
        pin = ["taskset", "-c", ",".join(map(str, self.cpus[index]))] if self.cpus else []
        return ["ip", "netns", "exec", node.netns, *pin, "unshare", "--uts", "--mount", "sh", "-c",
                script, "sh", *argv]  # fmt: skip

    def popen(self, index: int, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(index, argv), **kwargs)

    def run_everywhere(
        self, template: list[str], timeout: float, **popen_kwargs
    ) -> list[tuple[int, str]]:
        """Run `template` on every node at once, each argument formatted with `{node}` (the
        node's index), `{node0}` (node 0's address) and `{is_host}` (1 on node 0, else 0);
        the nodes' (exit code, output) once all have ended. Kills them all on a timeout."""
        procs = []
        for node in self.nodes:
            fields = {"node": node.index, "node0": self.nodes[0].address,
                      "is_host": int(node.index == 0)}  # fmt: skip
            argv = [arg.format(**fields) for arg in template]
            output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
            procs.append(self.popen(node.index, argv, **output, **popen_kwargs))
        results = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                raise
            results.append((proc.returncode, out))
        return results

    def _tc_root_qdisc(self, index: int, direction: str, action: str, *qdisc: str) -> None:
        """`tc qdisc ACTION dev DEV root QDISC` on the device that carries node `index`'s
        traffic in `direction`: its eth0 for egress; for ingress its port on the bridge (what
        the bridge sends it, so no ifb device is needed)."""
        if direction not in ("egress", "ingress"):
            raise ValueError(f"direction {direction!r}: choose egress or ingress")
        node = self.nodes[index]
        if direction == "egress":
            netns, dev = node.netns, "eth0"
        else:
            netns, dev = self.bridge_ns, f"p{index}"
        argv = ["ip", "netns", "exec", netns, "tc", "qdisc", action, "dev", dev, "root", *qdisc]
        result = subprocess.run(argv, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"tc on node {index} failed: {result.stderr.strip()}")

    def limit(self, index: int, rate: str, direction: str = "egress",
              burst: str = "32kbit") -> None:  # fmt: skip
        """Rate-limit node `index`'s NIC with a token bucket, e.g. "8mbit": what it sends
        (egress, the default) or what it receives (ingress); `burst`: the bucket's size
        (32kbit: 4 KB)."""
        self._tc_root_qdisc(index, direction, "add", "tbf", "rate", rate, "burst", burst,
                            "latency", "400ms")  # fmt: skip

    def unlimit(self, index: int, direction: str = "egress") -> None:
        """Remove node `index`'s rate limit (see `limit`)."""
        self._tc_root_qdisc(index, direction, "del")

    def limit_ingress(self, index: int, rate: str) -> None:
        """`limit(index, rate, "ingress")`: what node `index` receives."""
        self.limit(index, rate, "ingress")

    def unlimit_ingress(self, index: int) -> None:
        """`unlimit(index, "ingress")`."""
        self.unlimit(index, "ingress")


ECHO_PORT = 5555
ECHO_SERVER = f"""
import socket
with socket.create_server(("0.0.0.0", {ECHO_PORT})) as server:
    server.settimeout(10)
    connection, _ = server.accept()
    print(connection.recv(16).decode())
"""
ECHO_CLIENT = f"""
import socket, time
for _ in range(50):
    try:
        socket.create_connection(("{{address}}", {ECHO_PORT}), timeout=2).sendall(b"hello")
        break
    except ConnectionRefusedError:
        time.sleep(0.1)
"""


def check_tcp(cluster: NetnsCluster) -> bool:
    """Node 0 reaches the last node over TCP."""
    target = cluster.nodes[-1].address
    server = cluster.popen(len(cluster.nodes) - 1, [sys.executable, "-c", ECHO_SERVER],
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
    client = [sys.executable, "-c", ECHO_CLIENT.format(address=target)]
    sent = subprocess.run(cluster.command(0, client), capture_output=True, text=True)
    received = server.communicate(timeout=10)[0].strip()
    ok = sent.returncode == 0 and received == "hello"
    print(f"node 0 -> {target}:{ECHO_PORT} over TCP: {'ok' if ok else 'FAILED'}")
    return ok


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tools/netnodes.py",
        usage="%(prog)s N [--limit NODE=RATE] [--limit-ingress NODE=RATE] [--timeout S] "
        "[-- COMMAND ARGS...]",
        description="Build N namespace nodes, check TCP between them or run a command on every "
        "node at once ({node}, {node0}, {is_host} filled in; GLOO_SOCKET_IFNAME=eth0), then "
        "tear everything down.",
    )
    parser.add_argument("nodes", type=int, help="number of nodes")
    parser.add_argument(
        "--limit", action="append", default=[], metavar="NODE=RATE",
        help="rate-limit a node's NIC with tbf, e.g. 1=16mbit (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--limit-ingress", action="append", default=[], metavar="NODE=RATE",
        help="rate-limit what a node receives (tbf on its bridge port), e.g. 2=8mbit",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the command")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = _parser()
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    limits = []
    for direction, specs in (("egress", args.limit), ("ingress", args.limit_ingress)):
        for spec in specs:
            node, _, rate = spec.partition("=")
            if not node.isdigit() or not rate or int(node) >= args.nodes:
                parser.error(f"--limit {spec}: expected NODE=RATE with NODE < {args.nodes}, "
                             f"e.g. 1=16mbit")  # fmt: skip
            limits.append((int(node), rate, direction))
    try:
        with NetnsCluster(args.nodes) as cluster:
            for node in cluster.nodes:
                print(f"node {node.index}: netns {node.netns}, {node.address}, {node.hostname}, "
                      f"cpus {cluster.cpus[node.index]}")  # fmt: skip
            for index, rate, direction in limits:
                cluster.limit(index, rate, direction)
            if not command:
                return 0 if check_tcp(cluster) else 1
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
            results = cluster.run_everywhere(command, args.timeout, env=env)
            for index, (code, out) in enumerate(results):
                print(f"--- node {index} (exit {code}) ---\n{out.rstrip()}")
            return next((code for code, _ in results if code), 0)
    except NetnsUnavailable as error:
        print(f"netnodes: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(f"netnodes: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
