"""Specs that travel between the CLI, the providers and the agent.

They are plain dataclasses serialised as JSON so that the same spec can be written to etcd, to S3, into EC2
user data or onto a local file, and read back by an agent that has neither boto3 nor torch loaded.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petctl.core.errors import ValidationError
from petctl.core.store import BACKENDS, JOB_DEFAULT_BACKEND

JOB_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$")
# AWS recommends price-capacity-optimized for spot: pools least likely to be interrupted, and of those the
# cheapest. capacity-optimized (least interruption, price ignored) stays selectable.
SPOT_STRATEGIES = ("price-capacity-optimized", "capacity-optimized")
# `run_job` options only some providers honour (each declares which in `Provider.run_options`):
# option name -> the flag users type, which is what a message names.
PROVIDER_OPTIONS: dict[str, str] = {
    "replace_delay": "--replace-delay",
    "instance_types": "--instance-type",
    "on_demand": "--on-demand",
    "on_demand_base": "--on-demand-base",
    "spot_strategy": "--spot-strategy",
    "multi_az": "--multi-az",
    "image": "--image",
    "requirements": "--requirements",
}


def _from_dict(cls: type, data: dict[str, Any]):
    """Build a dataclass from a dict, ignoring unknown keys so newer writers don't break older readers."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Timeouts:
    """Agent timing knobs. Defaults favour fast recovery on a LAN; tests shrink them further."""

    heartbeat_interval: float = 0.2  # seconds between TTL refreshes of a node's liveness key
    # A member whose key no refresh reached for this long, while the refreshes of the member watching it
    # got through, is dropped by that member (agent/liveness.py): a frozen or cut-off host in about 1.2 s.
    # Never less than 4 refresh intervals; at or above heartbeat_ttl, only the TTL drops nodes.
    peer_silence: float = 1.0
    heartbeat_ttl: float = 3.0  # etcd expires a key not refreshed this long: where no member watches it
    last_call: float = 1.0  # once `min` nodes joined, wait this long for stragglers still alive
    initial_wait: float = 30.0  # the first round waits up to this long for `size` nodes (job start)
    join_timeout: float = 600.0  # fewer than `min` nodes for this long -> the job fails
    stop_grace: float = 5.0  # SIGTERM -> SIGKILL grace when stopping workers
    # The longest a save-now request gives the workers to save: a notice's (less a margin before the reclaim,
    # agent/notices.py `save_budget`) and a planned admission's (agent/roundjudge.py `admission`).
    save_deadline: float = 90.0
    # Once any rank of the job exited 0, the others get this long to exit too; stragglers (seen stuck in
    # destroy_process_group after their peers left) are then stopped and the job still succeeds.
    finish_grace: float = 60.0
    # The hang watchdog: a round whose workers all run but made no progress (a `train.step` line or
    # another event of theirs) this long is a fault, restarted like a failure. 0: the default, 300 s for
    # a script that reports progress and none for one that does not (agent/roundjudge.py `hang_limit`).
    hang: float = 0.0
    # Metadata polling period: three local HTTP GETs per pass (spot, ASG, rebalance). AWS suggests every
    # 5 s; IMDS is link-local and cheap, and each second of detection is a second of every recovery.
    imds_interval: float = 0.5
    # AWS: from an instance's launch to its agent registered in the rendezvous. The job's launch lifecycle
    # hook times out after this long and abandons the instance (terminated), and a boot that neither
    # joined nor failed by then counts as never joined for the boot breaker (petctl/core/boots.py).
    # 15 minutes: a Deep Learning AMI's first boot (1-3 min: a 100 GB root volume restored lazily from
    # its snapshot), the pip install of petctl and the job's requirements (1-5 min), the agent's start and
    # join (seconds), with about twice that as margin. AWS allows 30-7200 s (the hook's HeartbeatTimeout).
    boot_timeout: float = 900.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeouts:
        return _from_dict(cls, data)


