"""A small network for partition tests: nodes in their own network namespaces, each linked to the host
by a veth pair on one bridge, and an etcd they reach. Needs root and `ip` (iproute2); no outside network.

    root namespace                                        namespace <slot.ns> (one per slot)
    bridge <br> 10.213.X.1/24  <-- veth <slot.host_if> ====== <slot.ns_if> 10.213.X.(2+i)/24
    etcd on 127.0.0.1:P and 10.213.X.1:P (`start_etcd`),    a node's agent and workers
    or a `TcpForwarder` from 10.213.X.1 to a loopback etcd
    nodes left in the root namespace: host address 10.213.X.1, gloo on the bridge

Why a bridge: `ip link set <slot.host_if> down` (the cut) takes one veth port down, never the bridge, so
every other node keeps its address and gloo its interface while the cut-off node's packets are dropped,
as on a real partition, rather than refused. Every server binds loopback or a lab address, never
0.0.0.0. `close()` kills what runs in the namespaces and removes them, the links and etcd, also after a
failure.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from petctl.io.etcd import etcd_binary, etcd_healthy
from petctl.io.procs import free_port, wait_until


def ip(*args: str, netns: str = "") -> None:
    """One `ip` command (in namespace `netns` when given); raises CalledProcessError with its stderr."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    proc = subprocess.run([*prefix, "ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)


def netns_available() -> str:
    """"" when this machine can build the lab (root, `ip netns`), else why not (a skip reason). Called
    by the fixtures, not at import: collecting the fast tests creates no namespace."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
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


@dataclass(frozen=True)
class Slot:
    """One namespaced node's place on the lab: its namespace, the two ends of its veth, its address."""

    ns: str
    host_if: str  # the root-side end, a port of the bridge: the one the cut takes down
    ns_if: str  # inside the namespace: the node's GLOO_SOCKET_IFNAME
    addr: str  # the node's host address

    def prefix(self) -> list[str]:
        """Prefix a command with this to run it inside the namespace (`ip netns exec` execs: same pid)."""
        return ["ip", "netns", "exec", self.ns]


@dataclass
class NetLab:
    """The namespaces, links and etcd of one test (see the module docstring); `size` namespaced nodes."""

    root: Path
    size: int = 1
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    octet: int = 0
    etcd_port: int = 0
    _etcd: subprocess.Popen | None = None
    _made: list[tuple[str, str]] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"ptb{self.tag}"

    @property
    def slots(self) -> list[Slot]:
        return [Slot(ns=f"ptns{self.tag}{i}", host_if=f"ptv{self.tag}{i}", ns_if=f"ptn{self.tag}{i}",
                     addr=f"10.213.{self.octet}.{2 + i}") for i in range(self.size)]

    @property
    def host_addr(self) -> str:
        """The root namespace's address on the lab (the bridge's): root-namespace nodes' host address,
        and where etcd (or a forwarder to it) listens for the namespaced nodes."""
        return f"10.213.{self.octet}.1"

    @property
    def etcd_endpoint(self) -> str:
        return f"http://{self.host_addr}:{self.etcd_port}"

    def build(self) -> NetLab:
        self.octet = _free_subnet()
        ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for slot in self.slots:
            ip("netns", "add", slot.ns)
            self._made.append(("netns", slot.ns))
            ip("link", "add", slot.host_if, "type", "veth", "peer", "name", slot.ns_if, "netns", slot.ns)
            self._made.append(("link", slot.host_if))
            ip("link", "set", slot.host_if, "master", self.bridge)
            ip("link", "set", slot.host_if, "up")
            ip("addr", "add", f"{slot.addr}/24", "dev", slot.ns_if, netns=slot.ns)
            ip("link", "set", slot.ns_if, "up", netns=slot.ns)
            ip("link", "set", "lo", "up", netns=slot.ns)
        return self

    def cut(self, slot: Slot) -> None:
        """The partition: the node's link goes down; packets to and from it are dropped."""
        ip("link", "set", slot.host_if, "down")

    def heal(self, slot: Slot) -> None:
        ip("link", "set", slot.host_if, "up")

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
        """Kill what still runs in the namespaces, stop etcd, remove whatever `build` made; returns what
        could not be removed (for a test to report). Never raises: safe in a finalizer after any failure."""
        problems: list[str] = []
        for kind, name in self._made:
            if kind == "netns":  # whatever runs there is ours: nobody else's is in a namespace we made
                _kill_all_in(name)
        if self._etcd is not None:
            self._etcd.kill()
            self._etcd.wait(timeout=10)
            self._etcd = None
        for kind, name in reversed(self._made):
            args = ["link", "del", name] if kind == "link" else ["netns", "del", name]
            try:
                ip(*args)
            except subprocess.CalledProcessError as e:
                if "Cannot find device" not in e.stderr and "No such file" not in e.stderr:
                    problems.append(f"ip {' '.join(args)}: {e.stderr.strip()}")
        self._made.clear()
        return problems


def _kill_all_in(netns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30).stdout
    for pid in pids.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


class TcpForwarder:
    """Forwards connections made to `listen` (a lab address) to `target` (a loopback server): how the
    namespaced nodes reach an etcd that listens on 127.0.0.1 only (the local provider's). Threads, no
    buffering beyond the sockets'; `close()` drops every connection."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.target = target
        self._server = socket.create_server(listen)
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="lab-forward", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:  # the target is down: the client sees its connection closed, as with no server
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(src, dst), name="lab-pump", daemon=True).start()

    def close(self) -> None:
        self._server.close()
        with self._lock:
            for sock in self._open:
                sock.close()
            self._open.clear()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy until either side ends; then end both (a half-open pair would hang the other pump)."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:  # reset, or closed by close(): the same end for a forwarder
        pass
    for sock in (src, dst):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed
            pass
