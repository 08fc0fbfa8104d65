"""etcd's v3 gRPC API spoken directly over HTTP/2: gRPC's framing, etcd's protobuf messages, on asyncio.

Why not grpcio and a generated client (etcd3aio, before this module): importing grpc, protobuf and the
generated modules cost an agent about 0.13 s of CPU at every start, a third of what it spends from launch
to being ranked, and gRPC runs threads of its own in every process. This module is the part of gRPC
petctl uses, on petctl's own HTTP/2 framing (petctl/io/store/http2.py, with `hpack` for etcd's header
blocks):
- a protobuf codec for exactly the etcd messages petctl sends and reads (`Message`, `encode`,
  `decode`): proto3 wire format, field numbers from etcd 3.5's rpc.proto, kv.proto and auth.proto.
  Unknown fields are skipped, so a newer etcd's additions do not break it;
- gRPC over one HTTP/2 connection per `Channel` (unary calls and bidirectional streams, each an HTTP/2
  stream; a 5-byte length prefix per message; the status from the trailers): TLS with a client
  certificate and ALPN h2, or h2c with prior knowledge on etcd's plain port;
- members: the channel talks to one member at a time and moves to the next when a connection cannot
  be made or is lost. After every member failed it refuses calls at once (UNAVAILABLE) for a backoff
  of 0.1 s doubling to 1 s, then tries again: a restarted etcd is used again within about a second;
- a lost connection fails its streams with UNAVAILABLE. It is found lost by the socket, by etcd's
  GOAWAY, or by a PING that gets no answer within PING_TIMEOUT: sent every KEEPALIVE_INTERVAL while
  streams are open (a watch on a silent network), and at once when a call times out.
Everything here runs on one asyncio loop; nothing is thread-safe.
"""

from __future__ import annotations

import asyncio
import enum
import math
import os
import ssl
import urllib.parse
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

from petctl.io.store import http2

M = TypeVar("M")

# --- The protobuf wire format (proto3), for declared messages.
#
# A message is a subclass of `Message` whose fields are class attributes declared with `pb(number,
# kind)`; `kind` is a scalar type's name (SCALARS) or another message class. proto3 rules: a scalar equal
# to its zero value is not sent; `optional=True` gives a field presence (default None, sent whenever set,
# zero included: the members of a `oneof`); a nested message is sent when it is not None;
# `repeated=True` is a list. Not dataclasses: forty of them cost 80 ms to import, as much as grpc.

VARINT, I64, LEN, I32 = 0, 1, 2, 5
SCALARS = {"int64": 0, "uint64": 0, "int32": 0, "uint32": 0, "enum": 0, "bool": False, "bytes": b"",
           "string": ""}
_SIGNED = frozenset({"int64", "int32", "enum"})


class WireError(ValueError):
    """Bytes that are not the protobuf encoding of the message expected."""


class _Field(NamedTuple):
    name: str
    number: int
    kind: Any  # a SCALARS name or a message class
    repeated: bool
    optional: bool
    default: Any


class _Declared(NamedTuple):
    number: int
    kind: Any
    repeated: bool
    optional: bool


def pb(number: int, kind: Any, *, repeated: bool = False, optional: bool = False) -> Any:
    """A message field: protobuf field `number` of `kind` (see above)."""
    if isinstance(kind, str) and kind not in SCALARS:
        raise TypeError(f"unknown protobuf kind {kind!r}")
    return _Declared(number, kind, repeated, optional)


class Message:
    """A protobuf message: keyword arguments set its fields, the others have their defaults (0, b"",
    "", False; None for a nested message or an optional field; [] for a repeated one)."""

    _pb_fields: tuple[_Field, ...] = ()
    _pb_numbers: dict[int, _Field] = {}  # noqa: RUF012 - per class, set once
    _pb_scalars: dict[str, Any] = {}  # noqa: RUF012
    _pb_lists: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fields = []
        for name, value in list(vars(cls).items()):
            if isinstance(value, _Declared):
                default = (None if value.repeated or value.optional or not isinstance(value.kind, str)
                           else SCALARS[value.kind])
                fields.append(_Field(name, *value, default))
                delattr(cls, name)
        cls._pb_fields = tuple(fields)
        cls._pb_numbers = {f.number: f for f in fields}
        cls._pb_scalars = {f.name: f.default for f in fields if not f.repeated}
        cls._pb_lists = tuple(f.name for f in fields if f.repeated)

    def __init__(self, **values: Any) -> None:
        state = self.__dict__
        state.update(self._pb_scalars)
        for name in self._pb_lists:
            state[name] = []
        unknown = values.keys() - state.keys()
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {', '.join(sorted(unknown))}")
        state.update(values)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in self._pb_fields
                          if getattr(self, f.name) not in (f.default, []))
        return f"{type(self).__name__}({shown})"


def _put_varint(value: int, out: bytearray) -> None:
    if value < 0:
        value += 1 << 64  # two's complement in ten bytes: how protobuf sends a negative int64/int32/enum
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _get_varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than ten bytes")


