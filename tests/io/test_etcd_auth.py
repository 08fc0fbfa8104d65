"""Jobs cannot touch each other's rendezvous: etcd's auth, exercised on a real etcd 3.5.

The model (petctl/io/etcdauth.py, etcdpki.py): etcd serves https only and requires a client certificate
whose CN is the client's user; root administers; each job run's user may read and write only
`/petctl/jobs/<job>/*`; the guest role (anyone etcd cannot attribute) has nothing; v3 auth is on with root
its only user. Every check here is an attack a job's code could make with its own agent's credentials.
"""

from __future__ import annotations

import http.client
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import etcd
import pytest

from petctl.core.keys import JobKeys
from petctl.io.etcd import EtcdServer, etcd_client, etcd_healthy, etcdctl_binary
from petctl.io.etcdauth import (
    SecureEtcdDir,
    V3Admin,
    grant_job,
    job_grant,
    job_user,
    job_users,
    revoke_user,
    role_patterns,
    start_secure,
)
from petctl.io.etcdpki import EtcdPki, EtcdTls, issue, new_ca, write_credentials
from tests.support.etcd_auth import denied, refused

A, B, SIBLING = "ja", "jb", "ja-b"  # "ja-b" starts with "ja": a prefix without its slash would match it


@dataclass
class Installation:
    secure: SecureEtcdDir
    server: EtcdServer
    root: etcd.Client
    creds: dict[str, EtcdTls]  # job -> its agents' credentials
    users: dict[str, str]  # job -> its etcd user

    def client(self, job: str) -> etcd.Client:
        return etcd_client(self.server.endpoint, read_timeout=3.0, tls=self.creds[job])


@pytest.fixture(scope="module")
def inst(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installation]:
    root_dir = tmp_path_factory.mktemp("etcd-auth")
    secure = SecureEtcdDir.create(root_dir / "pki")
    server = start_secure(secure, root_dir / "data", log_path=root_dir / "etcd.log")
    try:
        root = secure.root_client(server.endpoint)
        users, creds = {}, {}
        for i, job in enumerate((A, B, SIBLING)):
            users[job] = job_user(job, f"{i:08x}")
            creds[job] = secure.job_credentials(users[job], root_dir / "jobs" / job)
            grant_job(root, users[job], job)
        yield Installation(secure, server, root, creds, users)
    finally:
        server.stop(remove_data=True)


def test_a_job_works_in_its_own_prefix(inst: Installation) -> None:
    a, keys = inst.client(A), JobKeys(A)
    a.write(keys.round, "r1")
    a.write(keys.round, "r2", prevValue="r1")  # compare-and-swap, as the rendezvous does
    a.write(keys.node("n1"), "beat", ttl=30)
    a.write(keys.node("n1"), None, ttl=30, refresh=True, prevExist=True)  # the heartbeat's refresh
    a.write(keys.events, "e1", append=True)  # in-order keys, as the event sink writes them
    assert a.read(keys.live, recursive=True).leaves
    assert a.read(keys.round).value == "r2"
    a.delete(keys.live, recursive=True, dir=True)
    assert inst.root.read(keys.events, recursive=True).leaves  # root sees what the job wrote
    assert role_patterns(inst.root, inst.users[A]) == [f"/petctl/jobs/{A}/*"]


def test_a_job_cannot_read_write_or_delete_another_jobs_keys(inst: Installation) -> None:
    b_keys = JobKeys(B)
    inst.client(B).write(b_keys.round, "b's round")
    inst.client(SIBLING).write(JobKeys(SIBLING).round, "the sibling's round")
    a = inst.client(A)
    attacks = {
        "read b": lambda: a.read(b_keys.round),
        "read b recursively": lambda: a.read(b_keys.base, recursive=True),
        "watch b": lambda: a.read(b_keys.live, recursive=True, wait=True, timeout=1),
        "overwrite b": lambda: a.write(b_keys.round, "hijacked"),
        "compare-and-swap b": lambda: a.write(b_keys.round, "hijacked", prevValue="b's round"),
        "delete b's key": lambda: a.delete(b_keys.round),
        "delete b": lambda: a.delete(b_keys.base, recursive=True, dir=True),
        "write under the sibling name": lambda: a.write(JobKeys(SIBLING).round, "x"),
        "read the sibling": lambda: a.read(JobKeys(SIBLING).round),
        "create a new job's keys": lambda: a.write(JobKeys("jc").spec, "{}"),
        "write its own job directory": lambda: a.write(JobKeys(A).base, "x"),
    }
    allowed = [name for name, attack in attacks.items() if not denied(attack)]
    assert allowed == []
    assert inst.root.read(b_keys.round).value == "b's round"
    assert inst.root.read(JobKeys(SIBLING).round).value == "the sibling's round"


