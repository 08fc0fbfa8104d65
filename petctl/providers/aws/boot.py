"""What petctl's instances boot: the AMI, what a worker runs on it (petctl's own wheel, or the job's
container image), and the boot scripts EC2 runs as user data, small and secret-free.

A worker boots one of two ways. By default the AWS Deep Learning AMI for PyTorch (GPU, Amazon Linux
2023), whose `/opt/pytorch` Python already has a CUDA torch, installs the petctl that launched the job and
the job's `--requirements FILE`: no image to build. AWS publishes each DLAMI line's current ID as a public
SSM parameter; the line is named by its PyTorch version, so the torch a job gets is pinned here
(DLAMI_TORCH, one line to bump) and checked against the range setup.py declares. With `--image` the job's
container runs on the ECS-optimized GPU AMI, which has Docker and the NVIDIA container toolkit; the
image's torch is the job's. A `worker_ami` setup option overrides both AMIs.

The wheel is built here, in pure Python and offline, from the very modules this CLI runs (a checkout, an
editable or a wheel install alike): an instance never runs a petctl other than the one that started it,
whether or not that version was ever published. Its version carries a local label, the hash of its
contents (`0.1.0+<12 hex>`), so pip never mistakes it for another build of the same version. It and the
requirements go to the job's S3 prefix (`wheelhouse/`), which only the job's own role may read. petctl's
own dependencies are not in the wheelhouse: on the instance pip keeps what the AMI's Python already has
when it satisfies setup.py's ranges and fetches the rest from the package index, which is why the default
path needs public subnets (launch.py refuses `subnets=private` in one line: use --image there).

An `--image` must be in this region's ECR and built for linux/amd64, checked before any instance launches
(an arm64 image, as `docker build` makes on Apple silicon without --platform, would fail on every GPU
instance the group starts). The platform is read the way a registry client does: an image index (OCI) or
manifest list (Docker) names each manifest's platform; a single manifest's platform is in its config
blob, fetched through ECR's GetDownloadUrlForLayer. What cannot be read is refused, never guessed.

The boot scripts are rendered from `worker_image/` and shipped through the bucket; every instance's user
data is a stub that fetches its script with the instance role and checks the SHA-256 the stub pins. The
etcd hosts' script is in `dist/etcd/` (with etcd's TLS and auth it no longer fits EC2's 16 KB); a worker's
is in its job's prefix (`jobs/<job>/boot-<sha256 prefix>.sh`), where only the job's role may read it. It
embeds the job's agent config, so a job's arguments and environment are not bounded by user data; what
only the instance knows (its id and private address) is read from IMDSv2 at boot and passed to the agent
as `--node-id`/`--host-addr`. The same config is stored at the job's S3 prefix (`agent.json`).

Facts (AWS DLAMI release notes, "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.13 (Amazon Linux 2023)",
release of 2026-10-03, https://docs.aws.amazon.com/dlami/latest/devguide/ release notes for gpupt213oss
al2023): framework_version 2.13, python_location /opt/pytorch/bin/python, x86_64, NVIDIA driver 595.91.07.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import io
import json
import re
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from petctl.core.errors import ProviderError, ValidationError
from petctl.core.spec import AgentConfig
from petctl.core.store import JOB_DEFAULT_BACKEND, Backend

if TYPE_CHECKING:
    from petctl.providers.aws.etcdbin import BootScript, EtcdArtifact
    from petctl.providers.aws.network import EtcdMember, NetworkPlan

DLAMI_TORCH = "2.13"
DLAMI_PARAM = (f"/aws/service/deeplearning/ami/x86_64/oss-nvidia-driver-gpu-pytorch-{DLAMI_TORCH}"
               "-amazon-linux-2023/latest/ami-id")
CONTAINER_AMI_PARAM = "/aws/service/ecs/optimized-ami/amazon-linux-2023/gpu/recommended/image_id"
AMI_PYTHON = "/opt/pytorch/bin/python"  # the DLAMI's Python, with its CUDA torch
# The torch petctl supports: setup.py's extras declare the same range (tests/aws/test_ami_boot.py).
TORCH_FLOOR = (2, 5)
TORCH_CEILING = (3, 0)  # exclusive
TORCH_RANGE = ">=2.5,<3"


@dataclass(frozen=True)
class WorkerAmi:
    image_id: str
    name: str = ""
    source: str = ""  # the SSM parameter it was resolved from, or "worker_ami option"
    torch: str = ""  # "" when the AMI does not say (a custom AMI, or an --image job: the image's torch)
    cuda: str = ""
    root_device: str = "/dev/xvda"  # the AMI's RootDeviceName: the launch template sizes this device
    root_snapshot_gb: int = 0  # its root snapshot's size (DescribeImages); 0 when the AMI does not say

    def root_volume_gb(self, wanted: int) -> int:
        """The root volume a worker gets: `wanted` (setup's root_volume_gb), or the AMI's root snapshot
        when that is larger (EC2 refuses a volume smaller than its snapshot: every launch would fail)."""
        return max(wanted, self.root_snapshot_gb)

    def summary(self) -> str:
        what = f"torch {self.torch or 'unknown'}, CUDA {self.cuda or 'unknown'}"
        return f"{self.image_id} ({self.name or 'unnamed'}): {what}"


def torch_supported(version: str) -> bool | None:
    """Whether a torch version falls in TORCH_RANGE; None when `version` is not a version."""
    match = re.match(r"^(\d+)\.(\d+)", version or "")
    if not match:
        return None
    return TORCH_FLOOR <= (int(match[1]), int(match[2])) < TORCH_CEILING


def describe(name: str, description: str) -> tuple[str, str]:
    """(torch, CUDA) as a DLAMI's name and description state them ("" where they do not). DLAMI names read
    "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.13 (Amazon Linux 2023) 20261003"."""
    text = f"{name} {description}"
    torch = re.search(r"PyTorch[ -](\d+\.\d+(?:\.\d+)?)", text, re.I)
    cuda = re.search(r"CUDA(?:[ _-]?(?:version|stack))?[ :=-]*(\d+\.\d+)", text, re.I) or re.search(
        r"cuda-(\d+\.\d+)", text)
    return (torch[1] if torch else "", cuda[1] if cuda else "")


def resolve(ssm: Any, ec2: Any, settings: dict[str, Any], container: bool) -> WorkerAmi:
    """The AMI a job started now gets: the `worker_ami` option, else the DLAMI (or, for an --image job, the
    ECS GPU AMI) from AWS's public parameter, with what its name says of torch and CUDA. Raises
    ProviderError when the parameter is missing in the region, or the DLAMI's torch is outside
    TORCH_RANGE."""
    from petctl.io.aws import aws_errors
    from petctl.providers.aws.inventory import ssm_parameter

    pinned = (settings.get("options") or {}).get("worker_ami", "")
    param = CONTAINER_AMI_PARAM if container else DLAMI_PARAM
    image_id = pinned or ssm_parameter(ssm, param)
    with aws_errors(f"describe AMI {image_id}"):
        images = ec2.describe_images(ImageIds=[image_id]).get("Images", [])
    if not images:
        raise ProviderError(f"AMI {image_id} ({'worker_ami option' if pinned else param}) is not visible in "
                            "this region: pin another with `petctl setup --option worker_ami=ami-...`")
    found = images[0]
    problem = ami_problem(found)
    if problem:
        raise ProviderError(f"AMI {image_id}: {problem}: pin another with `petctl setup --option "
                            "worker_ami=ami-...`")
    torch, cuda = describe(found.get("Name", ""), found.get("Description", "")) if not container else ("", "")
    root = found.get("RootDeviceName") or "/dev/xvda"
    ami = WorkerAmi(image_id, found.get("Name", ""), "worker_ami option" if pinned else param, torch, cuda,
                    root, root_snapshot_gb(found))
    if torch and torch_supported(torch) is False:
        raise ProviderError(f"AMI {ami.summary()} has a torch outside petctl's supported range "
                            f"{TORCH_RANGE}: pin another with `petctl setup --option worker_ami=ami-...`")
    return ami


def root_snapshot_gb(image: dict[str, Any]) -> int:
    """The size (GiB) of an image's root snapshot, from DescribeImages' BlockDeviceMappings; 0 when the
    image does not say (then setup's root_volume_gb stands)."""
    root = image.get("RootDeviceName", "")
    for mapping in image.get("BlockDeviceMappings") or []:
        if mapping.get("DeviceName") == root:
            return int((mapping.get("Ebs") or {}).get("VolumeSize") or 0)
    return 0


def ami_problem(image: dict[str, Any]) -> str:
    """Why petctl's workers cannot boot this image ("" when nothing AWS publishes says so): an x86_64 AMI
    whose root is an EBS volume. A field the image leaves out is not held against it."""
    arch, root_type = image.get("Architecture", ""), image.get("RootDeviceType", "")
    if arch and arch != "x86_64":
        return f"its architecture is {arch}, and petctl launches x86_64 GPU instances"
    if root_type == "instance-store":
        return f"its root device is {root_type}, and petctl sizes an EBS root volume"
    if image.get("State", "available") != "available":
        return f"it is {image['State']}, not available"
    return ""


PLATFORM = "linux/amd64"
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
ECR_IMAGE_RE = re.compile(r"^(?P<account>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(\.cn)?/"
                          r"(?P<repo>[^:@]+)(:(?P<tag>[^@]+))?(@(?P<digest>sha256:[0-9a-f]{64}))?$")


def platforms(manifest: dict[str, Any], config: Callable[[str], dict[str, Any] | None]) -> set[str]:
    """The os/architecture pairs an image offers ("unknown/unknown" attestation entries left out).
    `config(digest)` returns a single manifest's config blob, or None when it cannot be read."""
    if "manifests" in manifest:  # an index: one entry per platform
        found = {f"{m.get('platform', {}).get('os', '')}/{m.get('platform', {}).get('architecture', '')}"
                 for m in manifest["manifests"]}
        return {p for p in found if p != "/" and "unknown" not in p}
    if manifest.get("schemaVersion") == 1:  # the old signed manifests name the architecture themselves
        return {f"linux/{manifest['architecture']}"} if manifest.get("architecture") else set()
    digest = (manifest.get("config") or {}).get("digest", "")
    blob = config(digest) if digest else None
    if not blob or not blob.get("architecture"):
        return set()
    return {f"{blob.get('os', 'linux')}/{blob['architecture']}"}


def verdict(image: str, offered: set[str]) -> str:
    """"" when the image runs on petctl's instances, else the one-line reason it does not."""
    if PLATFORM in offered:
        return ""
    if not offered:
        return (f"cannot tell which platform image {image} is built for: petctl launches only "
                f"{PLATFORM} images (push it with `docker build --platform {PLATFORM}`)")
    return (f"image {image} is built for {', '.join(sorted(offered))}, not {PLATFORM} (x86_64 GPU "
            f"instances): rebuild it with `docker build --platform {PLATFORM}` and push it again")


def check_image(ecr: Any, image: str, region: str, fetch: Callable[[str], bytes] | None = None) -> str:
    """Refuse (ValidationError, one line) an image that is not in this region's ECR, does not exist, or
    is not built for linux/amd64; returns its platform. `fetch(url)` reads a config blob's download URL
    (urllib by default; tests pass their own)."""
    from petctl.io.aws import ClientError, aws_errors, error_code

    match = ECR_IMAGE_RE.match(image)
    if not match or match.group("region") != region:
        raise ValidationError(f"--image {image} must be in this region's ECR (ACCOUNT.dkr.ecr.{region}."
                              "amazonaws.com/REPO:TAG), where petctl checks its platform before launching")
    repo = match.group("repo")
    image_id = {"imageDigest": match.group("digest")} if match.group("digest") else {
        "imageTag": match.group("tag") or "latest"}
    with aws_errors(f"look up the worker image {image}"):
        try:
            reply = ecr.batch_get_image(repositoryName=repo, imageIds=[image_id],
                                        acceptedMediaTypes=[*INDEX_TYPES, *MANIFEST_TYPES])
        except ClientError as exc:
            if error_code(exc) != "RepositoryNotFoundException":
                raise
            reply = {"images": []}
    if not reply.get("images"):
        raise ValidationError(f"worker image {image} is not in ECR: push it first (docs/aws.md: your own "
                              "image), or run without --image")
    manifest = json.loads(reply["images"][0]["imageManifest"])

    def config(digest: str) -> dict[str, Any] | None:
        try:
            url = ecr.get_download_url_for_layer(repositoryName=repo, layerDigest=digest)["downloadUrl"]
            return json.loads((fetch or _fetch)(url))
        except Exception:  # noqa: BLE001 unreadable is "unknown", which verdict() refuses with the reason
            return None

    offered = platforms(manifest, config)
    reason = verdict(image, offered)
    if reason:
        raise ValidationError(reason)
    return PLATFORM


def _fetch(url: str) -> bytes:
    from urllib.request import urlopen

    with urlopen(url, timeout=30) as reply:  # noqa: S310 (an https URL ECR signed for this blob)
        return reply.read(1 << 20)


WHEEL_DIR = "wheelhouse"
ENTRY_POINTS = {"petctl": "petctl.cli:main", "petctl-agent": "petctl.agent.main:main"}
# The Python petctl needs: 3.11 (the v3 store's client uses asyncio.timeout). setup.py declares the same
# (tests/aws/test_packaging.py), and the default boot checks the AMI's Python against it.
PYTHON_FLOOR = (3, 11)
PYTHON_REQUIRES = ">=3.11"
MAX_REQUIREMENTS = 64 * 1024
_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: the same code makes the same bytes
# One requirement a line: a name with extras and a version/marker, or an index option with a URL. A path
# (`./pkg`, `-e .`) or `-r other.txt` names a file the instance does not have.
_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,\s-]+\])?\s*([<>=!~;@ ].*)?$")
_INDEX_OPTION = re.compile(r"^--(index-url|extra-index-url|find-links)[ =]\s*https?://\S+$")