def _put_value(spec: _Field, value: Any, out: bytearray) -> None:
    kind = spec.kind
    if isinstance(kind, str):
        if kind == "bytes" or kind == "string":
            data = value.encode() if kind == "string" else value
            _put_varint(spec.number << 3 | LEN, out)
            _put_varint(len(data), out)
            out += data
        else:
            _put_varint(spec.number << 3 | VARINT, out)
            _put_varint(int(value), out)
    else:
        data = encode(value)
        _put_varint(spec.number << 3 | LEN, out)
        _put_varint(len(data), out)
        out += data


def encode(msg: Any) -> bytes:
    """`msg`'s protobuf encoding, fields in number order of declaration."""
    out = bytearray()
    for spec in type(msg)._pb_fields:
        value = getattr(msg, spec.name)
        if spec.repeated:
            for item in value:
                _put_value(spec, item, out)
        elif value is None:
            continue
        elif value or spec.optional or not isinstance(spec.kind, str):
            _put_value(spec, value, out)
    return bytes(out)


def _scalar(kind: str, raw: int) -> Any:
    if kind == "bool":
        return raw != 0
    if kind in _SIGNED and raw >= 1 << 63:
        return raw - (1 << 64)
    if kind == "int32" or kind == "enum" or kind == "uint32":  # protobuf keeps the low 32 bits
        raw &= 0xFFFFFFFF
        return raw - (1 << 32) if kind != "uint32" and raw >= 1 << 31 else raw
    return raw


