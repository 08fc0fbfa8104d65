"""The default boot (no image): the Deep Learning AMI, the wheel of the launching petctl, the job's
requirements, and the platform check of the --image path. Pure functions and rendered text here; the
boot script runs for real on a fake AMI in test_e2e_emulated.py and below (one boot, no AWS)."""

from __future__ import annotations

import ast
import io
import json
import re
import zipfile
from pathlib import Path

import pytest

from petctl.core.errors import ValidationError
from petctl.providers.aws import boot
from petctl.providers.aws.boot import (
    MAX_USER_DATA,
    USER_DATA_ROOM,
    AmiBoot,
    worker_boot_script,
    worker_user_data,
)
from tests.support.aws.boot import SECRET_MARKERS, agent_config, bash_syntax_ok

REPO = Path(__file__).resolve().parents[2]
WHEEL_URL = "s3://b/jobs/demo/wheelhouse/petctl-0.1.0+abcdef012345-py3-none-any.whl"


def ami_script(requirements: bool = True, **job):
    """The default (Deep Learning AMI) worker's boot script, as shipped to the job's prefix."""
    boot = AmiBoot(wheel_url=WHEEL_URL,
                   requirements_url="s3://b/jobs/demo/wheelhouse/requirements.txt" if requirements else "")
    return worker_boot_script(agent_config(**job), image="", log_group="/petctl/petctl",
                              config_url="s3://b/jobs/demo/agent.json", ami_boot=boot)


def ami_worker(requirements: bool = True, **job) -> str:
    return ami_script(requirements, **job).text


def setup_keyword(name: str):
    tree = ast.parse((REPO / "setup.py").read_text())
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"]
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == name))


# --- the boot script ------------------------------------------------------------------------------------
def test_ami_boot_installs_the_wheel_and_requirements_with_the_amis_torch_pinned(tmp_path):
    text = ami_worker()
    bash_syntax_ok(text, tmp_path)
    assert not [m for m in SECRET_MARKERS if m in text]
    assert "docker" not in text.replace("`docker stop`", "")  # no container, no daemon, no registry
    assert f"aws s3 cp --only-show-errors {WHEEL_URL} " in text
    assert "s3://b/jobs/demo/wheelhouse/requirements.txt" in text
    assert 'echo "torch==$torch" > "$house/constraints.txt"' in text
    wheel = r'"\$house/petctl-0\.1\.0\+abcdef012345-py3-none-any\.whl"'
    assert re.search(r'"\$PY" -m pip install .*\\\n\s*-c "\$house/constraints.txt" ' + wheel
                     + r' -r "\$house/requirements.txt"', text)
    assert 'PY="$ROOT/opt/pytorch/bin/python"' in text
    assert "retry 3 10 install_petctl || fatal" in text
    # the install warms the agent's start-up caches as root: its exit status is the install's
    install = text[text.index("install_petctl() {"):]
    install = install[:install.index("\n}\n")]
    assert install.rstrip().endswith('"$PY" -m petctl.agent.main --warm >/dev/null')


# The longest bucket name S3 allows: what the stub embeds besides the key and checksum.
LONGEST_BUCKET = "b" * 63


@pytest.mark.parametrize("how", ["ami", "image"])
def test_the_user_data_is_a_stub_that_leaves_most_of_ec2s_16_kb_whatever_the_job(how):
    """Issue 44.8: the boot script (the job's config, arguments and environment in it) goes to the job's
    prefix, and the user data only fetches it: at least USER_DATA_ROOM (10 KB) of EC2's 16 KB stays unused,
    and a job's arguments and environment do not change the user data's size at all."""
    from tests.support.aws.boot import IMAGE

    def script(**job):
        if how == "ami":
            return ami_script(**job)
        return worker_boot_script(agent_config(**job), image=IMAGE, log_group="/petctl/petctl",
                                  config_url="s3://b/jobs/demo/agent.json")

    small, big = script(), script(env={"PAYLOAD": "x" * 64 * 1024})
    stub, stub_big = worker_user_data(small, LONGEST_BUCKET), worker_user_data(big, LONGEST_BUCKET)
    room = MAX_USER_DATA - len(stub.encode())
    assert USER_DATA_ROOM >= 10 * 1024
    assert room >= USER_DATA_ROOM, (f"the user data stub leaves {room} bytes of EC2's 16 KB, under "
                                    f"{USER_DATA_ROOM}: keep what grows in the boot script, not in the stub")
    assert len(stub_big.encode()) == len(stub.encode())  # only the checksum and key differ
    assert "PAYLOAD" not in stub_big and "PAYLOAD" in big.text and len(big.text) > 64 * 1024


