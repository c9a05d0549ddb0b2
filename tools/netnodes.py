"""Several "nodes" on one machine: Linux network namespaces joined by a bridge, each with its own
address and host name, for rehearsing multi-node training (torchrun across nodes, gloo over
real TCP hops, a rate-limited NIC) without a cluster.

    with NetnsCluster(2) as cluster:                 # needs root (ip netns, tc)
        cluster.limit(1, "8mbit")                    # node 1's NIC: tbf rate limit
        proc = cluster.popen(0, ["hostname"])        # runs inside node 0 (UTS namespace too)

Node i is the namespace `<prefix>-n<i>` with interface `eth0` at 10.<net>.0.<i+1>/24 and host name
`node<i>`; the bridge lives in its own namespace `<prefix>-br`, so nothing touches the host's
network. Everything is deleted on exit, also after a failure. `python tools/netnodes.py N`
builds N nodes, prints them, pings across, and tears them down.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Node:
    index: int
    netns: str
    address: str
    hostname: str


class NetnsCluster:
    """N namespace nodes on one bridge; a context manager that always cleans up."""

    def __init__(self, n_nodes: int, prefix: str | None = None) -> None:
        self.prefix = prefix or f"rt{secrets.token_hex(2)}"
        self.net = 64 + int(self.prefix[-2:], 16) % 128  # 10.<net>.0.0/24, per cluster
        self.bridge_ns = f"{self.prefix}-br"
        self.nodes = [
            Node(i, f"{self.prefix}-n{i}", f"10.{self.net}.0.{i + 1}", f"node{i}")
            for i in range(n_nodes)
        ]
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
        return ["ip", "netns", "exec", node.netns, "unshare", "--uts", "--mount", "sh", "-c",
                script, "sh", *argv]  # fmt: skip

    def popen(self, index: int, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(index, argv), **kwargs)

    def limit(self, index: int, rate: str) -> None:
        """Rate-limit node `index`'s NIC (egress) with a token bucket, e.g. "8mbit"."""
        node = self.nodes[index]
        argv = ["ip", "netns", "exec", node.netns, "tc", "qdisc", "add", "dev", "eth0", "root",
                "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"tc on node {index} failed: {result.stderr.strip()}")


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


def main() -> int:
    n_nodes = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    try:
        with NetnsCluster(n_nodes) as cluster:
            for node in cluster.nodes:
                print(f"node {node.index}: netns {node.netns}, {node.address}, {node.hostname}")
            target = cluster.nodes[-1].address
            server = cluster.popen(len(cluster.nodes) - 1, [sys.executable, "-c", ECHO_SERVER],
                                   stdout=subprocess.PIPE, text=True)  # fmt: skip
            client = [sys.executable, "-c", ECHO_CLIENT.format(address=target)]
            sent = subprocess.run(cluster.command(0, client), capture_output=True, text=True)
            received = server.communicate(timeout=10)[0].strip()
            ok = sent.returncode == 0 and received == "hello"
            print(f"node 0 -> {target}:{ECHO_PORT} over TCP: {'ok' if ok else 'FAILED'}")
            return 0 if ok else 1
    except NetnsUnavailable as error:
        print(f"netnodes: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
