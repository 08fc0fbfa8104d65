"""EC2 user data for petctl's instances: small, secret-free boot scripts rendered from `worker_image/`.

A worker's user data embeds the job's agent config; what only the instance knows (its id and private
address) is read from IMDSv2 at boot and passed to the agent as `--node-id`/`--host-addr`. The same config
is stored at the job's S3 prefix (`agent.json`), so the user data is never the only copy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from petctl.core.spec import AgentConfig

if TYPE_CHECKING:
    from petctl.providers.aws.etcdbin import BootScript, EtcdArtifact
    from petctl.providers.aws.network import EtcdMember, NetworkPlan

CONFIG_MARKER = "PETCTL_AGENT_CONFIG"
# Keep the user data below EC2's 16 KB limit (with room to spare) so a long argument list is refused here
# with a clear message rather than by a failed launch.
MAX_USER_DATA = 14 * 1024

ETCD_VERSION = "3.5"  # etcd 3.6 removed the v2 API python-etcd speaks (the release: etcdbin.RELEASES)
BUCKET_PLACEHOLDER = "@@PETCTL_BUCKET@@"
WORKER_IMDS = "http://169.254.169.254"


@dataclass(frozen=True)
class AmiBoot:
    """What a default-path (Deep Learning AMI) instance installs: the launching petctl's wheel and the
    job's requirements, both in the job's S3 prefix (wheelhouse.py), into the AMI's Python."""

    wheel_url: str  # s3://<bucket>/jobs/<job>/wheelhouse/petctl-<version>-py3-none-any.whl
    requirements_url: str = ""  # s3://.../wheelhouse/requirements.txt, or "" for none
    python_bin: str = "/opt/pytorch/bin"


def worker_user_data(config: AgentConfig, image: str, log_group: str, config_url: str,
                     gpus: bool = True, ami_boot: AmiBoot | None = None) -> str:
    """The worker's boot script: with `image`, the agent runs in that container, which logs to
    `log_group`, stream `<job>/<instance id>` (the job's role may write only its own streams); without,
    `ami_boot` says what the instance installs and the agent runs on the AMI's Python under systemd.
    Raises ValidationError when it is too big."""
    from petctl.core.errors import ValidationError
    from petctl.providers.aws.boots import boot_settings
    from petctl.providers.aws.jobscope import log_stream_prefix
    from petctl.providers.aws.templates import compact_shell, render_boot

    if not image and ami_boot is None:
        raise ValueError("a worker boots either an image or the AMI's Python with petctl's wheel")
    ami = ami_boot or AmiBoot(wheel_url="")
    text = compact_shell(render_boot(
        "worker_boot.sh.j2", agent_config=config.to_json(), image=image, log_group=log_group,
        config_url=config_url, gpus=gpus, boot=boot_settings(config),
        log_stream_prefix=log_stream_prefix(config.job.name),
        wheel_url=ami.wheel_url, wheel_name=ami.wheel_url.rsplit("/", 1)[-1],
        requirements_url=ami.requirements_url, python_bin=ami.python_bin))
    if len(text.encode()) > MAX_USER_DATA:
        raise ValidationError(f"the job's boot script is {len(text.encode())} bytes (limit {MAX_USER_DATA}): "
                              "shorten the job's arguments or environment")
    return text


def etcd_user_data(stack_name: str, etcd_ip: str, etcd_key: str, etcd_sha256: str,
                   etcd_version: str = ETCD_VERSION, etcdctl_key: str = "", etcdctl_sha256: str = "") -> str:
    """The single etcd host's boot script. Like the cluster members' it is shipped through the bucket
    (its user data is a stub, see etcd_member_stub: with etcd's TLS and auth it no longer fits EC2's
    16 KB), and it reads the bucket's name from PETCTL_BUCKET, which the stub sets."""
    from petctl.providers.aws.etcdsecrets import USERS_INDEX, prefix
    from petctl.providers.aws.templates import render_boot

    return render_boot("etcd_boot.sh.j2", stack_name=stack_name, etcd_ip=etcd_ip, etcd_version=etcd_version,
                       etcd_sha256=etcd_sha256, etcd_key=etcd_key, members=[],
                       etcdctl_key=etcdctl_key or etcd_key.rsplit("/", 1)[0] + "/etcdctl",
                       etcdctl_sha256=etcdctl_sha256, secret_prefix=prefix(stack_name),
                       users_index=USERS_INDEX)


def etcd_hosts(stack_name: str, plan: NetworkPlan, etcd: EtcdArtifact) -> tuple[list[dict], BootScript]:
    """What the base template needs per etcd member (logical-id suffix, name, address, subnet, group name,
    user data: a stub that fetches the boot script), and the boot script setup must ship to the bucket.
    Member 0 keeps the single host's logical ids and group name."""
    from petctl.providers.aws.etcdbin import BootScript

    members = plan.etcd_members
    if plan.etcd_cluster:
        script = BootScript(etcd_member_script(stack_name, members, etcd))
    else:
        script = BootScript(etcd_user_data(stack_name, members[0].ip, etcd.key, etcd.sha256, etcd.version,
                                           etcd.ctl_key, etcd.ctl_sha256))
    hosts = []
    for i, m in enumerate(members):
        data = etcd_member_stub(i, script)
        hosts.append({"suffix": str(i) if i else "", "name": m.name, "ip": m.ip, "subnet": m.subnet,
                      "group": f"{stack_name}-etcd" + (f"-{i}" if i else ""), "user_data": data})
    return hosts, script


def etcd_member_script(stack_name: str, members: Sequence[EtcdMember], etcd: EtcdArtifact) -> str:
    """The boot script shared by the members of a 3-member etcd cluster (shipped through the bucket, see
    etcdbin.py): the member's user data says which member it is (PETCTL_ETCD_MEMBER) and where the
    bucket is (PETCTL_BUCKET)."""
    from petctl.providers.aws.etcdsecrets import USERS_INDEX, prefix
    from petctl.providers.aws.templates import render_boot

    cluster = ",".join(f"{m.name}={m.peer_url}" for m in members)
    return render_boot("etcd_boot.sh.j2", stack_name=stack_name, members=list(members), etcd_cluster=cluster,
                       etcd_version=etcd.version, etcd_sha256=etcd.sha256, etcd_key=etcd.key,
                       etcdctl_key=etcd.ctl_key, etcdctl_sha256=etcd.ctl_sha256,
                       secret_prefix=prefix(stack_name), users_index=USERS_INDEX)


def etcd_member_stub(index: int, script: BootScript) -> str:
    """Member `index`'s user data: fetch the members' boot script from the bucket, check its pinned
    checksum, run it. BUCKET_PLACEHOLDER stands where the template joins in the bucket's name."""
    from petctl.providers.aws.templates import render_boot

    return render_boot("etcd_member_stub.sh.j2", member=index, script_key=script.key,
                       script_sha256=script.sha256, bucket=BUCKET_PLACEHOLDER)


def agent_config_from_user_data(text: str) -> AgentConfig:
    """The agent config a worker's boot script writes (identity left blank; for tests and emulators)."""
    match = re.search(rf"<<'{CONFIG_MARKER}'\n(.*?)\n{CONFIG_MARKER}\n", text, re.S)
    if not match:
        raise ValueError("no petctl agent config in this user data")
    json.loads(match.group(1))  # must be one JSON document
    return AgentConfig.from_json(match.group(1))