def test_the_stub_fetches_its_script_with_the_instance_role_and_runs_it_only_if_the_checksum_matches(
        tmp_path):
    """What the user data does: IMDSv2 for the region, a signed GET (no AWS CLI: the ECS GPU AMI has none)
    of the script's key in the job's prefix, sha256sum -c against the checksum it pins, then exec. No
    secret in it, and nothing that would print the role's credentials."""
    script = ami_script()
    stub = worker_user_data(script, "petctl-bucket-abc")
    bash_syntax_ok(stub, tmp_path)
    assert script.key.startswith("jobs/demo/boot-") and script.key.endswith(".sh")
    assert f"KEY={script.key}\n" in stub and f"SHA256={script.sha256}\n" in stub
    assert "BUCKET=petctl-bucket-abc\n" in stub
    assert 's3_call GET "$KEY"' in stub and 'sha256sum -c --quiet -' in stub
    assert stub.rstrip().endswith('exec bash "$SCRIPT"')
    assert 'fatal "no verified boot script' in stub
    assert "aws s3" not in stub and "set -x" not in stub
    assert not [m for m in SECRET_MARKERS if m in stub]
    assert "PETCTL_AGENT_CONFIG" not in stub  # the config is in the script, not the user data


@pytest.mark.parametrize("tampered", [False, True])
def test_the_stub_runs_the_script_it_fetched_only_when_its_checksum_matches(tmp_path, tampered):
    """The stub run for real (tests/support/aws/boot_harness.py: IMDSv2, the role's credentials and the
    bucket faked behind curl): it signs a GET of its key, runs what it got when the SHA-256 matches, and
    otherwise never runs it: it retries, then `fatal` marks the instance Unhealthy for its group."""
    from petctl.providers.aws.etcdbin import BootScript
    from tests.support.aws.boot_harness import CREDS, Boot

    boot = Boot(tmp_path)
    script = BootScript('echo "ran the fetched script as $0"\n', prefix="jobs/demo")
    stored = boot.s3 / script.key
    stored.parent.mkdir(parents=True)
    stored.write_text(script.text.replace("ran", "RAN") if tampered else script.text)
    result = boot.run(worker_user_data(script, "petctl-bucket"), timeout=60)
    gets = [c for c in boot.calls("curl") if c["url"].endswith("/" + script.key)]
    host = "https://petctl-bucket.s3.us-west-2.amazonaws.com/"
    assert gets and all(c["url"].startswith(host) for c in gets)
    assert any(h.startswith("Authorization: AWS4-HMAC-SHA256 Credential=" + CREDS["AccessKeyId"])
               for h in gets[0]["headers"])
    output = result.stdout + result.stderr
    assert CREDS["SecretAccessKey"] not in output and CREDS["Token"] not in output
    if not tampered:
        assert result.returncode == 0 and "ran the fetched script as " in result.stdout
        assert len(gets) == 1 and not boot.unhealthy_calls()
    else:
        assert "ran the fetched script" not in output and "RAN" not in output
        assert len(gets) == 8 and "no verified boot script at s3://petctl-bucket/" + script.key in output
        assert boot.unhealthy_calls() and result.returncode == 1


def test_ami_boot_without_requirements_installs_only_petctl():
    text = ami_worker(requirements=False)
    assert "requirements.txt" not in text


