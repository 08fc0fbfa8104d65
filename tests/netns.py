"""A small network for partition tests: one node in its own network namespace, linked to the host by a
veth pair on a bridge, and an etcd both sides reach. Needs root and `ip` (iproute2); no outside network.

    root namespace                                   namespace <ns>
    bridge <br> 10.213.X.1/24  <-- veth <host_if> ====== <ns_if> 10.213.X.2/24
    etcd on 127.0.0.1:P and 10.213.X.1:P               the partitioned node's agent and workers
    the other nodes: host address 10.213.X.1

Why a bridge: `ip link set <host_if> down` (the cut) takes the veth port down, never the bridge, so the
nodes in the root namespace keep their address (and gloo its interface) while the namespaced node is cut
off: packets are dropped, as on a real partition, rather than refused. Every server binds loopback or a
lab address, never 0.0.0.0. `close()` removes the namespace, the links and etcd, also after a failure.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from petctl.io.etcd import etcd_binary, etcd_healthy
from petctl.io.net import free_port
from petctl.io.wait import wait_until


def ip(*args: str, netns: str = "") -> None:
    """One `ip` command (in namespace `netns` when given); raises CalledProcessError with its stderr."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    proc = subprocess.run([*prefix, "ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)


def netns_available() -> str:
    """"" when this machine can build the lab (root, `ip netns`), else why not (a skip reason)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    name = f"ptchk{secrets.token_hex(3)}"
    try:
        ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` fails here: {e.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return ""


def _free_subnet() -> int:
    """A third octet for 10.213.X.0/24 that no interface here uses (parallel test runs pick others)."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=30).stdout
    for _ in range(200):
        octet = 1 + secrets.randbelow(250)
        if f"10.213.{octet}." not in used:
            return octet
    raise RuntimeError("no free 10.213.X.0/24 subnet")


@dataclass
class NetLab:
    """The namespace, links and etcd of one test (see the module docstring)."""

    root: Path
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    octet: int = 0
    etcd_port: int = 0
    _etcd: subprocess.Popen | None = None
    _made: list[str] = field(default_factory=list)

    @property
    def ns(self) -> str:
        return f"ptns{self.tag}"

    @property
    def bridge(self) -> str:
        return f"ptb{self.tag}"

    @property
    def host_if(self) -> str:  # the root-side end of the veth: the one the cut takes down
        return f"ptv{self.tag}"

    @property
    def ns_if(self) -> str:
        return f"ptn{self.tag}"

    @property
    def host_addr(self) -> str:
        """The root namespace's address on the lab: the other nodes' host address, and etcd's."""
        return f"10.213.{self.octet}.1"

    @property
    def ns_addr(self) -> str:
        return f"10.213.{self.octet}.2"

    @property
    def etcd_endpoint(self) -> str:
        return f"http://{self.host_addr}:{self.etcd_port}"

    def ns_prefix(self) -> list[str]:
        """Prefix a command with this to run it inside the namespace."""
        return ["ip", "netns", "exec", self.ns]

    def build(self) -> NetLab:
        self.octet = _free_subnet()
        ip("netns", "add", self.ns)
        self._made.append("netns")
        ip("link", "add", self.bridge, "type", "bridge")
        self._made.append("bridge")
        ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self._made.append("veth")
        ip("link", "set", self.ns_if, "netns", self.ns)
        ip("link", "set", self.host_if, "master", self.bridge)
        ip("link", "set", self.host_if, "up")
        ip("addr", "add", f"{self.ns_addr}/24", "dev", self.ns_if, netns=self.ns)
        ip("link", "set", self.ns_if, "up", netns=self.ns)
        ip("link", "set", "lo", "up", netns=self.ns)
        return self

    def cut(self) -> None:
        """The partition: the namespaced node's link goes down; packets to and from it are dropped."""
        ip("link", "set", self.host_if, "down")

    def heal(self) -> None:
        ip("link", "set", self.host_if, "up")

    def start_etcd(self, data_dir: Path, timeout: float = 20.0) -> str:
        """etcd on loopback and the lab address (the same port), data under `data_dir`; its endpoint."""
        data_dir.mkdir(parents=True, exist_ok=True)
        self.etcd_port, peer = free_port(), free_port()
        clients = f"http://127.0.0.1:{self.etcd_port},{self.etcd_endpoint}"
        url_p = f"http://127.0.0.1:{peer}"
        with open(data_dir / "etcd.log", "ab") as log:
            self._etcd = subprocess.Popen(
                [etcd_binary(), "--enable-v2", "--name", "lab", "--data-dir", str(data_dir / "member"),
                 "--listen-client-urls", clients, "--advertise-client-urls", self.etcd_endpoint,
                 "--listen-peer-urls", url_p, "--initial-advertise-peer-urls", url_p,
                 "--initial-cluster", f"lab={url_p}", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if not wait_until(lambda: etcd_healthy(self.etcd_endpoint, timeout=0.5), timeout, 0.1):
            raise RuntimeError(f"etcd did not answer at {self.etcd_endpoint} within {timeout}s")
        return self.etcd_endpoint

    def close(self) -> list[str]:
        """Stop etcd and remove whatever `build` made; returns what could not be removed (for a test to
        report), never raises, so it is safe in a finalizer after any failure."""
        problems: list[str] = []
        if "netns" in self._made:  # anything still running in the namespace (ours: nobody else's is there)
            pids = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True,
                                  timeout=30).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self._etcd is not None:
            self._etcd.kill()
            self._etcd.wait(timeout=10)
            self._etcd = None
        for kind, args in (("veth", ["link", "del", self.host_if]), ("bridge", ["link", "del", self.bridge]),
                           ("netns", ["netns", "del", self.ns])):
            if kind not in self._made:
                continue
            try:
                ip(*args)
            except subprocess.CalledProcessError as e:
                if "Cannot find device" not in e.stderr and "No such file" not in e.stderr:
                    problems.append(f"ip {' '.join(args)}: {e.stderr.strip()}")
        self._made.clear()
        return problems