def test_a_job_cannot_wipe_or_list_the_store(inst: Installation) -> None:
    inst.client(B).write(JobKeys(B).spec, "{}")
    a = inst.client(A)
    attacks = {
        "list the root": lambda: a.read("/", recursive=True),
        "list every job": lambda: a.read("/petctl/jobs"),
        "wipe the root": lambda: a.delete("/", recursive=True, dir=True),
        "wipe every job": lambda: a.delete("/petctl", recursive=True, dir=True),
        "write outside petctl": lambda: a.write("/elsewhere", "x"),
        "watch everything": lambda: a.read("/", recursive=True, wait=True, timeout=1),
    }
    assert [name for name, attack in attacks.items() if not denied(attack)] == []
    assert inst.root.read(JobKeys(B).spec).value == "{}"


def test_a_path_that_climbs_out_of_the_prefix_is_checked_where_it_lands(inst: Installation) -> None:
    """`/petctl/jobs/ja/../jb/...` starts with job a's prefix; etcd redirects it to the cleaned path
    (and checks permission there) rather than serving it."""
    inst.client(B).write(JobKeys(B).round, "b's round")
    tls = inst.creds[A]
    host, port = "127.0.0.1", inst.server.client_port
    for path in (f"/v2/keys/petctl/jobs/{A}/../{B}/live/round",
                 f"/v2/keys/petctl/jobs/{A}/%2e%2e/{B}/live/round",
                 f"/v2/keys/petctl/jobs/{A}//../{B}/live/round"):
        for method in ("GET", "PUT", "DELETE"):
            conn = http.client.HTTPSConnection(host, port, timeout=3, context=tls.ssl_context())
            conn.request(method, path, body="value=hijacked" if method == "PUT" else None,
                         headers={"Content-Type": "application/x-www-form-urlencoded"})
            response = conn.getresponse()
            response.read()
            conn.close()
            assert response.status in (301, 307, 308), (method, path, response.status)
            assert response.getheader("Location", "").endswith(f"/petctl/jobs/{B}/live/round")
    a = inst.client(A)  # python-etcd follows the redirect: then the permission check refuses it
    assert denied(lambda: a.api_execute(f"/v2/keys/petctl/jobs/{A}/../{B}/live/round", a._MGET))
    assert inst.root.read(JobKeys(B).round).value == "b's round"


def test_a_job_cannot_change_auth(inst: Installation) -> None:
    a = inst.client(A)
    url = a.base_uri + "/v2/auth"

    def call(method: str, path: str, body: dict | None = None) -> int:
        return a.http.request(method, url + path, body=json.dumps(body) if body else None,
                              headers={"Content-Type": "application/json"}).status

    assert call("PUT", f"/roles/{inst.users[A]}",
                {"role": inst.users[A], "grant": {"kv": {"read": ["/*"], "write": ["/*"]}}}) == 401
    everything = {"kv": {"read": ["/*"], "write": ["/*"]}}
    assert call("PUT", "/roles/guest", {"role": "guest", "grant": everything}) == 401
    assert call("PUT", "/users/intruder", {"user": "intruder", "password": "x", "roles": ["root"]}) == 401
    assert call("PUT", f"/users/{inst.users[A]}", {"user": inst.users[A], "grant": ["root"]}) == 401
    assert call("DELETE", f"/users/{inst.users[B]}") == 401
    assert call("DELETE", "/enable") == 401
    assert call("GET", "/users") == 401
    assert role_patterns(inst.root, inst.users[A]) == [f"/petctl/jobs/{A}/*"]
    assert inst.users[B] in job_users(inst.root)
    assert json.loads(inst.root.http.request("GET", inst.root.base_uri + "/v2/auth/enable").data)["enabled"]


