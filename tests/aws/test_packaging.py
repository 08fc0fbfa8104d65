"""The worker image's build context makes an installable petctl that still has its templates (issue 11,
item 1: `data_files` named top-level files the Docker context did not hold, so `pip install` aborted).

No Docker engine here: the test rebuilds the exact build context from the Dockerfile's COPY lines and
`Dockerfile.dockerignore`, builds a wheel from it (offline, no build isolation), installs it into a fresh
venv and renders every template from the installed package, not from this checkout.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "worker_image" / "Dockerfile"
WORKDIR = "/src/petctl"  # where the Dockerfile's COPY lines put the sources it installs


def _matches(path: str, pattern: str) -> bool:
    """Docker's rule: a pattern matches a path or any directory above it."""
    parts = path.split("/")
    return any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))


def build_context(root: Path, ignore_file: Path) -> list[str]:
    """The files `docker build -f worker_image/Dockerfile .` sends: the last matching pattern wins."""
    patterns = [line.strip() for line in ignore_file.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sent = []
    for path in sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()):
        if path.startswith(".git/"):
            continue
        excluded = False
        for pattern in patterns:
            negated = pattern.startswith("!")
            if _matches(path, pattern.lstrip("!").rstrip("/")):
                excluded = not negated
        if not excluded:
            sent.append(path)
    return sent


def copy_like_docker(root: Path, context: list[str], dockerfile: Path, target: Path) -> None:
    """Apply the Dockerfile's COPY lines (sources are globs over the context) under `target`."""
    for line in dockerfile.read_text().splitlines():
        if not line.startswith("COPY "):
            continue
        *sources, dest = line.split()[1:]
        assert dest.startswith(WORKDIR), f"COPY outside {WORKDIR}: {line}"
        dest_path = target / dest[len(WORKDIR):].lstrip("/")
        for source in sources:
            directory = source.rstrip("/") + "/"
            hits = [p for p in context if fnmatch.fnmatchcase(p, source) or p.startswith(directory)]
            assert hits, f"{line}: {source} is not in the build context"
            for hit in hits:
                if fnmatch.fnmatchcase(hit, source) and (dest.endswith("/") or len(sources) > 1):
                    out = dest_path / Path(hit).name
                elif hit == source:
                    out = dest_path
                else:
                    out = dest_path / Path(hit).relative_to(source.rstrip("/"))
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / hit, out)


RENDER = r"""
import sys
from pathlib import Path
import petctl
venv = Path(sys.argv[1]).resolve()
assert Path(petctl.__file__).resolve().is_relative_to(venv), petctl.__file__
sys.path.append(sys.argv[2])  # tests.aws.rendered from the checkout; petctl stays the installed one
from petctl.providers.aws.templates import resource_dir
from tests.aws import rendered
for name in ("cfn", "worker_image"):
    assert resource_dir(name).resolve().is_relative_to(venv), resource_dir(name)
from petctl.providers.aws.boot import etcd_user_data
base = rendered.base_template()  # cfn/base.yaml.j2 with worker_image/etcd_member_stub.sh.j2 as user data
etcd = etcd_user_data("petctl", "10.42.0.10", "dist/etcd/x/etcd", "ab" * 32)  # worker_image/etcd_boot.sh.j2
job = rendered.job_template(Path(sys.argv[3]), "spot-mixed")  # job.yaml.j2 with worker_stub.sh.j2
worker = rendered.job_boot_script(Path(sys.argv[3]), "spot-mixed").text  # worker_boot.sh.j2
seed = rendered.seed_template()  # seed.yaml.j2 with bucket.yaml.j2, which base.yaml.j2 includes too
etcd_ok = "--client-cert-auth" in etcd and "PETCTL_BUCKET" in base and "BucketPolicy" in seed
print(len(base), len(job), etcd_ok, "petctl-agent" in worker and "sha256sum -c" in job)
"""


