"""A directory playing one instance for running a rendered boot script for real: fake `docker`, `aws`,
`curl` (IMDS, the AWS APIs, the job's bucket), `systemctl`, `sleep` and `shutdown` on PATH, every call
logged to calls.jsonl."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from petctl.io.etcdpki import EtcdPki
from petctl.providers.aws.etcdsecrets import host_bundle
from tests.support.aws.boot import IMAGE

INSTANCE = "i-0123456789abcdef0"
ETCD_BINARY = b"\x7fELF fake etcd\n"
CREDS = {"AccessKeyId": "ASIAFAKEFAKEFAKE", "SecretAccessKey": "fake/secret+key", "Token": "tok/en+=="}
PASSWORD = "ecr-password-123"

FAKE_CURL = r"""#!/bin/bash
# IMDSv2 and the AWS APIs, as far as the boot scripts use them. Every call is logged as one JSON line.
url="" headers=() data="" out="" method=GET status=""
while [ $# -gt 0 ]; do
  case "$1" in
    -H) headers+=("$2"); shift 2 ;;
    --data-binary|--data) data="$2"; shift 2 ;;
    -o) out="$2"; shift 2 ;;
    -w) status=1; shift 2 ;;
    -X) method="$2"; shift 2 ;;
    --max-time|--cacert|--cert|--key) shift 2 ;;
    http*) url="$1"; shift ;;
    *) shift ;;
  esac
done
python3 - "$url" "$data" "${headers[@]}" >> "$FAKE_LOG" <<'PY'
import json, sys
print(json.dumps({"cmd": "curl", "url": sys.argv[1], "data": sys.argv[2], "headers": sys.argv[3:]}))
PY
fail() {  # fail NAME: true while the NAME counter (FAKE_FAIL_NAME failures wanted) is not used up
  local want counter="$FAKE_DIR/count.$1" n
  want=$(printenv "FAKE_FAIL_$1" || echo 0)
  n=$(cat "$counter" 2>/dev/null || echo 0)
  echo $((n + 1)) > "$counter"
  [ "$n" -lt "$want" ]
}
case "$url" in
  */latest/api/token) echo -n tok ;;
  */meta-data/instance-id) echo -n "$FAKE_INSTANCE" ;;
  */meta-data/local-ipv4) echo -n 10.42.0.99 ;;
  */meta-data/placement/region) echo -n us-west-2 ;;
  */meta-data/iam/security-credentials/) echo -n petctl-role ;;
  */meta-data/iam/security-credentials/petctl-role) cat "$FAKE_DIR/creds.json" ;;
  https://api.ecr.*) fail ECR && exit 22; cat "$FAKE_DIR/ecr.json" ;;
  https://autoscaling.*)
    fail AUTOSCALING && exit 22
    case "$data" in *Action=CompleteLifecycleAction*) fail LAUNCH && exit 22 ;; esac
    echo "<Response/>" ;;
  https://*.s3.*.amazonaws.com/*)
    fail S3 && exit 22
    python3 "$FAKE_DIR/s3.py" "$method" "$url" "$data" || exit 22 ;;
  https://127.0.0.1:2379/health) fail HEALTH && exit 7; echo '{"health":"true","reason":""}' ;;
  https://127.0.0.1:2379/v2/auth/*)  # etcd's v2 auth API, as root: auth already on
    case "$method ${url#*/v2/auth/}" in
      "GET enable") echo '{"enabled":true}' > "$out"; echo -n 200 ;;
      PUT*) echo '{}' > "$out"; echo -n 201 ;;
      *) echo '{}' > "$out"; echo -n 200 ;;
    esac ;;
  *) exit 6 ;;
esac
"""

FAKE_S3 = r"""
# The job's bucket, as far as the boot records use it: PUT, GET and ListObjectsV2 on files under s3/.
import pathlib, sys, urllib.parse
method, url, data = sys.argv[1:4]
parts = urllib.parse.urlsplit(url)
root = pathlib.Path(__file__).parent / "s3"
key = parts.path.lstrip("/")
query = urllib.parse.parse_qs(parts.query)
if method == "PUT":
    (root / key).parent.mkdir(parents=True, exist_ok=True)
    (root / key).write_text(data)
elif "list-type" in query:
    prefix = query["prefix"][0]
    keys = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    print("<ListBucketResult>" + "".join(f"<Contents><Key>{k}</Key></Contents>" for k in keys
                                          if k.startswith(prefix)) + "</ListBucketResult>")
elif (root / key).is_file():
    print((root / key).read_text(), end="")
else:
    sys.exit(1)
"""

FAKE_DOCKER = r"""#!/bin/bash
echo "{\"cmd\": \"docker\", \"args\": \"$*\"}" >> "$FAKE_LOG"
counter="$FAKE_DIR/count.docker-$1"
n=$(cat "$counter" 2>/dev/null || echo 0); echo $((n + 1)) > "$counter"
case "$1" in
  info) [ "$n" -ge "${FAKE_FAIL_DOCKER_INFO:-0}" ] ;;
  login) cat > "$FAKE_DIR/docker-password" ;;
  pull) [ "$n" -ge "${FAKE_FAIL_DOCKER_PULL:-0}" ] ;;
  *) true ;;