def test_ami_agent_unit_keeps_the_restart_and_onfailure_contract_without_docker():
    from tests.support.aws.boot import unit_section

    unit = unit_section(ami_worker(), "petctl-agent.service")
    assert unit["ExecStart"] == ["/opt/pytorch/bin/python -m petctl.agent.main --config "
                                 "/etc/petctl/agent.json --node-id ${INSTANCE_ID} --host-addr ${PRIVATE_IP}"]
    assert unit["Restart"] == ["on-failure"] and unit["RestartPreventExitStatus"] == ["70"]
    assert unit["OnFailure"] == ["petctl-unhealthy.service"]
    assert (unit["StartLimitIntervalSec"], unit["StartLimitBurst"]) == (["600"], ["3"])
    assert unit["KillMode"] == ["mixed"]  # SIGTERM to the agent alone, as `docker stop` did
    assert unit["TimeoutStopSec"] == ["60"] and unit["User"] == ["petctl"]  # unprivileged, like uid 1000
    assert unit["LimitMEMLOCK"] == ["infinity"]


def test_a_worker_boots_either_an_image_or_the_ami():
    with pytest.raises(ValueError, match="either an image"):
        worker_boot_script(agent_config(), image="", log_group="/l", config_url="s3://b/a.json")


# --- the wheel ------------------------------------------------------------------------------------------
def test_the_wheel_is_this_petctl_reproducibly_with_setup_pys_requirements_and_scripts():
    first, again = boot.build_wheel(), boot.build_wheel()
    assert first.data == again.data  # the same code makes the same bytes, hence the same version label
    assert re.fullmatch(r"petctl-0\.1\.0\+[0-9a-f]{12}-py3-none-any\.whl", first.name)
    archive = zipfile.ZipFile(io.BytesIO(first.data))
    names = set(archive.namelist())
    assert {"petctl/agent/main.py", "petctl/elastic/__init__.py", "petctl/_templates/cfn/job.yaml.j2",
            "petctl/_templates/worker_image/worker_boot.sh.j2"} <= names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    info = f"petctl-{first.version}.dist-info"
    metadata = archive.read(f"{info}/METADATA").decode().splitlines()
    requires = [line.split(": ", 1)[1] for line in metadata if line.startswith("Requires-Dist: ")]
    assert requires == setup_keyword("install_requires")  # and no torch: the AMI's CUDA build stays
    scripts = archive.read(f"{info}/entry_points.txt").decode()
    for line in setup_keyword("entry_points")["console_scripts"]:
        name, target = (part.strip() for part in line.split("="))
        assert f"{name} = {target}" in scripts
    record = archive.read(f"{info}/RECORD").decode()
    assert "petctl/agent/main.py,sha256=" in record


@pytest.mark.parametrize("text, message", [
    ("-e .\n", "line 1"), ("./mypkg\n", "line 1"), ("-r other.txt\n", "line 1"),
    ("einops\npkg @ file:///home/me/pkg\n", "line 2"), ("torch==2.4\n", "torch comes from the Deep Learning"),
    ("torchvision\nTorch>=2\n", "line 2: torch"),
])
def test_requirements_that_the_instance_cannot_install_are_refused_in_one_line(tmp_path, text, message):
    path = tmp_path / "requirements.txt"
    path.write_text(text)
    with pytest.raises(ValidationError, match=message) as caught:
        boot.read_requirements(path)
    assert "\n" not in str(caught.value)


def test_requirements_that_pip_can_fetch_are_kept(tmp_path):
    text = ("# comment\neinops>=0.7  # why\nnumpy<3; python_version >= '3.10'\nhf-xet[extra]==1.0\n"
            "--extra-index-url https://download.example.org/simple\npkg @ https://example.org/pkg.whl\n")
    path = tmp_path / "requirements.txt"
    path.write_text(text)
    assert boot.read_requirements(path) == text
    assert boot.read_requirements(None) == ""
    with pytest.raises(ValidationError, match="no such file"):
        boot.read_requirements(tmp_path / "missing.txt")


