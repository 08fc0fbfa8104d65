"""What an instance of the default (Deep Learning AMI) path installs: the petctl that launched the job,
as a wheel the CLI builds from its own code, and the job's `--requirements FILE`.

Both go to the job's S3 prefix (`wheelhouse/`), which only the job's own role may read. The wheel is
built here, in pure Python and offline, from the very modules this CLI runs (a checkout, an editable or
a wheel install alike): an instance never runs a petctl other than the one that started it, whether or
not that version was ever published. Its version carries a local label, the hash of its contents
(`0.1.0+<12 hex>`), so pip never mistakes it for another build of the same version. petctl's own
dependencies are not in the wheelhouse: on the instance pip keeps what the AMI's Python already has when it
satisfies setup.py's ranges and fetches the rest from the package index, which is why the default path
needs public subnets (launch.py refuses `subnets=private` in one line: use --image there).
"""

from __future__ import annotations

import ast
import base64
import hashlib
import io
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from petctl.core.errors import ValidationError

WHEEL_DIR = "wheelhouse"
ENTRY_POINTS = {"petctl": "petctl.cli:main", "petctl-agent": "petctl.agent.main:main"}
PYTHON_REQUIRES = ">=3.10"
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