def test_a_job_cannot_use_the_v3_api(inst: Installation) -> None:
    """v3 has its own keyspace, cluster membership and auth on the same port (gRPC): without v3 auth any
    client certificate could add or remove members or lock everyone out of v3."""
    tls = inst.creds[A]

    def etcdctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([etcdctl_binary(), f"--endpoints={inst.server.endpoint}", f"--cacert={tls.ca}",
                               f"--cert={tls.cert}", f"--key={tls.key}", "--dial-timeout=3s",
                               "--command-timeout=5s", *args], capture_output=True, text=True, timeout=30)

    member = etcdctl("member", "list").stdout.split(",")[0]
    for args in (("put", "/x", "1"), ("get", "/", "--prefix"),
                 ("user", "add", "intruder", "--new-user-password=x"), ("auth", "disable"),
                 ("member", "remove", member), ("member", "add", "z", "--peer-urls=http://127.0.0.1:9"),
                 ("role", "grant-permission", "root", "readwrite", "/")):
        run = etcdctl(*args)
        assert "denied" in run.stderr or "not found" in run.stderr, (args, run.stdout, run.stderr)
    assert etcd_healthy(inst.server.endpoint, tls=inst.secure.root)


def test_only_certificates_of_the_installation_get_in(inst: Installation, tmp_path: Path) -> None:
    endpoint = inst.server.endpoint
    with pytest.raises(ValueError, match="client certificate"):
        etcd_client(endpoint)  # an https etcd without credentials is refused before any request
    assert not etcd_healthy(endpoint)  # no certificate: the TLS handshake fails
    # A self-made "root" certificate from a CA etcd does not trust: the handshake fails.
    rogue_ca = new_ca("rogue")
    rogue = issue(rogue_ca, "root")
    rogue_tls = write_credentials(tmp_path / "rogue", inst.secure.pki().admin_ca.cert, rogue.cert, rogue.key)
    assert not etcd_healthy(endpoint, tls=rogue_tls)
    with pytest.raises(etcd.EtcdConnectionFailed):
        etcd_client(endpoint, tls=rogue_tls).read(JobKeys(B).base, recursive=True)
    # A certificate of the jobs CA for a user etcd does not know is the guest, who may do nothing.
    stranger = inst.secure.job_credentials(job_user("jz", "0000000f"), tmp_path / "stranger")
    assert denied(lambda: etcd_client(endpoint, tls=stranger).read(JobKeys("jz").base, recursive=True))
    # Basic auth naming root, with a guessed password, is refused too.
    a = inst.client(A)
    a.username, a.password = "root", "guess"
    assert denied(lambda: a.read(JobKeys(B).base, recursive=True))


def test_a_revoked_user_authenticates_as_nobody(inst: Installation, tmp_path: Path) -> None:
    user = job_user("jd", "0000000d")
    tls = inst.secure.job_credentials(user, tmp_path / "jd")
    grant_job(inst.root, user, "jd")
    client = etcd_client(inst.server.endpoint, tls=tls)
    client.write(JobKeys("jd").round, "r")
    revoke_user(inst.root, user)
    revoke_user(inst.root, user)  # idempotent
    assert user not in job_users(inst.root)
    assert denied(lambda: client.read(JobKeys("jd").round))
    # the next run of the same job is another user: the old certificate stays useless
    grant_job(inst.root, job_user("jd", "0000000e"), "jd")
    assert denied(lambda: client.write(JobKeys("jd").round, "again"))


def test_auth_is_on_before_any_job_can_connect(tmp_path: Path) -> None:
    """`start_secure` creates the guest role empty before enabling auth (enabling creates it with
    read/write on `/*` otherwise) and survives a restart; bootstrapping twice changes nothing."""
    secure = SecureEtcdDir.create(tmp_path / "pki")
    server = start_secure(secure, tmp_path / "data")
    try:
        root = secure.root_client(server.endpoint)
        guest = json.loads(root.http.request("GET", root.base_uri + "/v2/auth/roles/guest").data)
        assert guest["permissions"]["kv"] == {"read": [], "write": []}
        server.stop()
        server = start_secure(secure, tmp_path / "data", ports=(server.client_port, server.peer_port))
        root = secure.root_client(server.endpoint)
        assert json.loads(root.http.request("GET", root.base_uri + "/v2/auth/enable").data)["enabled"]
        stranger = secure.job_credentials(job_user("jz", "0000000f"), tmp_path / "stranger")
        assert denied(lambda: etcd_client(server.endpoint, tls=stranger).write("/petctl/jobs/jz/x", "1"))
    finally:
        server.stop()