# --- the AMI and its torch ------------------------------------------------------------------------------
def test_dlami_names_say_which_torch_and_cuda_a_job_gets():
    assert boot.DLAMI_PARAM == ("/aws/service/deeplearning/ami/x86_64/oss-nvidia-driver-gpu-pytorch-2.13-"
                                "amazon-linux-2023/latest/ami-id")
    name = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.13 (Amazon Linux 2023) 20261003"
    assert boot.describe(name, "Supported EC2 instances: G5. PyTorch-2.13, CUDA version 13.0") == ("2.13",
                                                                                               "13.0")
    assert boot.describe(name, "") == ("2.13", "")
    assert boot.describe("my-ami", "nvidia_cuda_stack /usr/local/cuda-12.6") == ("", "12.6")
    assert [boot.torch_supported(v) for v in ("2.4.1", "2.5.0", "2.13", "3.0", "x")] == [
        False, True, True, False, None]


def test_the_declared_torch_range_is_setup_pys_and_holds_the_default_amis_and_the_images_torch():
    torch_specs = set(re.findall(r'"(torch[<>=!~][^"]*)"', (REPO / "setup.py").read_text()))
    assert torch_specs == {f"torch{boot.TORCH_RANGE}"}, torch_specs
    assert boot.torch_supported(boot.DLAMI_TORCH)  # the default AMI's torch, and the tested one (CI)
    dockerfile = (REPO / "worker_image" / "Dockerfile").read_text()
    image_torch = re.search(r"^FROM pytorch/pytorch:(\d+\.\d+\.\d+)-", dockerfile, re.M).group(1)
    assert boot.torch_supported(image_torch), image_torch  # the --image example's base


# --- the --image platform -------------------------------------------------------------------------------
def test_an_image_index_offers_its_platforms_and_attestations_are_not_platforms():
    index = {"manifests": [{"platform": {"os": "linux", "architecture": "arm64"}},
                           {"platform": {"os": "unknown", "architecture": "unknown"}}]}
    assert boot.platforms(index, lambda digest: None) == {"linux/arm64"}
    reason = boot.verdict("r:1", {"linux/arm64"})
    assert "built for linux/arm64, not linux/amd64" in reason and "--platform linux/amd64" in reason


def test_a_single_manifest_is_judged_by_its_config_and_unknown_is_refused():
    manifest = {"schemaVersion": 2, "config": {"digest": "sha256:" + "a" * 64}}
    configs = {"sha256:" + "a" * 64: {"os": "linux", "architecture": "amd64"}}
    assert boot.platforms(manifest, configs.get) == {"linux/amd64"}
    assert boot.verdict("r:1", {"linux/amd64"}) == ""
    assert boot.platforms(manifest, lambda digest: None) == set()
    assert "cannot tell which platform" in boot.verdict("r:1", set())
    assert boot.platforms({"schemaVersion": 1, "architecture": "amd64"}, dict.get) == {"linux/amd64"}


def test_a_single_manifest_image_in_ecr_is_checked_through_its_config_blob(moto, tmp_path):
    """The config blob comes from GetDownloadUrlForLayer (moto lacks it: stubbed on the client here)."""
    from tests.support.aws.account import boto

    ecr = boto(moto, "ecr")
    ecr.create_repository(repositoryName="single-arch")
    manifest = {"schemaVersion": 2, "mediaType": boot.MANIFEST_TYPES[1], "layers": [],
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 2,
                           "digest": "sha256:" + "c" * 64}}
    ecr.put_image(repositoryName="single-arch", imageManifest=json.dumps(manifest), imageTag="1")
    image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/single-arch:1"
    ecr.get_download_url_for_layer = lambda **kw: {"downloadUrl": f"https://blob/{kw['layerDigest']}"}
    blobs = {"https://blob/sha256:" + "c" * 64: json.dumps({"os": "linux", "architecture": "arm64"}).encode()}
    with pytest.raises(ValidationError, match="built for linux/arm64"):
        boot.check_image(ecr, image, "us-east-1", fetch=blobs.__getitem__)
    with pytest.raises(ValidationError, match="cannot tell which platform"):
        boot.check_image(ecr, image, "us-east-1", fetch=lambda url: b"not json")
    blobs = {k: json.dumps({"os": "linux", "architecture": "amd64"}).encode() for k in blobs}
    assert boot.check_image(ecr, image, "us-east-1", fetch=blobs.__getitem__) == "linux/amd64"