def decode(cls: type[M], data: bytes | memoryview) -> M:
    """The message of type `cls` that `data` encodes; fields it does not declare are skipped. Raises
    WireError for bytes that are not a protobuf encoding, or a field of the wrong wire type."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    msg = cls.__new__(cls)
    state = msg.__dict__
    state.update(cls._pb_scalars)  # type: ignore[attr-defined]
    for name in cls._pb_lists:  # type: ignore[attr-defined]
        state[name] = []
    numbers = cls._pb_numbers  # type: ignore[attr-defined]
    pos, end = 0, len(view)
    while pos < end:
        key = view[pos]  # one byte for field numbers up to 15, the rest through _get_varint
        if key < 0x80:
            pos += 1
        else:
            key, pos = _get_varint(view, pos)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            raw, pos = _get_varint(view, pos)
        elif wire == LEN:
            size = view[pos] if pos < end else 0x80
            if size < 0x80:
                pos += 1
            else:
                size, pos = _get_varint(view, pos)
            if pos + size > end:
                raise WireError(f"field {number}: {size} bytes announced, {end - pos} left")
            raw, pos = view[pos:pos + size], pos + size
        elif wire == I64 or wire == I32:
            pos += 8 if wire == I64 else 4
            if pos > end:
                raise WireError(f"field {number}: truncated fixed-width value")
            raw = None
        else:
            raise WireError(f"field {number}: unsupported wire type {wire}")
        spec = numbers.get(number)
        if spec is None or number == 0:
            continue  # unknown: a field of a newer etcd
        kind = spec.kind
        if not isinstance(kind, str):
            if wire != LEN:
                raise WireError(f"field {number} ({spec.name}): wire type {wire}, expected a message")
            value = decode(kind, raw)
        elif kind == "bytes" or kind == "string":
            if wire != LEN:
                raise WireError(f"field {number} ({spec.name}): wire type {wire}, expected bytes")
            value = bytes(raw) if kind == "bytes" else str(raw, "utf-8")
        elif wire == VARINT:
            value = _scalar(kind, raw)
        elif wire == LEN and spec.repeated:  # a packed repeated scalar
            items, at = [], 0
            while at < len(raw):
                item, at = _get_varint(raw, at)
                items.append(_scalar(kind, item))
            state[spec.name].extend(items)
            continue
        else:
            raise WireError(f"field {number} ({spec.name}): wire type {wire}, expected a varint")
        if spec.repeated:
            state[spec.name].append(value)
        else:
            state[spec.name] = value
    return msg


def prefix_range_end(prefix: bytes) -> bytes:
    """The end of the key range of every key that starts with `prefix`: its last byte below 0xff plus
    one, what follows dropped; b"\\0" (every key from `prefix` on) when it is all 0xff."""
    for i in range(len(prefix) - 1, -1, -1):
        if prefix[i] < 0xFF:
            return prefix[:i] + bytes((prefix[i] + 1,))
    return b"\0"


# --- etcd's messages (etcd 3.5: api/etcdserverpb/rpc.proto, api/mvccpb/kv.proto, api/authpb/auth.proto),
# the fields petctl uses, by their proto names.

class ResponseHeader(Message):
    cluster_id: int = pb(1, "uint64")
    member_id: int = pb(2, "uint64")
    revision: int = pb(3, "int64")
    raft_term: int = pb(4, "uint64")


class HeaderResponse(Message):
    """Every response that carries only its header (PutResponse without prev_kv, LeaseRevokeResponse,
    the Auth calls' answers): the same bytes on the wire."""

    header: ResponseHeader | None = pb(1, ResponseHeader)


class KeyValue(Message):
    key: bytes = pb(1, "bytes")
    create_revision: int = pb(2, "int64")
    mod_revision: int = pb(3, "int64")
    version: int = pb(4, "int64")
    value: bytes = pb(5, "bytes")
    lease: int = pb(6, "int64")


class EventType(enum.IntEnum):
    PUT = 0
    DELETE = 1


class Event(Message):
    type: int = pb(1, "enum")
    kv: KeyValue | None = pb(2, KeyValue)
    prev_kv: KeyValue | None = pb(3, KeyValue)


class SortOrder(enum.IntEnum):
    NONE = 0
    ASCEND = 1
    DESCEND = 2


class SortTarget(enum.IntEnum):
    KEY = 0
    VERSION = 1
    CREATE = 2
    MOD = 3
    VALUE = 4


class RangeRequest(Message):
    key: bytes = pb(1, "bytes")
    range_end: bytes = pb(2, "bytes")
    limit: int = pb(3, "int64")
    revision: int = pb(4, "int64")
    sort_order: int = pb(5, "enum")
    sort_target: int = pb(6, "enum")
    serializable: bool = pb(7, "bool")
    keys_only: bool = pb(8, "bool")
    count_only: bool = pb(9, "bool")


class RangeResponse(Message):
    header: ResponseHeader | None = pb(1, ResponseHeader)
    kvs: list[KeyValue] = pb(2, KeyValue, repeated=True)
    more: bool = pb(3, "bool")
    count: int = pb(4, "int64")


class PutRequest(Message):
    key: bytes = pb(1, "bytes")
    value: bytes = pb(2, "bytes")
    lease: int = pb(3, "int64")
    prev_kv: bool = pb(4, "bool")


class PutResponse(Message):
    header: ResponseHeader | None = pb(1, ResponseHeader)
    prev_kv: KeyValue | None = pb(2, KeyValue)


class DeleteRangeRequest(Message):
    key: bytes = pb(1, "bytes")
    range_end: bytes = pb(2, "bytes")
    prev_kv: bool = pb(3, "bool")


class DeleteRangeResponse(Message):
    header: ResponseHeader | None = pb(1, ResponseHeader)
    deleted: int = pb(2, "int64")
    prev_kvs: list[KeyValue] = pb(3, KeyValue, repeated=True)


class RequestOp(Message):
    """One operation of a transaction: set exactly one field (a `oneof`)."""

    request_range: RangeRequest | None = pb(1, RangeRequest)
    request_put: PutRequest | None = pb(2, PutRequest)
    request_delete_range: DeleteRangeRequest | None = pb(3, DeleteRangeRequest)


class ResponseOp(Message):
    response_range: RangeResponse | None = pb(1, RangeResponse)
    response_put: PutResponse | None = pb(2, PutResponse)
    response_delete_range: DeleteRangeResponse | None = pb(3, DeleteRangeResponse)


class CompareResult(enum.IntEnum):
    EQUAL = 0
    GREATER = 1
    LESS = 2
    NOT_EQUAL = 3


class CompareTarget(enum.IntEnum):
    VERSION = 0
    CREATE = 1
    MOD = 2
    VALUE = 3
    LEASE = 4


class Compare(Message):
    """A transaction's guard. Set the one of version .. lease that `target` names (a `oneof`: sent even
    when it is 0, as `create_revision=0` for "the key does not exist")."""

    result: int = pb(1, "enum")
    target: int = pb(2, "enum")
    key: bytes = pb(3, "bytes")
    version: int | None = pb(4, "int64", optional=True)
    create_revision: int | None = pb(5, "int64", optional=True)
    mod_revision: int | None = pb(6, "int64", optional=True)
    value: bytes | None = pb(7, "bytes", optional=True)
    lease: int | None = pb(8, "int64", optional=True)
    range_end: bytes = pb(64, "bytes")


class TxnRequest(Message):
    compare: list[Compare] = pb(1, Compare, repeated=True)
    success: list[RequestOp] = pb(2, RequestOp, repeated=True)
    failure: list[RequestOp] = pb(3, RequestOp, repeated=True)


class TxnResponse(Message):
    header: ResponseHeader | None = pb(1, ResponseHeader)
    succeeded: bool = pb(2, "bool")
    responses: list[ResponseOp] = pb(3, ResponseOp, repeated=True)


class WatchCreateRequest(Message):
    key: bytes = pb(1, "bytes")
    range_end: bytes = pb(2, "bytes")
    start_revision: int = pb(3, "int64")
    progress_notify: bool = pb(4, "bool")
    prev_kv: bool = pb(6, "bool")
    watch_id: int = pb(7, "int64")
    fragment: bool = pb(8, "bool")


class WatchRequest(Message):
    create_request: WatchCreateRequest | None = pb(1, WatchCreateRequest)


class WatchResponse(Message):
    header: ResponseHeader | None = pb(1, ResponseHeader)
    watch_id: int = pb(2, "int64")
    created: bool = pb(3, "bool")
    canceled: bool = pb(4, "bool")
    compact_revision: int = pb(5, "int64")
    cancel_reason: str = pb(6, "string")
    fragment: bool = pb(7, "bool")
    events: list[Event] = pb(11, Event, repeated=True)


class LeaseGrantRequest(Message):
    TTL: int = pb(1, "int64")
    ID: int = pb(2, "int64")


class LeaseGrantResponse(Message):
    header: ResponseHeader | None = pb(1, ResponseHeader)
    ID: int = pb(2, "int64")
    TTL: int = pb(3, "int64")
    error: str = pb(4, "string")


class LeaseRevokeRequest(Message):
    ID: int = pb(1, "int64")


class LeaseKeepAliveRequest(Message):
    ID: int = pb(1, "int64")


class LeaseKeepAliveResponse(Message):
    header: ResponseHeader | None = pb(1, ResponseHeader)
    ID: int = pb(2, "int64")
    TTL: int = pb(3, "int64")


class LeaseTimeToLiveRequest(Message):
    ID: int = pb(1, "int64")
    keys: bool = pb(2, "bool")


class LeaseTimeToLiveResponse(Message):
    header: ResponseHeader | None = pb(1, ResponseHeader)
    ID: int = pb(2, "int64")
    TTL: int = pb(3, "int64")
    grantedTTL: int = pb(4, "int64")  # noqa: N815 - the proto's name
    keys: list[bytes] = pb(5, "bytes", repeated=True)


class PermissionType(enum.IntEnum):
    READ = 0
    WRITE = 1
    READWRITE = 2


class Permission(Message):
    permType: int = pb(1, "enum")  # noqa: N815
    key: bytes = pb(2, "bytes")
    range_end: bytes = pb(3, "bytes")


class UserAddOptions(Message):
    no_password: bool = pb(1, "bool")


class Empty(Message):
    """A request with no fields (AuthUserListRequest, AuthStatusRequest, ...)."""


class AuthUserAddRequest(Message):
    name: str = pb(1, "string")
    password: str = pb(2, "string")
    options: UserAddOptions | None = pb(3, UserAddOptions)


class AuthUserDeleteRequest(Message):
    name: str = pb(1, "string")


class AuthUserGrantRoleRequest(Message):
    user: str = pb(1, "string")
    role: str = pb(2, "string")


class AuthRoleAddRequest(Message):
    name: str = pb(1, "string")


class AuthRoleDeleteRequest(Message):
    role: str = pb(1, "string")


class AuthRoleGetRequest(Message):
    role: str = pb(1, "string")


class AuthRoleGetResponse(Message):
    header: ResponseHeader | None = pb(1, ResponseHeader)
    perm: list[Permission] = pb(2, Permission, repeated=True)


class AuthRoleGrantPermissionRequest(Message):
    name: str = pb(1, "string")
    perm: Permission | None = pb(2, Permission)


class AuthUserListResponse(Message):
    header: ResponseHeader | None = pb(1, ResponseHeader)
    users: list[str] = pb(2, "string", repeated=True)


class AuthStatusResponse(Message):
    header: ResponseHeader | None = pb(1, ResponseHeader)
    enabled: bool = pb(2, "bool")
    authRevision: int = pb(3, "uint64")  # noqa: N815


class Rpc(NamedTuple, Generic[M]):  # type: ignore[misc]
    """One gRPC method: its path and the message type it answers with."""

    path: str
    response: type[M]


RANGE = Rpc("/etcdserverpb.KV/Range", RangeResponse)
PUT = Rpc("/etcdserverpb.KV/Put", PutResponse)
DELETE_RANGE = Rpc("/etcdserverpb.KV/DeleteRange", DeleteRangeResponse)
TXN = Rpc("/etcdserverpb.KV/Txn", TxnResponse)
WATCH = Rpc("/etcdserverpb.Watch/Watch", WatchResponse)
LEASE_GRANT = Rpc("/etcdserverpb.Lease/LeaseGrant", LeaseGrantResponse)
LEASE_REVOKE = Rpc("/etcdserverpb.Lease/LeaseRevoke", HeaderResponse)
LEASE_KEEPALIVE = Rpc("/etcdserverpb.Lease/LeaseKeepAlive", LeaseKeepAliveResponse)
LEASE_TIME_TO_LIVE = Rpc("/etcdserverpb.Lease/LeaseTimeToLive", LeaseTimeToLiveResponse)
AUTH_STATUS = Rpc("/etcdserverpb.Auth/AuthStatus", AuthStatusResponse)
AUTH_ENABLE = Rpc("/etcdserverpb.Auth/AuthEnable", HeaderResponse)
USER_ADD = Rpc("/etcdserverpb.Auth/UserAdd", HeaderResponse)
USER_DELETE = Rpc("/etcdserverpb.Auth/UserDelete", HeaderResponse)
USER_LIST = Rpc("/etcdserverpb.Auth/UserList", AuthUserListResponse)
USER_GRANT_ROLE = Rpc("/etcdserverpb.Auth/UserGrantRole", HeaderResponse)
ROLE_ADD = Rpc("/etcdserverpb.Auth/RoleAdd", HeaderResponse)
ROLE_DELETE = Rpc("/etcdserverpb.Auth/RoleDelete", HeaderResponse)
ROLE_GET = Rpc("/etcdserverpb.Auth/RoleGet", AuthRoleGetResponse)
ROLE_GRANT_PERMISSION = Rpc("/etcdserverpb.Auth/RoleGrantPermission", HeaderResponse)


# --- gRPC's status: a call's outcome, in the trailers.

class Status(enum.IntEnum):
    """gRPC's status codes (grpc/doc/statuscodes.md)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class GrpcError(Exception):
    """A call that did not end with OK: etcd's status (`code`, gRPC's number; `detail`, its message
    percent-decoded), or one this client gives: UNAVAILABLE for a connection that could not be made or
    was lost, INTERNAL for a response that is not gRPC or not the message expected."""

    def __init__(self, code: int, detail: str, method: str = "") -> None:
        self.code = code
        self.detail = detail
        self.method = method
        super().__init__(f"{self.name}: {detail}" if detail else self.name)

    @property
    def name(self) -> str:
        try:
            return Status(self.code).name
        except ValueError:
            return f"status {self.code}"


# HTTP statuses of a response that is not gRPC (a proxy's, say), as gRPC's own clients read them.
_HTTP_STATUS = {400: Status.INTERNAL, 401: Status.UNAUTHENTICATED, 403: Status.PERMISSION_DENIED,
                404: Status.UNIMPLEMENTED, 429: Status.UNAVAILABLE, 502: Status.UNAVAILABLE,
                503: Status.UNAVAILABLE, 504: Status.UNAVAILABLE}


def call_status(headers: dict[bytes, bytes], trailers: dict[bytes, bytes] | None) -> GrpcError | None:
    """The outcome of a call that ended with `headers` and `trailers` (None: a trailers-only response,
    whose status is in its headers): None for OK, else the GrpcError."""
    http = headers.get(b":status", b"")
    if http != b"200":
        code = _HTTP_STATUS.get(int(http) if http.isdigit() else 0, Status.UNKNOWN)
        return GrpcError(code, f"HTTP status {http.decode(errors='replace') or 'missing'}")
    status = (trailers if trailers is not None else headers).get(b"grpc-status")
    if status is None:
        return GrpcError(Status.INTERNAL, "the response ended without a grpc-status")
    if not status.isdigit():
        return GrpcError(Status.UNKNOWN, f"grpc-status {status.decode(errors='replace')!r}")
    if int(status) == Status.OK:
        return None
    detail = (trailers if trailers is not None else headers).get(b"grpc-message", b"")
    return GrpcError(int(status), urllib.parse.unquote(detail.decode("ascii", errors="replace")))


def grpc_timeout(seconds: float) -> bytes:
    """A grpc-timeout header's value: at most 8 digits and a unit, rounded up."""
    millis = max(1, math.ceil(seconds * 1000))
    if millis < 100_000_000:
        return f"{millis}m".encode()
    return f"{min(99_999_999, math.ceil(seconds))}S".encode()