def test_pki_roundtrip_and_identities() -> None:
    from petctl.io.etcdpki import common_name

    pki = EtcdPki.new("t")
    assert EtcdPki.from_json(pki.to_json()) == pki
    assert common_name(pki.root.cert) == "root"
    assert common_name(pki.job_client("job-ja-00000001").cert) == "job-ja-00000001"
    with pytest.raises(ValueError):
        job_user("Not A Job", "00000001")


@pytest.mark.slow
def test_two_local_jobs_side_by_side_cannot_touch_each_other(local, tmp_path: Path) -> None:
    """The local provider gives each job run its own etcd user (v2 and v3) and certificate; with auth on,
    both jobs' agents form their rounds (through the default store, v3), and job A's credentials (what
    its code can read from its own directory) reach nothing of job B's, through either API; kill_job A
    deletes A's user (from both) and leaves B running."""
    from contextlib import closing

    from petctl.core.records import Round
    from tests.support.store import store_for

    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    for job in (A, B):
        local.run("run_job", "--name", job, "--min", "1", "--max", "1", "--wait", str(script))
    root, root_kv = local.etcd(), local.store()
    for job in (A, B):  # each job's agent formed its round with its own credentials
        local.wait_status(job, lambda s: any(n.get("state") == "running" for n in s["nodes"].values()), 120,
                          f"job {job}'s node running")
        assert Round.from_json(root_kv.get(JobKeys(job).round).value).world_size == 1
    spec = json.loads((local.job_dir(A) / "job.json").read_text())["spec"]
    assert spec["etcd_endpoint"].startswith("https://") and spec["etcd_credentials"].startswith("file://")
    a_tls = EtcdTls.in_dir(local.job_dir(A) / "etcd")
    a = etcd_client(spec["etcd_endpoint"], read_timeout=3.0, tls=a_tls)
    b_keys = JobKeys(B)
    before = root_kv.get(b_keys.round).value
    with closing(store_for(spec["etcd_endpoint"], a_tls, spec["etcd_store"])) as a_kv:
        store_attacks = {  # through the job's own backend, as the agents talk
            "read b's round": lambda: a_kv.get(b_keys.round),
            "list b's nodes": lambda: a_kv.list(b_keys.nodes),
            "end b": lambda: a_kv.create(b_keys.result, "{}"),
            "overwrite b's round": lambda: a_kv.put(b_keys.round, "{}"),
            "delete b's heartbeats": lambda: a_kv.delete_dir(b_keys.nodes),
            "delete b": lambda: a_kv.delete_dir(b_keys.base),
            "wipe the store": lambda: a_kv.delete_dir("/"),
        }
        assert [name for name, attack in store_attacks.items() if not refused(attack)] == []
        assert a_kv.get(JobKeys(A).round).value  # A's own keys are A's to read
    attacks = {  # and through the other API, python-etcd's v2, where the same user exists
        "read b's round": lambda: a.read(b_keys.round),
        "read b's nodes": lambda: a.read(b_keys.nodes, recursive=True),
        "end b": lambda: a.write(b_keys.result, "{}"),
        "overwrite b's round": lambda: a.write(b_keys.round, "{}"),
        "delete b's heartbeats": lambda: a.delete(b_keys.nodes, recursive=True, dir=True),
        "delete b": lambda: a.delete(b_keys.base, recursive=True, dir=True),
        "wipe the store": lambda: a.delete("/", recursive=True, dir=True),
    }
    assert [name for name, attack in attacks.items() if not denied(attack)] == []
    assert root_kv.get(b_keys.round).value == before
    root_kv.close()

    users = job_users(root)
    a_user = json.loads((local.job_dir(A) / "job.json").read_text())["etcd_user"]
    assert a_user in users and len(users) == 2
    v3 = V3Admin(spec["etcd_endpoint"], local.etcd_root_tls())  # the same users in v3's auth
    assert v3.job_users() == sorted(users)
    assert v3.role_grants(a_user) == [job_grant(A)]
    local.run("kill_job", A)
    assert a_user not in job_users(root)
    assert a_user not in v3.job_users() and len(v3.job_users()) == 1
    assert denied(lambda: a.read(JobKeys(A).round))
    with closing(store_for(spec["etcd_endpoint"], a_tls, spec["etcd_store"])) as a_kv:
        assert refused(lambda: a_kv.get(JobKeys(A).round))  # and through v3: the user is gone from both
    assert local.status(B)["state"] == "running"