# --- what DescribeImages says of the AMI (issue 44.6) ----------------------------------------------------
class _Ec2:
    def __init__(self, *images: dict) -> None:
        self.images = list(images)

    def describe_images(self, ImageIds):  # noqa: N803 (boto3's keyword)
        return {"Images": [dict(i, ImageId=ImageIds[0]) for i in self.images]}


DLAMI = {"Name": "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.13 (Amazon Linux 2023) 20261003",
         "Architecture": "x86_64", "RootDeviceType": "ebs", "RootDeviceName": "/dev/xvda",
         "State": "available",
         "BlockDeviceMappings": [{"DeviceName": "/dev/xvda",
                                  "Ebs": {"SnapshotId": "snap-0a", "VolumeSize": 75}}]}
PINNED = {"options": {"worker_ami": "ami-0123456789abcdef0"}}


def test_the_root_volume_is_the_larger_of_the_setting_and_the_amis_snapshot():
    ami = boot.resolve(None, _Ec2(DLAMI), PINNED, container=False)
    assert (ami.root_device, ami.root_snapshot_gb, ami.root_volume_gb(100)) == ("/dev/xvda", 75, 100)
    grown = {**DLAMI, "RootDeviceName": "/dev/sda1", "BlockDeviceMappings": [
        {"DeviceName": "/dev/sdb", "VirtualName": "ephemeral0"},
        {"DeviceName": "/dev/sda1", "Ebs": {"SnapshotId": "snap-0b", "VolumeSize": 140}}]}
    ami = boot.resolve(None, _Ec2(grown), PINNED, container=False)
    assert (ami.root_device, ami.root_volume_gb(100)) == ("/dev/sda1", 140)  # EC2 refuses 100 < 140
    silent = {k: v for k, v in DLAMI.items() if k not in ("BlockDeviceMappings", "RootDeviceName")}
    ami = boot.resolve(None, _Ec2(silent), PINNED, container=False)
    assert (ami.root_device, ami.root_volume_gb(100)) == ("/dev/xvda", 100)  # the fallback


def test_the_job_template_sizes_the_amis_root_device(tmp_path):
    from tests.aws.rendered import ami_job_template, parse

    template = parse(ami_job_template(tmp_path))
    (mapping,) = template["Resources"]["LaunchTemplate"]["Properties"]["LaunchTemplateData"][
        "BlockDeviceMappings"]
    assert mapping["DeviceName"] == "/dev/xvda" and mapping["Ebs"]["VolumeSize"] == 100
    from petctl.providers.aws.launch import JobBoot, render_job_template
    from tests.aws import rendered

    spec = rendered.job_spec("spot-single")
    agent = rendered.AgentConfig(job=spec, node_id="", host_addr="", asg_name="petctl-job-spot-single")
    text = render_job_template(rendered.provider(tmp_path), spec, agent, "s3://b/a.json", None,
                               JobBoot(ami="ami-0a", image=rendered.provider(tmp_path).settings["image"],
                                       root_volume_gb=140, root_device="/dev/sda1"))
    (mapping,) = parse(text)["Resources"]["LaunchTemplate"]["Properties"]["LaunchTemplateData"][
        "BlockDeviceMappings"]
    assert mapping == {"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 140, "VolumeType": "gp3",
                                                         "Encrypted": True, "DeleteOnTermination": True}}


@pytest.mark.parametrize("image, message", [
    (None, "is not visible in this region"),
    ({**DLAMI, "Architecture": "arm64"}, "its architecture is arm64, and petctl launches x86_64"),
    ({**DLAMI, "RootDeviceType": "instance-store"}, "its root device is instance-store"),
    ({**DLAMI, "State": "deregistered"}, "it is deregistered, not available"),
])
def test_an_ami_petctl_cannot_boot_is_refused_in_one_line(image, message):
    from petctl.core.errors import ProviderError

    with pytest.raises(ProviderError, match=message) as caught:
        boot.resolve(None, _Ec2(*([image] if image else [])), PINNED, container=False)
    assert "\n" not in str(caught.value) and "worker_ami=" in str(caught.value)
