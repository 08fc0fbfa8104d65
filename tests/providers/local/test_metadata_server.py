"""The local IMDSv2 endpoint speaks the real protocol: tokens with TTLs, 401 without one, 404 before a
spot notice, and per-instance answers driven by the chaos command's notice files."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from petctl.providers.local.metadata_server import LocalMetadataServer, iso8601
from tests.support.notices import write_notice


def call(url: str, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, method=method, headers=headers or {},
                                 data=b"" if method == "PUT" else None)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def token(base: str, ttl: int = 60) -> str:
    status, body = call(base + "/latest/api/token", "PUT", {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)})
    assert status == 200 and body
    return body


def get(base: str, path: str, tok: str | None) -> tuple[int, str]:
    return call(base + "/latest/meta-data/" + path, headers={"X-aws-ec2-metadata-token": tok} if tok else {})


def test_endpoint_and_instance_id(metadata_server: LocalMetadataServer) -> None:
    base = metadata_server.endpoint_for("i-local-3")
    assert base == f"http://127.0.0.1:{metadata_server.port}/i-local-3" and metadata_server.port > 0
    assert get(base, "instance-id", token(base)) == (200, "i-local-3")


def test_token_is_required_and_validated(metadata_server: LocalMetadataServer) -> None:
    base = metadata_server.endpoint_for("i-1")
    assert get(base, "instance-id", None)[0] == 401
    assert get(base, "instance-id", "forged")[0] == 401
    assert call(base + "/latest/api/token", "PUT")[0] == 400  # TTL header is mandatory
    assert call(base + "/latest/api/token", "PUT", {"X-aws-ec2-metadata-token-ttl-seconds": "0"})[0] == 400
    assert call(base + "/latest/api/token", "PUT",
                {"X-aws-ec2-metadata-token-ttl-seconds": "21601"})[0] == 400
    other = token(metadata_server.endpoint_for("i-2"))
    assert get(base, "instance-id", other)[0] == 401  # tokens are per instance


def test_token_expires_after_ttl(metadata_server: LocalMetadataServer) -> None:
    base = metadata_server.endpoint_for("i-1")
    tok = token(base, ttl=1)
    assert get(base, "instance-id", tok)[0] == 200
    time.sleep(1.2)
    assert get(base, "instance-id", tok)[0] == 401


def test_spot_notice(metadata_server: LocalMetadataServer) -> None:
    base = metadata_server.endpoint_for("i-1")
    tok = token(base)
    assert get(base, "spot/instance-action", tok)[0] == 404
    when = time.time() + 30
    write_notice(metadata_server, "i-1", "spot", when)
    status, body = get(base, "spot/instance-action", tok)
    assert status == 200
    assert json.loads(body) == {"action": "terminate", "time": iso8601(when)}
    assert get(base, "autoscaling/target-lifecycle-state", tok) == (200, "InService")
    other = metadata_server.endpoint_for("i-2")  # another instance is unaffected
    assert get(other, "spot/instance-action", token(other))[0] == 404


def test_asg_notice(metadata_server: LocalMetadataServer) -> None:
    base = metadata_server.endpoint_for("i-1")
    tok = token(base)
    assert get(base, "autoscaling/target-lifecycle-state", tok) == (200, "InService")
    write_notice(metadata_server, "i-1", "asg", time.time() + 30)
    assert get(base, "autoscaling/target-lifecycle-state", tok) == (200, "Terminated")
    assert get(base, "spot/instance-action", tok)[0] == 404


def test_unknown_paths_and_garbage_notice(metadata_server: LocalMetadataServer) -> None:
    base = metadata_server.endpoint_for("i-1")
    tok = token(base)
    assert get(base, "nothing/here", tok)[0] == 404
    assert call(f"{metadata_server.base_url}/", headers={"X-aws-ec2-metadata-token": tok})[0] == 404
    metadata_server.notices_dir.mkdir(parents=True, exist_ok=True)
    (metadata_server.notices_dir / "i-1.json").write_text("{half")
    assert get(base, "spot/instance-action", tok)[0] == 404


def test_stop_releases_the_port(tmp_path: Path) -> None:
    srv = LocalMetadataServer(tmp_path).start()
    base = srv.endpoint_for("i-1")
    srv.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(base + "/latest/meta-data/instance-id", timeout=2)