@dataclass
class JobSpec:
    """Everything needed to run one job, independent of where its capacity comes from."""

    name: str
    min_size: int
    max_size: int
    size: int
    entrypoint: str  # script path relative to the job's code dir
    args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    max_restarts: int = 3
    checkpoint_url: str = ""  # s3://bucket/jobs/<job>/checkpoints or file:///.../checkpoints
    code_url: str = ""  # where the agent fetches the script from (s3://... or file://...)
    etcd_endpoint: str = ""  # http://host:port, or https://host:port (client certificates required)
    # Where the job's agents find their etcd client certificate (not the secret itself): "" (none),
    # file:///dir or a Secrets Manager secret's ARN. See petctl/io/etcdpki.py.
    etcd_credentials: str = ""
    # Which of etcd's APIs the job's agents, its reconciler and its readers use (petctl/core/store.py):
    # "v2" or "v3". etcd 3.5 keeps the two keyspaces apart, so all of them must agree.
    etcd_store: str = JOB_DEFAULT_BACKEND
    env: dict[str, str] = field(default_factory=dict)
    warm_workers: bool = True  # keep workers with torch imported ready for the next restart
    warm_imports: list[str] = field(default_factory=list)  # more modules for warm workers to preload
    keep: bool = False  # keep the capacity after the job ends (debugging); default: released by itself
    timeouts: Timeouts = field(default_factory=Timeouts)
    # AWS-only knobs; ignored by the local provider.
    instance_types: list[str] = field(default_factory=list)
    on_demand: bool = False
    on_demand_base: int = 0
    spot_strategy: str = SPOT_STRATEGIES[0]  # mixed spot groups; or capacity-optimized
    multi_az: bool = False  # spread over every AZ (cross-AZ all-reduce is billed per GB; see docs/aws.md)

    def validate(self) -> None:
        """Reject bad input before any side effect, with one message a user can act on."""
        if not JOB_NAME_RE.match(self.name):
            raise ValidationError(
                f"invalid job name {self.name!r}: use 2-32 lowercase letters, digits and '-', "
                "starting with a letter"
            )
        if self.min_size < 1:
            raise ValidationError(f"--min must be >= 1 (got {self.min_size})")
        if self.min_size > self.max_size:
            raise ValidationError(f"--min ({self.min_size}) is greater than --max ({self.max_size})")
        if not self.min_size <= self.size <= self.max_size:
            raise ValidationError(
                f"--size {self.size} is outside [--min {self.min_size}, --max {self.max_size}]"
            )
        if self.nproc_per_node < 1:
            raise ValidationError(f"--nproc-per-node must be >= 1 (got {self.nproc_per_node})")
        if self.max_restarts < 0:
            raise ValidationError(f"--max-restarts must be >= 0 (got {self.max_restarts})")
        if self.etcd_store not in BACKENDS:
            raise ValidationError(f"unknown etcd store {self.etcd_store!r}: use {' or '.join(BACKENDS)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSpec:
        data = dict(data)
        data["timeouts"] = Timeouts.from_dict(data.get("timeouts") or {})
        return _from_dict(cls, data)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return cls.from_dict(json.loads(text))


@dataclass
class JobSubmission:
    """A job as submitted to a provider: its spec, its code, and the options that live outside the spec.

    `validate()` is the one validation of a submission: the CLI runs it before it touches anything, and
    every provider runs it again before its first side effect, so bad input gets the same one-line
    message whoever submits the job (the CLI, a test, a library caller).
    """

    spec: JobSpec
    script: Path  # a file to run, or a directory whose `spec.entrypoint` is run
    replace_delay: float | None = None  # local: a replacement's boot, launch to agent start (billed)
    image: str = ""  # aws: run the agent in this container image instead of on the Deep Learning AMI
    requirements: Path | None = None  # aws: a pip requirements file the instances install

    def options_set(self) -> list[str]:
        """The provider-specific options (`PROVIDER_OPTIONS`) this submission sets to non-default values."""
        defaults = JobSpec(name="", min_size=0, max_size=0, size=0, entrypoint="")
        names = [name for name in PROVIDER_OPTIONS
                 if hasattr(defaults, name) and getattr(self.spec, name) != getattr(defaults, name)]
        names += [name for name in ("replace_delay", "image", "requirements")
                  if getattr(self, name) not in (None, "")]
        return sorted(names, key=list(PROVIDER_OPTIONS).index)

    def validate(self, provider: str = "", accepts: Collection[str] | None = None) -> JobSubmission:
        """Check the spec, the script and the options; settle `spec.entrypoint`; return self.

        `accepts`: the provider-specific options `provider` honours (None: not checked yet, as when the
        CLI validates before it knows the provider). Raises ValidationError with one line a user can act
        on; idempotent, so a provider may validate a submission the CLI already validated.
        """
        self.spec.validate()
        self.script = Path(self.script)
        self._settle_entrypoint()
        if self.replace_delay is not None and self.replace_delay < 0:
            raise ValidationError(f"--replace-delay must be >= 0 (got {self.replace_delay})")
        if self.spec.spot_strategy not in SPOT_STRATEGIES:
            raise ValidationError(f"unknown spot allocation strategy {self.spec.spot_strategy!r}: choose "
                                  f"{' or '.join(SPOT_STRATEGIES)}")
        if not 0 <= self.spec.on_demand_base <= self.spec.max_size:
            raise ValidationError(f"--on-demand-base {self.spec.on_demand_base} is outside "
                                  f"[0, --max {self.spec.max_size}]")
        if accepts is not None:
            unsupported = [name for name in self.options_set() if name not in accepts]
            if unsupported:
                flags = ", ".join(PROVIDER_OPTIONS[name] for name in unsupported)
                raise ValidationError(f"{flags} {'is' if len(unsupported) == 1 else 'are'} not supported by "
                                      f"the {provider} provider")
        return self

    def _settle_entrypoint(self) -> None:
        script, entrypoint = self.script, self.spec.entrypoint
        if not script.exists():
            raise ValidationError(f"script not found: {script}")
        if script.is_dir():
            if not entrypoint:
                raise ValidationError(f"{script} is a directory: name the file to run with --entrypoint")
            if not (script / entrypoint).is_file():
                raise ValidationError(f"entrypoint {entrypoint!r} not found in {script}")
        elif entrypoint and entrypoint != script.name:
            raise ValidationError("--entrypoint is only for a directory SCRIPT")
        else:
            self.spec.entrypoint = script.name


@dataclass
class AgentConfig:
    """What one agent needs at boot: the job, who it is, and where its instance's services live."""

    job: JobSpec
    node_id: str  # unique per instance (EC2 instance id, or i-local-<n>)
    host_addr: str = "127.0.0.1"  # address other nodes use to reach this one (MASTER_ADDR)
    work_dir: str = ""  # where the code is unpacked and workers run
    imds_endpoint: str = ""  # instance metadata service; "" disables the preemption watcher
    asg_name: str = ""  # for completing the termination lifecycle action on AWS
    lifecycle_hook: str = ""
    launch_hook: str = ""  # AWS: the launch lifecycle hook the agent completes once it joined
    region: str = ""
    status_url: str = ""  # optional s3://... or file://... prefix the agent mirrors status/events/logs to

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AgentConfig:
        data = json.loads(text)
        data["job"] = JobSpec.from_dict(data["job"])
        return _from_dict(cls, data)