esac
"""

FAKE_AWS = r"""#!/bin/bash
echo "{\"cmd\": \"aws\", \"args\": \"$*\"}" >> "$FAKE_LOG"
case "$1 $2" in
  "ec2 describe-network-interfaces")
    case "$*" in
      *Attachment.InstanceId*) echo "$FAKE_INSTANCE" ;;
      *) echo eni-0123 ;;
    esac ;;
  "s3 cp")
    counter="$FAKE_DIR/count.s3"
    n=$(cat "$counter" 2>/dev/null || echo 0); echo $((n + 1)) > "$counter"
    [ "$n" -ge "${FAKE_FAIL_S3:-0}" ] || exit 1
    cp "$FAKE_DIR/etcd" "${@: -1}" ;;
  "secretsmanager get-secret-value")
    counter="$FAKE_DIR/count.secret"
    n=$(cat "$counter" 2>/dev/null || echo 0); echo $((n + 1)) > "$counter"
    [ "$n" -ge "${FAKE_FAIL_SECRET:-0}" ] || exit 255
    cat "$FAKE_DIR/host-secret" ;;
  "s3api list-objects-v2") echo None ;;
  *) exit 2 ;;
esac
"""


def _logger(name: str) -> str:
    return f'#!/bin/bash\necho "{{\\"cmd\\": \\"{name}\\", \\"args\\": \\"$*\\"}}" >> "$FAKE_LOG"\n'


FAKES = {
    "curl": FAKE_CURL, "docker": FAKE_DOCKER, "aws": FAKE_AWS,
    "etcdctl": '#!/bin/bash\necho "{\\"cmd\\": \\"etcdctl\\", \\"args\\": \\"$*\\"}" >> "$FAKE_LOG"\n'
               'echo "Authentication Status: true"\n',
    "sleep": _logger("sleep"), "shutdown": _logger("shutdown"), "systemctl": _logger("systemctl"),
    "useradd": _logger("useradd"), "logger": "#!/bin/bash\ncat > /dev/null\n",
    "ip": "#!/bin/bash\necho '    inet 10.42.0.10/20 scope global ens6'\n",
    # `install -o USER` needs root and that user: the fake keeps everything else
    "install": "#!/bin/bash\nargs=()\nwhile [ $# -gt 0 ]; do case \"$1\" in -o|-g) shift 2 ;; "
               "*) args+=(\"$1\"); shift ;; esac; done\nexec /usr/bin/install \"${args[@]}\"\n",
}


class Boot:
    """A directory playing one instance: fakes on PATH, files under root/, every call in calls.jsonl."""

    def __init__(self, tmp_path: Path) -> None:
        if not shutil.which("bash") or not shutil.which("openssl") or not shutil.which("python3"):
            pytest.skip("bash, openssl and python3 are needed to run the boot scripts")
        self.dir = tmp_path
        self.root = tmp_path / "root"
        (self.root / "var" / "log").mkdir(parents=True)
        fakes = tmp_path / "fakes"
        fakes.mkdir()
        for name, text in FAKES.items():
            (fakes / name).write_text(text)
            (fakes / name).chmod(0o755)
        (tmp_path / "creds.json").write_text(json.dumps({"Code": "Success", **CREDS}))
        token = base64.b64encode(f"AWS:{PASSWORD}".encode()).decode()
        (tmp_path / "ecr.json").write_text(json.dumps({"authorizationData": [
            {"authorizationToken": token, "proxyEndpoint": "https://" + IMAGE.split("/")[0]}]}))
        (tmp_path / "etcd").write_bytes(ETCD_BINARY)
        (tmp_path / "s3.py").write_text(FAKE_S3)
        self.s3 = tmp_path / "s3"  # the job's bucket
        (tmp_path / "host-secret").write_text(host_bundle(EtcdPki.new("petctl"), ("10.42.0.10",)))
        self.log = tmp_path / "calls.jsonl"
        self.env = {"PATH": f"{fakes}:{os.environ['PATH']}", "PETCTL_ROOT": str(self.root),
                    "FAKE_LOG": str(self.log), "FAKE_DIR": str(tmp_path), "FAKE_INSTANCE": INSTANCE,
                    "HOME": str(tmp_path), "PETCTL_BUCKET": "petctl-bucket",
                    "ETCDCTL": str(fakes / "etcdctl")}

    def run(self, script: str, timeout: float = 60, **fail: int) -> subprocess.CompletedProcess:
        path = self.dir / "user-data.sh"
        path.write_text(script)
        env = {**self.env, **{f"FAKE_FAIL_{k.upper()}": str(v) for k, v in fail.items()}}
        return subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=timeout)

    def calls(self, cmd: str | None = None) -> list[dict]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [c for c in map(json.loads, lines) if cmd is None or c["cmd"] == cmd]

    def sleeps(self) -> list[int]:
        return [int(c["args"]) for c in self.calls("sleep")]

    def docker(self, sub: str) -> int:
        return sum(1 for c in self.calls("docker") if c["args"].split()[0] == sub)

    def autoscaling(self, action: str) -> list[dict[str, list[str]]]:
        """The Auto Scaling API calls of one action the script made (tries included)."""
        return [q for c in self.calls("curl") if c["url"].startswith("https://autoscaling.")
                and (q := parse_qs(c["data"]))["Action"] == [action]]

    def unhealthy_calls(self) -> list[dict[str, list[str]]]:
        return self.autoscaling("SetInstanceHealth")

    def boot_records(self) -> list[str]:
        """The boot records' keys in the job's prefix (the fake bucket), in the order they happened: by
        their time (whole seconds), then by stage (two marks often share a second, and their names then
        sort `installing` before `started`; petctl/core/boots.py `stages` orders them the same way)."""
        from petctl.core.boots import BOOT_EVENTS

        names = [p.name for p in (self.s3 / "jobs/demo/boots").glob("*.json")]
        return sorted(names, key=lambda n: (n.split(".")[0], BOOT_EVENTS.index(n.split(".")[2])))
