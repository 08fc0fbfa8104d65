"""A directory playing one instance of the AWS Deep Learning AMI, for running a worker's real boot script.

What the DLAMI gives that the script relies on (AWS's release notes: python_location /opt/pytorch/bin/python,
with a CUDA torch) is `root/opt/pytorch/bin/python`: a venv over this test interpreter (its torch, its
pip, and petctl's dependencies), so the script's `pip install` of the launching petctl's wheel is a real
install. Those packages are the test environment's, exactly: `venv --system-site-packages` would expose
the *base* interpreter's when the tests run in a virtual environment (README's users do), so the venv
has no system site-packages and a .pth file adds the site directories this interpreter has (issue 44.9).
What only a machine has is faked on PATH: IMDSv2 and the instance role's credentials (`curl`; the
scripts' signed requests go to the emulator through the real curl), `aws s3 cp` (read from the emulator's S3;
`aws --version` says v2), `systemctl`, `useradd`, `install -o`, `logger`, `shutdown` and `sleep`. Every
faked call is one JSON line in calls.jsonl. The venv's own site-packages come before the interpreter's,
and PYTHONPATH is cleared, so what imports petctl there gets the installed wheel, not this checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

FAKE_CURL = r"""#!/bin/bash
url=""
for arg in "$@"; do case "$arg" in http*) url="$arg" ;; esac; done
echo "{\"cmd\": \"curl\", \"url\": \"$url\"}" >> "$FAKE_LOG"
case "$url" in
  */latest/api/token) echo -n tok ;;
  */meta-data/instance-id) echo -n "$FAKE_INSTANCE" ;;
  */meta-data/local-ipv4) echo -n 127.0.0.1 ;;
  */meta-data/placement/region) echo -n "$FAKE_REGION" ;;
  */meta-data/iam/security-credentials/) echo -n petctl-worker ;;
  */meta-data/iam/security-credentials/petctl-worker)
    echo -n '{"Code":"Success","AccessKeyId":"testing","SecretAccessKey":"testing","Token":"testing"}' ;;
  "$PETCTL_AWS_ENDPOINT"/*) exec "$REAL_CURL" "$@" ;;  # the scripts' signed calls, to the emulator
  *) exit 22 ;;
esac
"""

FAKE_AWS = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({{"cmd": "aws", "args": " ".join(args)}}) + "\\n")
if args == ["--version"]:  # the DLAMI's AWS CLI v2
    print("aws-cli/2.31.0 Python/3.13.7 Linux/6.1 exe/x86_64.amzn.2023")
    sys.exit(0)
if args[:2] != ["s3", "cp"]:
    sys.exit(2)
source, dest = [a for a in args[2:] if not a.startswith("--")]
bucket, key = source[len("s3://"):].split("/", 1)
import boto3
s3 = boto3.client("s3", endpoint_url=os.environ["FAKE_S3"], region_name=os.environ["AWS_DEFAULT_REGION"])
try:
    s3.download_file(bucket, key, dest)
except Exception as exc:
    print(f"download failed: {{exc}}", file=sys.stderr)
    sys.exit(1)
"""


def _logger(name: str) -> str:
    return f'#!/bin/bash\necho "{{\\"cmd\\": \\"{name}\\", \\"args\\": \\"$*\\"}}" >> "$FAKE_LOG"\n'


FAKES = {
    "curl": FAKE_CURL, "systemctl": _logger("systemctl"), "useradd": _logger("useradd"),
    "shutdown": _logger("shutdown"), "sleep": _logger("sleep"), "logger": "#!/bin/bash\ncat > /dev/null\n",
    # `install -o USER` needs root and that user: the fake keeps everything else
    "install": "#!/bin/bash\nargs=()\nwhile [ $# -gt 0 ]; do case \"$1\" in -o|-g) shift 2 ;; "
               "*) args+=(\"$1\"); shift ;; esac; done\nexec /usr/bin/install \"${args[@]}\"\n",
}


def see_test_packages(python: Path) -> Path:
    """Make the venv of `python` (made without system site-packages) see exactly this interpreter's
    packages. In a venv, `--system-site-packages` reaches the base interpreter's site-packages, not the
    venv's, and on a distribution's Python also packages the venv never sees (Debian's dist-packages). A
    .pth file in the new venv's site-packages adds the site directories on this interpreter's sys.path,
    in its order, each with its own .pth files, after the new venv's own: a wheel installed there still
    wins. Returns the .pth file."""
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    dirs = [d for d in sys.path if d.endswith(("site-packages", "dist-packages")) and Path(d).is_dir()]
    pth = Path(purelib) / "petctl-test-environment.pth"
    pth.write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
    return pth


class FakeAmi:
    """One instance's disk (`root`), its fakes and its call log."""

    def __init__(self, directory: Path, instance_id: str, s3_endpoint: str, region: str) -> None:
        self.dir = directory
        self.root = directory / "root"
        (self.root / "var" / "log").mkdir(parents=True, exist_ok=True)
        self.python = self.root / "opt" / "pytorch" / "bin" / "python"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.root / "opt" / "pytorch")],
                       check=True, timeout=120)
        see_test_packages(self.python)
        fakes = directory / "fakes"
        fakes.mkdir(exist_ok=True)
        for name, text in {**FAKES, "aws": FAKE_AWS.format(python=sys.executable)}.items():
            (fakes / name).write_text(text)
            (fakes / name).chmod(0o755)
        self.log = directory / "calls.jsonl"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AWS_ENDPOINT_URL")}
        self.env = {**env, "PATH": f"{fakes}:{os.environ['PATH']}", "PETCTL_ROOT": str(self.root),
                    "FAKE_LOG": str(self.log), "FAKE_INSTANCE": instance_id, "FAKE_REGION": region,
                    "FAKE_S3": s3_endpoint, "AWS_DEFAULT_REGION": region, "HOME": str(directory),
                    # the boot scripts' own signed requests (SigV4 with curl: the user data's fetch of the
                    # boot script, the boot records) go to the emulator
                    "PETCTL_AWS_ENDPOINT": s3_endpoint, "REAL_CURL": shutil.which("curl") or "curl",
                    # the instance's "internet": nothing beyond what is installed already
                    "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    def boot(self, user_data: str, timeout: float = 240) -> subprocess.CompletedProcess:
        path = self.dir / "user-data.sh"
        path.write_text(user_data)
        return subprocess.run(["bash", str(path)], env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=self.dir)  # not a checkout: `-c` imports from the cwd

    def calls(self, cmd: str | None = None) -> list[dict]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [c for c in map(json.loads, lines) if cmd is None or c["cmd"] == cmd]

    def unit(self, name: str = "petctl-agent.service") -> dict[str, str]:
        """KEY -> value of the [Service] and [Unit] lines the script wrote (last value wins)."""
        text = (self.root / "etc" / "systemd" / "system" / name).read_text()
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def installed_petctl(self) -> tuple[str, str]:
        """(version, where petctl is imported from) as the AMI's Python sees it."""
        out = subprocess.run([str(self.python), "-c", "import importlib.metadata as m, petctl; "
                              "print(m.version('petctl')); print(petctl.__file__)"],
                             env=self.env, capture_output=True, text=True, timeout=60, check=True,
                             cwd=self.dir)
        version, where = out.stdout.split()
        return version, where