@pytest.mark.timeout(300)
def test_wheel_from_docker_build_context_installs_and_renders_templates(tmp_path):
    context = build_context(ROOT, DOCKERFILE.with_name("Dockerfile.dockerignore"))
    assert "setup.py" in context and not any(p.startswith((".git/", "tests/")) for p in context)
    src = tmp_path / "src"
    copy_like_docker(ROOT, context, DOCKERFILE, src)
    assert (src / "cfn" / "base.yaml.j2").is_file() and (src / "petctl" / "__init__.py").is_file()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(src)], check=True, env=env, cwd=tmp_path, timeout=240)
    (wheel,) = dist.glob("petctl-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, env=env, cwd=tmp_path, timeout=240)
    out = subprocess.run([str(python), "-c", RENDER, str(venv), str(ROOT), str(tmp_path / "home")],
                         check=True, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    base_len, job_len, etcd_boot, worker_boot = out.stdout.split()
    assert int(base_len) > 1000 and int(job_len) > 1000 and etcd_boot == worker_boot == "True"
    # the image's (and the AMI boot's) warm step writes the method cache inside the install, where the
    # agent reads it: an agent's imports then compile no dataclass method (petctl/io/methodcache.py).
    # The wheel went in without its dependencies: this interpreter's are added after it (a .pth runs
    # only in a site directory of its own, so this checkout's editable finder does not come with them).
    import sysconfig

    (site,) = (venv / "lib").glob("python*/site-packages")
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    warm = subprocess.run([str(python), "-m", "petctl.agent.main", "--warm"], check=True, env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    cache = Path(warm.stdout.split(": ", 1)[1].strip())
    assert cache.is_file() and cache.resolve().is_relative_to(venv.resolve()) and not warm.stderr
    probe = ("from petctl.io import methodcache; methodcache.install('agent'); "
             "import petctl.agent.agent, petctl.io.store.v3; print(methodcache.state())")
    state = subprocess.run([str(python), "-c", probe], check=True, env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=120).stdout
    assert "'compiled': 0" in state and "problem" not in state, state


# --- the install a new user runs, and the Python it needs (issue 44.1) ----------------------------------
def _floor(spec: str) -> tuple[int, ...]:
    """The lowest Python a Requires-Python allows ((0,) when it names none)."""
    from packaging.specifiers import SpecifierSet

    floors = [tuple(int(p) for p in s.version.split(".")[:2]) for s in SpecifierSet(spec)
              if s.operator in (">=", ">", "~=")]
    return max(floors, default=(0,))


def test_the_declared_python_is_what_every_dependency_needs_and_the_same_everywhere():
    import ast
    from importlib.metadata import PackageNotFoundError, metadata

    from packaging.requirements import Requirement

    from petctl.providers.aws.boot import PYTHON_FLOOR, PYTHON_REQUIRES

    tree = ast.parse((ROOT / "setup.py").read_text())
    keywords = {k.arg: k.value for k in ast.walk(tree) if isinstance(k, ast.keyword)}
    declared = ast.literal_eval(keywords["python_requires"])
    assert declared == PYTHON_REQUIRES and _floor(declared) == PYTHON_FLOOR  # the wheel and the boot check
    for requirement in ast.literal_eval(keywords["install_requires"]):
        name = Requirement(requirement).name
        try:
            needs = metadata(name).get("Requires-Python") or ""
        except PackageNotFoundError:
            continue
        assert _floor(needs) <= PYTHON_FLOOR, f"{name} needs Python {needs}, petctl declares {declared}"
    readme = (ROOT / "README.md").read_text()
    said = set(re.findall(r"Python >= ?(3\.\d+)", readme))
    assert said == {".".join(map(str, PYTHON_FLOOR))}, said


def test_readme_installs_from_this_repository_not_from_pypi():
    readme = (ROOT / "README.md").read_text()
    aws = readme.split("## AWS", 1)[1]
    first_step = aws.split("\n1. ", 1)[1].split("\n2. ", 1)[0]
    assert "git clone" in first_step and "python -m pip install -c constraints.txt ." in first_step
    # `pip install petctl` appears only in the warning not to run it: the name is not this project's
    for match in re.finditer(r"pip install '?petctl", readme):
        assert readme[max(0, match.start() - 20):match.start()].endswith("Do not run `"), match.group(0)