def frame(payload: bytes) -> bytes:
    """One gRPC message on the wire: not compressed (0), its length (4 bytes, big-endian), itself."""
    return b"\0" + len(payload).to_bytes(4, "big") + payload


# --- One HTTP/2 connection, and the gRPC calls on it.

READ_SIZE = 65536
CONNECT_TIMEOUT = 3.0  # seconds to open a connection to one member (TCP and TLS) before trying the next
KEEPALIVE_INTERVAL = 10.0  # seconds between PINGs while streams are open (etcd allows one per 5 s)
PING_TIMEOUT = 5.0  # seconds a PING may go unanswered before the connection is taken for lost
RECONNECT_FIRST = 0.1  # seconds calls are refused after every member failed, doubling ...
RECONNECT_MAX = 1.0  # ... up to this (grpcio's own reaches 120 s: a restarted etcd would sit unused)


class Stream:
    """One gRPC call (an HTTP/2 stream): `send` messages, `recv` them, `cancel` when done."""

    def __init__(self, conn: Connection, stream_id: int, method: str) -> None:
        self._conn = conn
        self.stream_id = stream_id
        self.method = method
        self._inbox: asyncio.Queue[bytes | GrpcError | None] = asyncio.Queue()
        self._buffer = bytearray()
        self._headers: dict[bytes, bytes] | None = None
        self._trailers: dict[bytes, bytes] | None = None
        self.finished = False  # etcd ended it, or it failed, or it was cancelled

    async def send(self, msg: Any, end: bool = False) -> None:
        """Send one message (`end`: and close this side). Raises GrpcError (UNAVAILABLE when the
        connection is lost, or this call is over)."""
        if self.finished:
            raise GrpcError(Status.UNAVAILABLE, f"{self.method}: the call is over", self.method)
        await self._conn.send_data(self, frame(encode(msg)), end)

    async def recv(self, cls: type[M]) -> M | None:
        """The next message, as `cls`; None when etcd ended the call with OK. Raises GrpcError (its
        status, or UNAVAILABLE for a lost connection, INTERNAL for a message that does not decode)."""
        item = await self._inbox.get()
        if isinstance(item, GrpcError):
            self._inbox.put_nowait(item)  # every later recv sees it too
            raise item
        if item is None:
            self._inbox.put_nowait(None)
            return None
        try:
            return decode(cls, item)
        except WireError as e:
            raise GrpcError(Status.INTERNAL, f"{self.method}: a {cls.__name__} that does not decode: {e}",
                            self.method) from e

    def cancel(self) -> None:
        """End the call now (RST_STREAM CANCEL) unless it is over; idempotent."""
        if not self.finished:
            self._conn.cancel(self)

    # the connection's side

    def on_headers(self, headers: dict[bytes, bytes]) -> None:
        if self._headers is None:
            self._headers = headers
        else:
            self._trailers = headers

    def on_data(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= 5:
            size = int.from_bytes(buffer[1:5], "big")
            if len(buffer) < 5 + size:
                break
            if buffer[0] != 0:
                self.fail(GrpcError(Status.INTERNAL, "a compressed message (none asked for)", self.method))
                self._conn.cancel(self)
                return
            self._inbox.put_nowait(bytes(buffer[5:5 + size]))
            del buffer[:5 + size]

    def on_end(self) -> None:
        if self.finished:
            return
        self.finished = True
        error = call_status(self._headers or {}, self._trailers)
        if error is None and self._buffer:
            error = GrpcError(Status.INTERNAL, "the call ended inside a message")
        if error is not None:
            error.method = self.method
        self._inbox.put_nowait(error)

    def fail(self, error: GrpcError) -> None:
        if not self.finished:
            self.finished = True
            self._inbox.put_nowait(error)


class Connection(asyncio.Protocol):
    """One HTTP/2 connection to one etcd member (an asyncio protocol: the loop hands it what the socket
    reads, with no reader task between), and the streams on it. `on_lost(self, error)` is called once
    when it is lost (or closed): every stream then has failed with `error`."""

    def __init__(self, scheme: str, authority: str, on_lost: Callable[[Connection, GrpcError], None]) -> None:
        self._scheme = scheme.encode()
        self.authority = authority
        self._on_lost = on_lost
        self._http2 = http2.ClientConnection()
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, Stream] = {}
        self._window_waiters: list[asyncio.Future[None]] = []
        self._drain: asyncio.Future[None] | None = None  # set while the transport's buffer is full
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._ping: asyncio.Future[None] | None = None
        self._keeping: asyncio.Task[None] | None = None
        self._blocks: dict[tuple[str, bytes | None], bytes] = {}  # request header blocks by (path, timeout)
        self.lost: GrpcError | None = None

    @property
    def usable(self) -> bool:
        return self.lost is None and self._transport is not None

    # asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._flush()
        self._keeping = asyncio.get_running_loop().create_task(self._keepalive())

    def data_received(self, data: bytes) -> None:
        if self.lost is None:
            self._receive(data)

    def eof_received(self) -> bool | None:
        self._lose(GrpcError(Status.UNAVAILABLE, f"{self.authority} closed the connection"))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        detail = (f"connection to {self.authority} lost: {exc!r}" if exc
                  else f"{self.authority} closed the connection")
        self._lose(GrpcError(Status.UNAVAILABLE, detail))
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    # the calls' side

    def _flush(self) -> None:
        data = self._http2.data_to_send()
        if data and self.lost is None and self._transport is not None:
            self._transport.write(data)

    def _header_block(self, path: str, timeout: float | None) -> bytes:
        deadline = grpc_timeout(timeout) if timeout is not None else None
        block = self._blocks.get((path, deadline))
        if block is None:
            block = b"".join(http2.literal(name, value) for name, value in (
                (b":method", b"POST"), (b":scheme", self._scheme), (b":path", path.encode()),
                (b":authority", self.authority.encode()), (b"content-type", b"application/grpc"),
                (b"te", b"trailers"), (b"user-agent", b"petctl-v3wire"),
                *(((b"grpc-timeout", deadline),) if deadline is not None else ())))
            if len(self._blocks) < 256:  # a few paths, and the store's one timeout: bounded anyway
                self._blocks[(path, deadline)] = block
        return block

    def open(self, path: str, timeout: float | None) -> Stream:
        """A new stream for the call `path`; its request headers are queued, and go out with its first
        message (one write). Raises GrpcError UNAVAILABLE when the connection is lost or has no stream
        left (etcd's limit)."""
        if self.lost is not None:
            raise GrpcError(self.lost.code, self.lost.detail, path)
        try:
            stream_id = self._http2.open(self._header_block(path, timeout))
        except http2.NoStreamAvailable as e:
            if e.exhausted:
                self._lose(GrpcError(Status.UNAVAILABLE, str(e)))
            raise GrpcError(Status.UNAVAILABLE, str(e), path) from None
        stream = Stream(self, stream_id, path)
        self._streams[stream_id] = stream
        return stream

    async def send_data(self, stream: Stream, data: bytes, end: bool) -> None:
        """Send `data` on `stream` as the peer's flow-control windows allow, waiting for them to open.
        Raises GrpcError UNAVAILABLE when the connection is lost or the stream ends meanwhile."""
        view = memoryview(data)
        while True:
            if self.lost is not None or stream.finished:
                error = self.lost or GrpcError(Status.UNAVAILABLE, "the call is over")
                raise GrpcError(error.code, error.detail, stream.method)
            window = self._http2.sendable(stream.stream_id)
            if window <= 0 and len(view):
                waiter = asyncio.get_running_loop().create_future()
                self._window_waiters.append(waiter)
                await waiter
                continue
            chunk, view = view[:window], view[window:]
            self._http2.send_data(stream.stream_id, bytes(chunk), end and not len(view))
            self._flush()
            if not len(view):
                return
            if self._drain is not None:
                await self._drain

    def cancel(self, stream: Stream) -> None:
        """Reset `stream` (CANCEL) and forget it; its waiting `recv` fails with CANCELLED."""
        stream.fail(GrpcError(Status.CANCELLED, "cancelled by this client", stream.method))
        if self._streams.pop(stream.stream_id, None) is not None and self.lost is None:
            self._http2.reset(stream.stream_id, http2.CANCEL)  # a no-op when etcd ended it first
            self._flush()

    def _wake_senders(self) -> None:
        waiters, self._window_waiters = self._window_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _receive(self, data: bytes) -> None:
        try:
            events = self._http2.receive(data)
        except http2.ProtocolError as e:
            self._flush()  # the GOAWAY
            self._lose(GrpcError(Status.UNAVAILABLE, f"connection to {self.authority} lost: {e}"))
            return
        streams = self._streams
        for event in events:
            kind = type(event)
            if kind is http2.Data:
                # its credit is handed back at once (http2.py): what arrives is queued for its reader
                stream = streams.get(event.stream_id)
                if stream is not None:
                    stream.on_data(event.data)
                    if event.end and not stream.finished:
                        del streams[event.stream_id]
                        stream.on_end()
            elif kind is http2.Headers:
                stream = streams.get(event.stream_id)
                if stream is not None:
                    stream.on_headers(event.headers)
                    if event.end:
                        del streams[event.stream_id]
                        stream.on_end()
            elif kind is http2.Reset:
                stream = streams.pop(event.stream_id, None)
                if stream is not None:
                    code = (Status.UNAVAILABLE if event.error_code == http2.REFUSED_STREAM
                            else Status.CANCELLED if event.error_code == http2.CANCEL
                            else Status.INTERNAL)
                    stream.fail(GrpcError(code, f"etcd reset the stream (error code {event.error_code})",
                                          stream.method))
                self._wake_senders()
            elif kind is http2.WindowOpened:
                self._wake_senders()
            elif kind is http2.PingAck:
                if self._ping is not None and not self._ping.done():
                    self._ping.set_result(None)
            elif kind is http2.GoAway:
                self._flush()
                self._lose(GrpcError(Status.UNAVAILABLE,
                                     f"{self.authority} ended the connection (GOAWAY, error code "
                                     f"{event.error_code})"))
                return
        self._flush()

    async def _keepalive(self) -> None:
        while self.lost is None:
            await asyncio.sleep(KEEPALIVE_INTERVAL)
            if self._streams:
                await self.probe()

    def probe_soon(self) -> None:
        """Check that etcd still answers on this connection (a call timed out): a PING, in the
        background; no answer within PING_TIMEOUT loses the connection."""
        if self.lost is None and self._ping is None:
            task = asyncio.get_running_loop().create_task(self.probe())
            task.add_done_callback(_retrieve)

    async def probe(self) -> None:
        """One PING (or wait for the one outstanding); the connection is lost when it gets no answer
        within PING_TIMEOUT."""
        if self.lost is not None:
            return
        if self._ping is None:
            self._ping = asyncio.get_running_loop().create_future()
            self._http2.ping(os.urandom(8))
            self._flush()
        ping = self._ping
        try:
            await asyncio.wait_for(asyncio.shield(ping), PING_TIMEOUT)
        except TimeoutError:
            self._lose(GrpcError(Status.UNAVAILABLE,
                                 f"{self.authority} did not answer a ping within {PING_TIMEOUT:.0f}s"))
        finally:
            if self._ping is ping and ping.done() or self.lost is not None:
                self._ping = None

    def _lose(self, error: GrpcError) -> None:
        if self.lost is not None:
            return
        self.lost = error
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(GrpcError(error.code, error.detail, stream.method))
        self._wake_senders()
        self.resume_writing()
        if self._transport is not None:
            self._transport.close()
        if self._keeping is not None and self._keeping is not asyncio.current_task():
            self._keeping.cancel()
        self._on_lost(self, error)

    async def close(self) -> None:
        """Close the connection (GOAWAY, then the socket); its streams fail with UNAVAILABLE."""
        if self.lost is None:
            self._http2.close()
            self._flush()
            self._lose(GrpcError(Status.UNAVAILABLE, "the connection was closed"))
        if self._keeping is not None:
            await asyncio.gather(self._keeping, return_exceptions=True)
        if self._transport is None:
            return
        try:
            async with asyncio.timeout(1.0):
                await asyncio.shield(self._closed)
        except TimeoutError:
            pass  # its TLS goodbye never came: the socket is closed either way


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # what a background probe raised is in the connection's state already


