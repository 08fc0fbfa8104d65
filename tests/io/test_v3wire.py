"""petctl/io/store/v3wire.py without an etcd: the protobuf codec against encodings worked out by hand
from the wire format's rules, gRPC's framing and status, and what a failed call means to a store caller
(petctl/io/store/v3.py's `store_error`). The contract suite (test_store_contract.py) runs it on etcd."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from petctl.core.store import LeaseExpired, StoreDenied, StoreUnavailable
from petctl.io.store import v3wire as w
from petctl.io.store.v3 import store_error

# --- the codec: bytes worked out by hand (tag = number << 3 | wire type; varints 7 bits a byte, low first)


def test_a_put_request_encodes_field_by_field() -> None:
    request = w.PutRequest(key=b"/a", value=b"1", lease=150)
    # key: field 1 LEN (0x0a), 2 bytes; value: field 2 LEN (0x12), 1 byte; lease: field 3 varint (0x18),
    # 150 = 0b1_0010110 -> 0x96 0x01
    assert w.encode(request) == b"\x0a\x02/a\x12\x011\x18\x96\x01"
    assert w.decode(w.PutRequest, w.encode(request)) == request


def test_zero_values_are_not_sent_and_an_empty_message_is_no_bytes() -> None:
    assert w.encode(w.PutRequest()) == b""
    assert w.encode(w.Empty()) == b""
    assert w.encode(w.RangeRequest(key=b"k", count_only=False, limit=0)) == b"\x0a\x01k"


def test_a_negative_int64_is_ten_bytes_of_twos_complement() -> None:
    encoded = w.encode(w.LeaseGrantRequest(TTL=-1))
    assert encoded == b"\x08" + b"\xff" * 9 + b"\x01"
    assert w.decode(w.LeaseTimeToLiveResponse, b"\x18" + b"\xff" * 9 + b"\x01").TTL == -1


def test_a_oneof_member_is_sent_even_when_it_is_zero() -> None:
    """create compares `create_revision == 0` ("the key does not exist"): the 0 must be on the wire."""
    compare = w.Compare(result=w.CompareResult.EQUAL, target=w.CompareTarget.CREATE, key=b"k",
                        create_revision=0)
    # result EQUAL (0) is not sent; target 1 -> 0x10 0x01; key -> 0x1a 0x01 'k'; create_revision (field 5
    # varint) 0 -> 0x28 0x00
    assert w.encode(compare) == b"\x10\x01\x1a\x01k\x28\x00"
    mod = w.Compare(target=w.CompareTarget.MOD, key=b"k", mod_revision=7)
    assert w.encode(mod) == b"\x10\x02\x1a\x01k\x30\x07"
    assert w.decode(w.Compare, w.encode(compare)).create_revision == 0
    assert w.decode(w.Compare, w.encode(compare)).mod_revision is None


def test_a_field_number_above_15_takes_a_two_byte_tag() -> None:
    # range_end is field 64: (64 << 3) | 2 = 514 = 0b100_0000010 -> 0x82 0x04
    assert w.encode(w.Compare(range_end=b"z")) == b"\x82\x04\x01z"


def test_nested_and_repeated_messages() -> None:
    put = w.PutRequest(key=b"k")  # 0a 01 6b
    txn = w.TxnRequest(compare=[w.Compare(key=b"k", version=1)], success=[w.RequestOp(request_put=put)])
    # compare: field 1 LEN [key 1a 01 6b, version 20 01]; success: field 2 LEN [request_put 12 03 0a 01 6b]
    assert w.encode(txn) == b"\x0a\x05\x1a\x01k\x20\x01" + b"\x12\x05\x12\x03\x0a\x01k"
    assert w.decode(w.TxnRequest, w.encode(txn)) == txn


def test_a_range_response_decodes_and_unknown_fields_are_skipped() -> None:
    # key, create_revision 2, mod_revision 3, version 1, value, lease 5
    kv = b"\x0a\x02/a\x10\x02\x18\x03\x20\x01\x2a\x01v\x30\x05"
    unknown = (b"\x78\x2a"  # field 15 varint 42
               b"\xa2\x01\x03abc"  # field 20 LEN "abc"
               b"\x49" + b"\x00" * 8 +  # field 9 fixed64
               b"\x55" + b"\x00" * 4)  # field 10 fixed32
    header = b"\x08\x01\x18\x09" + b"\x40\x07"  # cluster_id 1, revision 9, field 8 (not ResponseHeader's)
    data = b"\x0a" + bytes([len(header)]) + header + unknown + b"\x12" + bytes([len(kv)]) + kv + b"\x20\x01"
    response = w.decode(w.RangeResponse, data)
    assert response.header == w.ResponseHeader(cluster_id=1, revision=9)
    assert response.kvs == [w.KeyValue(key=b"/a", create_revision=2, mod_revision=3, version=1, value=b"v",
                                       lease=5)]
    assert response.count == 1 and response.more is False


def test_an_unsigned_64_bit_id_stays_unsigned() -> None:
    member = 17779640114142230103  # above 2**63: an etcd member ID
    header = w.ResponseHeader(member_id=member, revision=-2)
    assert w.decode(w.ResponseHeader, w.encode(header)) == header


def test_a_watch_response_round_trips() -> None:
    response = w.WatchResponse(
        header=w.ResponseHeader(revision=12), watch_id=0, created=True, canceled=True, compact_revision=3,
        cancel_reason="etcdserver: permission denied",
        events=[w.Event(type=w.EventType.PUT, kv=w.KeyValue(key=b"a", value=b"\xff\x00", mod_revision=11)),
                w.Event(type=w.EventType.DELETE, kv=w.KeyValue(key=b"b", mod_revision=12))])
    assert w.decode(w.WatchResponse, w.encode(response)) == response


def test_auth_messages_round_trip() -> None:
    grant = w.AuthRoleGrantPermissionRequest(name="job-a-00000001", perm=w.Permission(
        permType=w.PermissionType.READWRITE, key=b"/petctl/jobs/a/", range_end=b"/petctl/jobs/a0"))
    assert w.decode(w.AuthRoleGrantPermissionRequest, w.encode(grant)) == grant
    add = w.AuthUserAddRequest(name="u", options=w.UserAddOptions(no_password=True))
    assert w.encode(add) == b"\x0a\x01u\x1a\x02\x08\x01"
    users = w.AuthUserListResponse(users=["root", "job-a-00000001"])
    assert w.decode(w.AuthUserListResponse, w.encode(users)).users == ["root", "job-a-00000001"]


class Packed(w.Message):
    numbers: list[int] = w.pb(1, "int64", repeated=True)
    flags: list[int] = w.pb(2, "enum", repeated=True)


def test_repeated_scalars_decode_packed_or_not() -> None:
    assert w.decode(Packed, b"\x0a\x03\x01\x96\x01").numbers == [1, 150]  # packed: one LEN field
    assert w.decode(Packed, b"\x08\x01\x08\x02").numbers == [1, 2]  # one field each
    assert w.encode(Packed(flags=[1, 2])) == b"\x10\x01\x10\x02"


@pytest.mark.parametrize("data, message", [
    (b"\x08", "truncated varint"),
    (b"\x08" + b"\xff" * 10 + b"\x01", "longer than ten bytes"),
    (b"\x0a\x05ab", "5 bytes announced, 2 left"),
    (b"\x0b", "unsupported wire type 3"),
    (b"\x49\x00", "truncated fixed-width"),
    (b"\x08\x01", "expected bytes"),  # key (bytes) sent as a varint
])
def test_bytes_that_are_no_encoding_raise_wire_error(data: bytes, message: str) -> None:
    with pytest.raises(w.WireError, match=message):
        w.decode(w.PutRequest, data)


def test_a_message_refuses_a_field_it_does_not_have() -> None:
    with pytest.raises(TypeError, match="no field nope"):
        w.PutRequest(nope=1)


@pytest.mark.parametrize("prefix, end", [(b"/a/", b"/a0"), (b"a\xff", b"b"), (b"\xff\xff", b"\0"),
                                         (b"", b"\0")])
def test_prefix_range_end(prefix: bytes, end: bytes) -> None:
    assert w.prefix_range_end(prefix) == end


# --- gRPC: framing, deadlines, status


def test_a_message_is_framed_with_its_length() -> None:
    assert w.frame(b"abc") == b"\x00\x00\x00\x00\x03abc"


@pytest.mark.parametrize("seconds, value", [(5.0, b"5000m"), (0.0001, b"1m"), (0.0015, b"2m"),
                                            (200_000.0, b"200000S")])
def test_grpc_timeout_is_eight_digits_and_a_unit(seconds: float, value: bytes) -> None:
    assert w.grpc_timeout(seconds) == value


OK = {b":status": b"200", b"content-type": b"application/grpc"}


@pytest.mark.parametrize("headers, trailers, code, detail", [
    (OK, {b"grpc-status": b"0"}, None, None),
    ({**OK, b"grpc-status": b"0"}, None, None, None),  # trailers-only
    (OK, {b"grpc-status": b"7", b"grpc-message": b"etcdserver: permission denied"}, 7,
     "etcdserver: permission denied"),
    ({**OK, b"grpc-status": b"5", b"grpc-message": b"etcdserver: requested lease not found"}, None, 5,
     "etcdserver: requested lease not found"),
    (OK, {b"grpc-status": b"9", b"grpc-message": b"caf%C3%A9 50%25%0Adone"}, 9, "café 50%\ndone"),
    (OK, {}, 13, "the response ended without a grpc-status"),
    (OK, {b"grpc-status": b"x"}, 2, "grpc-status 'x'"),
    ({b":status": b"503"}, None, 14, "HTTP status 503"),
    ({b":status": b"403"}, None, 7, "HTTP status 403"),
    ({b":status": b"500"}, None, 2, "HTTP status 500"),
])
def test_call_status(headers: dict[bytes, bytes], trailers: dict[bytes, bytes] | None, code: int | None,
                     detail: str | None) -> None:
    error = w.call_status(headers, trailers)
    if code is None:
        assert error is None
    else:
        assert error is not None and (error.code, error.detail) == (code, detail)


class _Conn:
    def __init__(self) -> None:
        self.cancelled: list[Any] = []

    def cancel(self, stream: w.Stream) -> None:
        self.cancelled.append(stream)
        stream.fail(w.GrpcError(w.Status.CANCELLED, "cancelled"))


def test_a_stream_reassembles_messages_split_anyhow_and_ends_with_its_status() -> None:
    async def scenario() -> None:
        stream = w.Stream(_Conn(), 1, "/etcdserverpb.Lease/LeaseKeepAlive")  # type: ignore[arg-type]
        data = b"".join(w.frame(w.encode(w.LeaseKeepAliveResponse(ID=i, TTL=10))) for i in (1, 2, 3))
        stream.on_headers(OK)
        for i in range(len(data)):  # a byte a DATA frame
            stream.on_data(data[i:i + 1])
        stream.on_headers({b"grpc-status": b"14", b"grpc-message": b"etcdserver%3A leader changed"})
        stream.on_end()
        assert [(await stream.recv(w.LeaseKeepAliveResponse)).ID for _ in range(3)] == [1, 2, 3]
        with pytest.raises(w.GrpcError) as caught:
            await stream.recv(w.LeaseKeepAliveResponse)
        assert caught.value.code == w.Status.UNAVAILABLE
        assert caught.value.detail == "etcdserver: leader changed"
        assert caught.value.method == "/etcdserverpb.Lease/LeaseKeepAlive"

    asyncio.run(scenario())


def test_a_stream_ended_ok_reads_none_and_a_bad_message_is_internal() -> None:
    async def scenario() -> None:
        stream = w.Stream(_Conn(), 1, "/m")  # type: ignore[arg-type]
        stream.on_headers(OK)
        stream.on_data(w.frame(b"\x0b"))
        stream.on_headers({b"grpc-status": b"0"})
        stream.on_end()
        with pytest.raises(w.GrpcError, match="INTERNAL") as caught:
            await stream.recv(w.PutResponse)
        assert caught.value.code == w.Status.INTERNAL
        assert await stream.recv(w.PutResponse) is None
        conn = _Conn()
        compressed = w.Stream(conn, 3, "/m")  # type: ignore[arg-type]
        compressed.on_data(b"\x01\x00\x00\x00\x00")
        assert conn.cancelled == [compressed]
        with pytest.raises(w.GrpcError, match="compressed"):
            await compressed.recv(w.PutResponse)

    asyncio.run(scenario())


# --- what a failed call means to a store caller


@pytest.mark.parametrize("error, kind", [
    (w.GrpcError(w.Status.PERMISSION_DENIED, "etcdserver: permission denied"), StoreDenied),
    (w.GrpcError(w.Status.UNAUTHENTICATED, "etcdserver: invalid auth token"), StoreDenied),
    (w.GrpcError(w.Status.INVALID_ARGUMENT, "etcdserver: user name not found"), StoreDenied),
    (w.GrpcError(w.Status.UNKNOWN, "etcdserver: authentication failed, invalid user ID or password"),
     StoreDenied),
    (w.GrpcError(w.Status.NOT_FOUND, "etcdserver: requested lease not found"), LeaseExpired),
    (w.GrpcError(w.Status.NOT_FOUND, "something else"), StoreUnavailable),
    (w.GrpcError(w.Status.UNAVAILABLE, "no etcd member answered"), StoreUnavailable),
    (w.GrpcError(w.Status.DEADLINE_EXCEEDED, ""), StoreUnavailable),
    (w.GrpcError(w.Status.INTERNAL, "a PutResponse that does not decode"), StoreUnavailable),
    (TimeoutError(), StoreUnavailable),
    (ConnectionRefusedError(111, "refused"), StoreUnavailable),
])
def test_store_error_maps_a_failed_call(error: BaseException, kind: type) -> None:
    mapped = store_error(error, "get /k")
    assert type(mapped) is kind and str(mapped).startswith("get /k: ")


def test_store_error_leaves_a_bug_alone() -> None:
    assert store_error(ValueError("a bug"), "get /k") is None
    assert store_error(w.WireError("a bug too: a decode outside a call"), "get /k") is None


def test_grpc_error_carries_its_code_and_detail() -> None:
    error = w.GrpcError(7, "etcdserver: permission denied", "/etcdserverpb.KV/Range")
    assert (error.code, error.name, error.detail) == (7, "PERMISSION_DENIED", "etcdserver: permission denied")
    assert str(error) == "PERMISSION_DENIED: etcdserver: permission denied"
    assert w.GrpcError(99, "").name == "status 99"