@dataclass(frozen=True)
class Wheel:
    name: str  # petctl-<version>-py3-none-any.whl
    version: str
    data: bytes


def package_dir() -> Path:
    import petctl

    return Path(petctl.__file__).resolve().parent


def install_requires(package: Path) -> list[str]:
    """petctl's runtime requirements: setup.py's install_requires in a checkout (read, not run), else the
    installed distribution's (its extras left out). Raises ValidationError when neither can be read."""
    setup_py = package.parent / "setup.py"
    if setup_py.is_file():
        tree = ast.parse(setup_py.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "install_requires":
                return [ast.literal_eval(e) for e in node.value.elts]
    from importlib.metadata import PackageNotFoundError, requires

    try:
        return [r for r in requires("petctl") or [] if "extra ==" not in r]
    except PackageNotFoundError:
        raise ValidationError("cannot tell petctl's dependencies: run petctl from an installed package or a "
                              "checkout with its setup.py") from None


def _files(package: Path) -> dict[str, bytes]:
    """Archive path -> bytes: every module of the package, and the templates (setup.py's package_data)."""
    from petctl.providers.aws.templates import BOOT_DIR, CFN_DIR, resource_dir

    files = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if "__pycache__" in rel.parts or rel.parts[0] == "_templates":
            continue
        files[f"petctl/{rel.as_posix()}"] = path.read_bytes()
    for name in (CFN_DIR, BOOT_DIR):
        for path in sorted(resource_dir(name).glob("*.j2")):
            files[f"petctl/_templates/{name}/{path.name}"] = path.read_bytes()
    return files


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel() -> Wheel:
    """The running petctl as a pure-Python wheel (py3-none-any) with its console scripts and runtime
    requirements (no torch: the AMI's CUDA build is the one its jobs use)."""
    from petctl import __version__

    package = package_dir()
    files = _files(package)
    digest = hashlib.sha256()
    for path, data in files.items():
        digest.update(path.encode() + b"\0" + hashlib.sha256(data).digest())
    version = f"{__version__}+{digest.hexdigest()[:12]}"
    info = f"petctl-{version}.dist-info"
    metadata = [
        "Metadata-Version: 2.1", "Name: petctl", f"Version: {version}",
        "Summary: Elastic, fault-tolerant PyTorch training on EC2 spot capacity",
        f"Requires-Python: {PYTHON_REQUIRES}",
        *(f"Requires-Dist: {r}" for r in install_requires(package)),
    ]
    files[f"{info}/METADATA"] = ("\n".join(metadata) + "\n").encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: petctl\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n")
    files[f"{info}/entry_points.txt"] = ("[console_scripts]\n" + "".join(
        f"{k} = {v}\n" for k, v in ENTRY_POINTS.items())).encode()
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, data in files.items():
            entry = zipfile.ZipInfo(path, date_time=_EPOCH)
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(entry, data)
    return Wheel(name=f"petctl-{version}-py3-none-any.whl", version=version, data=buffer.getvalue())


def read_requirements(path: Path | None) -> str:
    """The job's --requirements file, checked here so a bad line fails now and not on every instance.
    Returns "" for none. Raises ValidationError (one line) for a missing or oversized file, a line that
    names a local file, or torch (the AMI's CUDA torch is the one petctl was tested with: pin another
    with --image)."""
    if path is None:
        return ""
    path = Path(path)
    if not path.is_file():
        raise ValidationError(f"--requirements {path}: no such file")
    text = path.read_text(errors="replace")
    if len(text.encode()) > MAX_REQUIREMENTS:
        raise ValidationError(f"--requirements {path} is over {MAX_REQUIREMENTS // 1024} KB")
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if _INDEX_OPTION.match(line):
            continue
        if not _REQUIREMENT.match(line) or "file:" in line:
            raise ValidationError(f"--requirements {path} line {number} ({line!r}): only package "
                                  "requirements and --index-url/--extra-index-url/--find-links URLs; the "
                                  "instance cannot see your local files")
        if re.split(r"[\[<>=!~;@ ]", line, maxsplit=1)[0].lower() == "torch":
            raise ValidationError(f"--requirements {path} line {number}: torch comes from the Deep Learning "
                                  "AMI (its CUDA build); for another torch, pass --image with your own image")
    return text


CONFIG_MARKER = "PETCTL_AGENT_CONFIG"
# EC2 takes 16 KB of user data (raw, before base64). A worker's user data is a stub that fetches its boot
# script from the bucket (worker_user_data), so a job's arguments and environment take none of it; a stub
# over MAX_USER_DATA is refused here rather than by a failed launch (the 256 bytes kept back are for
# rounding). USER_DATA_ROOM is what the stub must leave unused: tests/aws/test_ami_boot.py holds it.
MAX_USER_DATA = 16 * 1024 - 256
USER_DATA_ROOM = 10 * 1024

BUCKET_PLACEHOLDER = "@@PETCTL_BUCKET@@"
WORKER_IMDS = "http://169.254.169.254"


@dataclass(frozen=True)
class AmiBoot:
    """What a default-path (Deep Learning AMI) instance installs: the launching petctl's wheel and the
    job's requirements, both in the job's S3 prefix (WHEEL_DIR, see build_wheel), into the AMI's Python."""

    wheel_url: str  # s3://<bucket>/jobs/<job>/wheelhouse/petctl-<version>-py3-none-any.whl
    requirements_url: str = ""  # s3://.../wheelhouse/requirements.txt, or "" for none
    python_bin: str = "/opt/pytorch/bin"


def worker_boot_script(config: AgentConfig, image: str, log_group: str, config_url: str,
                       gpus: bool = True, ami_boot: AmiBoot | None = None) -> BootScript:
    """The worker's boot script, shipped to the job's S3 prefix (its user data fetches it: worker_user_data):
    with `image`, the agent runs in that container, which logs to `log_group`, stream `<job>/<instance id>`
    (the job's role may write only its own streams); without, `ami_boot` says what the instance installs
    and the agent runs on the AMI's Python under systemd. The job's config, arguments and environment are
    in it, not in the user data: EC2's 16 KB does not bound them. Raises ValueError without either boot."""
    from petctl.providers.aws.etcdbin import BootScript
    from petctl.providers.aws.inventory import boot_settings
    from petctl.providers.aws.jobscope import log_stream_prefix
    from petctl.providers.aws.storage import job_prefix
    from petctl.providers.aws.templates import compact_shell, render_boot

    if not image and ami_boot is None:
        raise ValueError("a worker boots either an image or the AMI's Python with petctl's wheel")
    ami = ami_boot or AmiBoot(wheel_url="")
    text = compact_shell(render_boot(
        "worker_boot.sh.j2", agent_config=config.to_json(), image=image, log_group=log_group,
        config_url=config_url, gpus=gpus, boot=boot_settings(config),
        log_stream_prefix=log_stream_prefix(config.job.name),
        wheel_url=ami.wheel_url, wheel_name=ami.wheel_url.rsplit("/", 1)[-1],
        requirements_url=ami.requirements_url, python_bin=ami.python_bin, python_floor=PYTHON_FLOOR))
    return BootScript(text, prefix=job_prefix(config.job.name))


def worker_user_data(script: BootScript, bucket: str) -> str:
    """A worker's user data: a stub that fetches `script` from `bucket` with the instance role, checks
    its SHA-256 (pinned here) and runs it (worker_image/worker_stub.sh.j2). Raises ValidationError when
    it is over MAX_USER_DATA (a bucket or job name no real one has)."""
    from petctl.providers.aws.templates import compact_shell, render_boot

    text = compact_shell(render_boot("worker_stub.sh.j2", bucket=bucket, key=script.key,
                                     sha256=script.sha256))
    if len(text.encode()) > MAX_USER_DATA:
        raise ValidationError(f"the worker's user data is {len(text.encode())} bytes (limit {MAX_USER_DATA})")
    return text


def etcd_user_data(stack_name: str, etcd_ip: str, etcd_key: str, etcd_sha256: str,
                   etcd_version: str = "", etcdctl_key: str = "", etcdctl_sha256: str = "",
                   store: Backend = JOB_DEFAULT_BACKEND) -> str:
    """The single etcd host's boot script. Like the cluster members' it is shipped through the bucket
    (its user data is a stub, see etcd_member_stub: with etcd's TLS and auth it no longer fits EC2's
    16 KB), and it reads the bucket's name from PETCTL_BUCKET, which the stub sets. `store` (the stack's
    `store` option) says which etcd it runs: v3, etcd 3.6 with the v3 API only; v2, etcd 3.5 with
    `--enable-v2` and both APIs' auth (etcdbin.RELEASES)."""
    from petctl.providers.aws.etcdsecrets import USERS_INDEX, prefix
    from petctl.providers.aws.templates import render_boot

    return render_boot("etcd_boot.sh.j2", stack_name=stack_name, etcd_ip=etcd_ip,
                       etcd_version=etcd_version or _release_version(store), v2_api=store == "v2",
                       etcd_sha256=etcd_sha256, etcd_key=etcd_key, members=[],
                       etcdctl_key=etcdctl_key or etcd_key.rsplit("/", 1)[0] + "/etcdctl",
                       etcdctl_sha256=etcdctl_sha256, secret_prefix=prefix(stack_name),
                       users_index=USERS_INDEX)


def _release_version(store: Backend) -> str:
    from petctl.providers.aws.etcdbin import RELEASES

    return RELEASES[store].version


def etcd_hosts(stack_name: str, plan: NetworkPlan, etcd: EtcdArtifact,
               store: Backend = JOB_DEFAULT_BACKEND) -> tuple[list[dict], BootScript]:
    """What the base template needs per etcd member (logical-id suffix, name, address, subnet, group name,
    user data: a stub that fetches the boot script), and the boot script setup must ship to the bucket.
    Member 0 keeps the single host's logical ids and group name."""
    from petctl.providers.aws.etcdbin import BootScript

    members = plan.etcd_members
    if plan.etcd_cluster:
        script = BootScript(etcd_member_script(stack_name, members, etcd, store))
    else:
        script = BootScript(etcd_user_data(stack_name, members[0].ip, etcd.key, etcd.sha256, etcd.version,
                                           etcd.ctl_key, etcd.ctl_sha256, store))
    hosts = []
    for i, m in enumerate(members):
        data = etcd_member_stub(i, script)
        hosts.append({"suffix": str(i) if i else "", "name": m.name, "ip": m.ip, "subnet": m.subnet,
                      "group": f"{stack_name}-etcd" + (f"-{i}" if i else ""), "user_data": data})
    return hosts, script


def etcd_member_script(stack_name: str, members: Sequence[EtcdMember], etcd: EtcdArtifact,
                       store: Backend = JOB_DEFAULT_BACKEND) -> str:
    """The boot script shared by the members of a 3-member etcd cluster (shipped through the bucket, see
    etcdbin.py): the member's user data says which member it is (PETCTL_ETCD_MEMBER) and where the
    bucket is (PETCTL_BUCKET). `store` as for etcd_user_data."""
    from petctl.providers.aws.etcdsecrets import USERS_INDEX, prefix
    from petctl.providers.aws.templates import render_boot

    cluster = ",".join(f"{m.name}={m.peer_url}" for m in members)
    return render_boot("etcd_boot.sh.j2", stack_name=stack_name, members=list(members), etcd_cluster=cluster,
                       etcd_version=etcd.version, v2_api=store == "v2", etcd_sha256=etcd.sha256,
                       etcd_key=etcd.key, etcdctl_key=etcd.ctl_key, etcdctl_sha256=etcd.ctl_sha256,
                       secret_prefix=prefix(stack_name), users_index=USERS_INDEX)


def etcd_member_stub(index: int, script: BootScript) -> str:
    """Member `index`'s user data: fetch the members' boot script from the bucket, check its pinned
    checksum, run it. BUCKET_PLACEHOLDER stands where the template joins in the bucket's name."""
    from petctl.providers.aws.templates import render_boot

    return render_boot("etcd_member_stub.sh.j2", member=index, script_key=script.key,
                       script_sha256=script.sha256, bucket=BUCKET_PLACEHOLDER)


def agent_config_from_script(text: str) -> AgentConfig:
    """The agent config a worker's boot script writes (identity left blank; for tests and emulators).
    Raises ValueError when the script holds none."""
    match = re.search(rf"<<'{CONFIG_MARKER}'\n(.*?)\n{CONFIG_MARKER}\n", text, re.S)
    if not match:
        raise ValueError("no petctl agent config in this boot script")
    json.loads(match.group(1))  # must be one JSON document
    return AgentConfig.from_json(match.group(1))