def client_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """A TLS context for etcd's gRPC port: its server certificate verified against `ca`, this client's
    certificate presented, HTTP/2 by ALPN. Raises OSError or ssl.SSLError for files that do not load."""
    context = ssl.create_default_context(cafile=ca)
    if cert is not None:
        context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2"])
    return context


def authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Channel:
    """gRPC calls to an etcd cluster, over one connection at a time to one of its `members` (see the
    module docstring). `tls`: a context from `client_context`, and every member's certificate is checked
    against `server_hostname`; None: h2c. Created anywhere; used on one running loop only."""

    def __init__(self, members: list[tuple[str, int]], tls: ssl.SSLContext | None = None,
                 server_hostname: str | None = None) -> None:
        if not members:
            raise ValueError("no etcd member to connect to")
        self.members = list(members)
        self._tls = tls
        self._server_hostname = server_hostname
        self._next = 0  # the member to try first
        self._conn: Connection | None = None
        self._connecting: asyncio.Future[Connection] | None = None
        self._backoff = RECONNECT_FIRST
        self._retry_at = 0.0
        self._refusal: GrpcError | None = None
        self._closed = False

    async def connection(self) -> Connection:
        """The open connection, or a new one (callers at the same time share one attempt). Raises
        GrpcError UNAVAILABLE when no member can be reached, or while the backoff after that lasts."""
        conn = self._conn
        if conn is not None and conn.usable:
            return conn
        if self._closed:
            raise GrpcError(Status.UNAVAILABLE, "the channel is closed")
        if self._connecting is None:
            loop = asyncio.get_running_loop()
            if self._refusal is not None and loop.time() < self._retry_at:
                raise GrpcError(self._refusal.code, self._refusal.detail)
            self._connecting = loop.create_task(self._connect())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)  # a caller cancelled leaves the attempt to others

    def _connected(self, attempt: asyncio.Future[Connection]) -> None:
        self._connecting = None
        if attempt.cancelled() or attempt.exception() is not None:
            return  # the error went to the callers waiting on it
        if self._closed:  # closed between the connection and this callback: nobody will use it
            task = asyncio.get_running_loop().create_task(attempt.result().close())
            task.add_done_callback(_retrieve)
            return
        self._conn = attempt.result()

    async def _connect(self) -> Connection:
        failures = []
        count = len(self.members)
        for i in range(count):
            index = (self._next + i) % count
            host, port = self.members[index]
            conn = Connection("https" if self._tls else "http", authority(host, port), self._lost)
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT):
                    tls = {"ssl": self._tls, "server_hostname": self._server_hostname,
                           "ssl_handshake_timeout": CONNECT_TIMEOUT} if self._tls else {}
                    transport, _ = await asyncio.get_running_loop().create_connection(
                        lambda: conn, host, port, **tls)  # noqa: B023 (awaited here, in this iteration)
            except (OSError, TimeoutError) as e:  # ssl.SSLError is an OSError
                failures.append(f"{authority(host, port)}: {e or type(e).__name__}")
                continue
            if self._tls is not None:
                protocol = transport.get_extra_info("ssl_object").selected_alpn_protocol()
                if protocol not in (None, "h2"):
                    await conn.close()
                    failures.append(f"{authority(host, port)}: ALPN chose {protocol!r}, not h2")
                    continue
            self._next = index
            self._backoff, self._refusal = RECONNECT_FIRST, None
            if self._closed:
                await conn.close()
                raise GrpcError(Status.UNAVAILABLE, "the channel is closed")
            return conn
        error = GrpcError(Status.UNAVAILABLE, "no etcd member answered: " + "; ".join(failures))
        self._refusal = error
        self._retry_at = asyncio.get_running_loop().time() + self._backoff
        self._backoff = min(self._backoff * 2, RECONNECT_MAX)
        raise error

    def _lost(self, conn: Connection, error: GrpcError) -> None:
        if self._conn is conn:
            self._conn = None
            self._next = (self._next + 1) % len(self.members)  # the next connection starts elsewhere

    async def open(self, rpc: Rpc, timeout: float | None = None) -> Stream:
        """A new call of `rpc` (a bidirectional stream; `timeout`: the deadline etcd is told, none for a
        stream kept open). Raises GrpcError UNAVAILABLE."""
        return (await self.connection()).open(rpc.path, timeout)

    async def unary(self, rpc: Rpc[M], request: Any, timeout: float | None = None) -> M:
        """One request, one response. Raises GrpcError (etcd's status, or UNAVAILABLE, INTERNAL: see
        GrpcError); a cancellation (the caller's timeout) resets the call and probes the connection."""
        stream = await self.open(rpc, timeout)
        try:
            await stream.send(request, end=True)
            response = await stream.recv(rpc.response)
            if response is None:
                raise GrpcError(Status.INTERNAL, "the call ended OK without a response", rpc.path)
            if await stream.recv(rpc.response) is not None:
                raise GrpcError(Status.INTERNAL, "more than one response to a unary call", rpc.path)
            return response
        except asyncio.CancelledError:
            if not stream.finished:
                stream._conn.probe_soon()
            raise
        finally:
            stream.cancel()

    async def close(self) -> None:
        """Close the connection; calls fail with UNAVAILABLE from now on. Idempotent."""
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

