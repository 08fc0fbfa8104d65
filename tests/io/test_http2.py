"""petctl/io/store/http2.py: the client side of HTTP/2 that the v3 store's gRPC runs on, frame by frame.

The server here is played with bytes: frames built by `http2.frame` and header blocks encoded by the
`hpack` package's encoder, as a Go server's would be (literals added to the table, then references).
Every test of the v3 store against a real etcd (tests/io/test_store_contract.py) runs over it too."""

from __future__ import annotations

import hpack
import pytest

from petctl.io.store import http2 as h

STATUS_OK = [(b":status", b"200"), (b"content-type", b"application/grpc")]
TRAILERS_OK = [(b"grpc-status", b"0"), (b"grpc-message", b"")]


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """The frames in `data` (the preface skipped): (type, flags, stream, payload)."""
    if data.startswith(h.PREFACE):
        data = data[len(h.PREFACE):]
    out = []
    while data:
        length = int.from_bytes(data[:3], "big")
        out.append((data[3], data[4], int.from_bytes(data[5:9], "big"), data[9:9 + length]))
        data = data[9 + length:]
    return out


def started() -> h.ClientConnection:
    conn = h.ClientConnection()
    conn.data_to_send()
    return conn


def opened(conn: h.ClientConnection) -> int:
    """A new stream of `conn`, its HEADERS taken off what is to send."""
    sid = conn.open(b"")
    conn.data_to_send()
    return sid


def test_a_connection_starts_with_the_preface_no_push_and_large_windows() -> None:
    out = h.ClientConnection().data_to_send()
    assert out.startswith(h.PREFACE)
    (settings_kind, _, zero, settings), (update_kind, _, zero2, increment) = frames(out)
    assert (settings_kind, zero, update_kind, zero2) == (h.SETTINGS, 0, h.WINDOW_UPDATE, 0)
    entries = {int.from_bytes(settings[i:i + 2], "big"): int.from_bytes(settings[i + 2:i + 6], "big")
               for i in range(0, len(settings), 6)}
    assert entries == {h.SETTINGS_ENABLE_PUSH: 0, h.SETTINGS_INITIAL_WINDOW_SIZE: h.STREAM_WINDOW}
    assert int.from_bytes(increment, "big") == h.CONNECTION_WINDOW - h.DEFAULT_WINDOW


def test_request_headers_are_literals_any_hpack_decoder_reads() -> None:
    long_value = b"x" * 300  # a length past the 7-bit prefix
    block = h.literal(b":path", b"/etcdserverpb.KV/Range") + h.literal(b"long", long_value)
    assert hpack.Decoder().decode(block, raw=True) == [(b":path", b"/etcdserverpb.KV/Range"),
                                                       (b"long", long_value)]
    assert h.hpack_int(126, 7) == b"\x7e" and h.hpack_int(127, 7) == b"\x7f\x00"
    assert h.hpack_int(1337, 5) == b"\x1f\x9a\x0a"  # RFC 7541 C.1.2


def test_a_unary_answer_is_headers_data_and_trailers_and_the_stream_is_then_forgotten() -> None:
    conn, server = started(), hpack.Encoder()
    sid = conn.open(h.literal(b":path", b"/m"))
    conn.send_data(sid, b"request", end=True)
    sent = frames(conn.data_to_send())
    assert [(kind, flags, stream) for kind, flags, stream, _ in sent] == [
        (h.HEADERS, h.END_HEADERS, sid), (h.DATA, h.END_STREAM, sid)]
    answer = (h.frame(h.HEADERS, h.END_HEADERS, sid, server.encode(STATUS_OK))
              + h.frame(h.DATA, 0, sid, b"response")
              + h.frame(h.HEADERS, h.END_HEADERS | h.END_STREAM, sid, server.encode(TRAILERS_OK)))
    events = conn.receive(answer)
    assert events == [h.Headers(sid, dict(STATUS_OK), False), h.Data(sid, b"response", False),
                      h.Headers(sid, dict(TRAILERS_OK), True)]
    assert conn.sendable(sid) == 0 and sid not in conn._streams
    conn.reset(sid)
    assert conn.data_to_send() == b""  # over already: nothing to reset
    assert conn.open(b"") == sid + 2  # odd, increasing


def test_frames_split_anywhere_give_the_same_events() -> None:
    conn, server = started(), hpack.Encoder()
    sid = conn.open(b"")
    answer = (h.frame(h.HEADERS, h.END_HEADERS, sid, server.encode(STATUS_OK))
              + h.frame(h.DATA, h.END_STREAM, sid, b"payload"))
    events = [event for i in range(len(answer)) for event in conn.receive(answer[i:i + 1])]
    assert events == [h.Headers(sid, dict(STATUS_OK), False), h.Data(sid, b"payload", True)]


def test_a_header_block_in_continuations_is_one_event_and_nothing_may_come_between() -> None:
    conn, server = started(), hpack.Encoder()
    sid = conn.open(b"")
    block = server.encode(STATUS_OK)
    events = conn.receive(h.frame(h.HEADERS, 0, sid, block[:2]) + h.frame(h.CONTINUATION, 0, sid, block[2:4])
                          + h.frame(h.CONTINUATION, h.END_HEADERS, sid, block[4:]))
    assert events == [h.Headers(sid, dict(STATUS_OK), False)]
    with pytest.raises(h.ProtocolError, match="broken up"):
        conn.receive(h.frame(h.HEADERS, 0, sid, block[:1]) + h.frame(h.PING, 0, 0, b"12345678"))
    assert frames(conn.data_to_send())[-1][0] == h.GOAWAY  # the server is told why


def test_padding_and_priority_are_stripped_and_padding_counts_as_credit() -> None:
    conn, server = started(), hpack.Encoder()
    sid = conn.open(b"")
    block = server.encode(STATUS_OK)
    padded_headers = bytes([3]) + b"\0" * 5 + block + b"\0\0\0"  # pad length, priority, block, padding
    padded_data = bytes([10]) + b"data" + b"\0" * 10
    events = conn.receive(h.frame(h.HEADERS, h.END_HEADERS | h.PADDED | h.PRIORITY_FLAG, sid, padded_headers)
                          + h.frame(h.DATA, h.PADDED, sid, padded_data))
    assert events == [h.Headers(sid, dict(STATUS_OK), False), h.Data(sid, b"data", False)]
    assert conn._unacked == len(padded_data)
    with pytest.raises(h.ProtocolError, match="padding"):
        conn.receive(h.frame(h.DATA, h.PADDED, sid, bytes([9]) + b"short"))


def test_credit_goes_back_once_half_a_window_is_used_on_the_stream_and_the_connection() -> None:
    conn = started()
    sid = opened(conn)
    chunk = b"x" * h.FRAME_SIZE
    per_stream = h.STREAM_WINDOW // 2 // h.FRAME_SIZE
    for _ in range(per_stream - 1):
        conn.receive(h.frame(h.DATA, 0, sid, chunk))
    assert conn.data_to_send() == b""  # short of half the stream's window: no update yet
    conn.receive(h.frame(h.DATA, 0, sid, chunk))
    assert frames(conn.data_to_send()) == [
        (h.WINDOW_UPDATE, 0, sid, (per_stream * h.FRAME_SIZE).to_bytes(4, "big"))]
    received = per_stream * h.FRAME_SIZE
    while received + h.FRAME_SIZE < h.CONNECTION_WINDOW // 2:
        conn.receive(h.frame(h.DATA, 0, 99, chunk))  # a stream this side reset: the connection's credit only
        received += h.FRAME_SIZE
    assert conn.data_to_send() == b""
    conn.receive(h.frame(h.DATA, 0, 99, chunk))
    assert frames(conn.data_to_send()) == [
        (h.WINDOW_UPDATE, 0, 0, (received + h.FRAME_SIZE).to_bytes(4, "big"))]


def test_sending_keeps_within_the_servers_windows_and_waits_for_them() -> None:
    conn = started()
    sid = opened(conn)
    assert conn.sendable(sid) == h.FRAME_SIZE  # a frame at most
    sent = 0
    while conn.sendable(sid):
        size = conn.sendable(sid)
        conn.send_data(sid, b"x" * size, end=False)
        sent += size
    assert sent == h.DEFAULT_WINDOW  # the connection's and the stream's first windows
    with pytest.raises(ValueError, match="do not fit"):
        conn.send_data(sid, b"x", end=False)
    conn.send_data(sid, b"", end=False)  # an empty frame always fits
    conn.data_to_send()
    assert conn.receive(h.frame(h.WINDOW_UPDATE, 0, 0, (100).to_bytes(4, "big"))) == [h.WindowOpened()]
    assert conn.sendable(sid) == 0  # the stream's own window is still shut
    settings = h.SETTINGS_INITIAL_WINDOW_SIZE.to_bytes(2, "big") + (h.DEFAULT_WINDOW + 50).to_bytes(4, "big")
    assert conn.receive(h.frame(h.SETTINGS, 0, 0, settings)) == [h.WindowOpened()]
    assert frames(conn.data_to_send()) == [(h.SETTINGS, h.ACK, 0, b"")]
    assert conn.sendable(sid) == 50  # the new initial window applies to the open stream
    conn.receive(h.frame(h.WINDOW_UPDATE, 0, sid, (1000).to_bytes(4, "big")))
    assert conn.sendable(sid) == 100  # now the connection's is the smaller
    conn.send_data(sid, b"x" * 100, end=True)
    with pytest.raises(ValueError, match="not open"):
        conn.send_data(sid, b"", end=True)


def test_the_servers_stream_limit_and_the_last_stream_id_refuse_a_new_stream() -> None:
    conn = started()
    limit = h.SETTINGS_MAX_CONCURRENT_STREAMS.to_bytes(2, "big") + (1).to_bytes(4, "big")
    conn.receive(h.frame(h.SETTINGS, 0, 0, limit))
    first = conn.open(b"")
    with pytest.raises(h.NoStreamAvailable) as caught:
        conn.open(b"")
    assert not caught.value.exhausted
    conn.reset(first)
    assert frames(conn.data_to_send())[-1] == (h.RST_STREAM, 0, first, h.CANCEL.to_bytes(4, "big"))
    conn._next_id = h.MAX_STREAM_ID + 2
    with pytest.raises(h.NoStreamAvailable) as caught:
        conn.open(b"")
    assert caught.value.exhausted


def test_pings_are_answered_and_acks_goaway_and_resets_are_events() -> None:
    conn = started()
    sid = opened(conn)
    assert conn.receive(h.frame(h.PING, 0, 0, b"abcdefgh")) == []
    assert frames(conn.data_to_send()) == [(h.PING, h.ACK, 0, b"abcdefgh")]
    conn.ping(b"mine")
    assert frames(conn.data_to_send()) == [(h.PING, 0, 0, b"mine\0\0\0\0")]
    assert conn.receive(h.frame(h.PING, h.ACK, 0, b"mine\0\0\0\0")) == [h.PingAck(b"mine\0\0\0\0")]
    assert conn.receive(h.frame(h.RST_STREAM, 0, sid, h.REFUSED_STREAM.to_bytes(4, "big"))) == [
        h.Reset(sid, h.REFUSED_STREAM)]
    assert conn.receive(h.frame(h.RST_STREAM, 0, sid, h.CANCEL.to_bytes(4, "big"))) == []  # forgotten
    goaway = (7).to_bytes(4, "big") + h.NO_ERROR.to_bytes(4, "big")
    assert conn.receive(h.frame(h.GOAWAY, 0, 0, goaway)) == [h.GoAway(h.NO_ERROR, 7)]
    assert conn.receive(h.frame(h.PRIORITY, 0, 1, b"\0" * 5) + h.frame(0xEE, 0, 0, b"?")) == []  # ignored


@pytest.mark.parametrize("bad, message", [
    (h.frame(h.PUSH_PROMISE, h.END_HEADERS, 1, b"\0\0\0\2"), "push"),
    (h.frame(h.DATA, 0, 0, b"x"), "stream 0"),
    (h.frame(h.WINDOW_UPDATE, 0, 0, b"\0\0\0\0"), "of 0"),
    (h.frame(h.SETTINGS, 0, 0, b"\0\4\x80\0\0\0"), "initial window"),
    (h.frame(h.PING, 0, 0, b"short"), "8 bytes"),
    (h.frame(h.HEADERS, h.END_HEADERS, 1, b"\xff\xff\xff\xff\x0f"), "does not decode"),
    ((h.FRAME_SIZE + 1).to_bytes(3, "big") + b"\0\0\0\0\0\1", "bytes"),
], ids=["push", "data_on_0", "zero_update", "window_too_large", "short_ping", "bad_hpack", "too_large"])
def test_what_a_server_must_not_send_is_a_protocol_error_and_a_goaway(bad: bytes, message: str) -> None:
    conn = started()
    conn.open(b"")
    with pytest.raises(h.ProtocolError, match=message):
        conn.receive(bad)
    assert frames(conn.data_to_send())[-1][:2] == (h.GOAWAY, 0)


def test_header_blocks_of_references_alone_are_remembered_only_while_the_table_stays() -> None:
    """etcd repeats the same two blocks once their fields are in its table; a block that adds to the
    table makes every remembered block mean something else."""
    conn, server = started(), hpack.Encoder()
    streams = [conn.open(b"") for _ in range(4)]
    first = server.encode(STATUS_OK)  # literals, added to the table
    again = server.encode(STATUS_OK)  # references to them
    assert first != again and all(b > 0x80 for b in again)
    assert conn.receive(h.frame(h.HEADERS, h.END_HEADERS, streams[0], first))[0].headers == dict(STATUS_OK)
    assert conn.receive(h.frame(h.HEADERS, h.END_HEADERS, streams[1], again))[0].headers == dict(STATUS_OK)
    assert again in conn._indexed
    other = server.encode([(b"x-new", b"1")])  # added at the top: the old references shift
    conn.receive(h.frame(h.HEADERS, h.END_HEADERS, streams[2], other))
    assert conn._indexed == {}
    shifted = server.encode(STATUS_OK)
    assert conn.receive(h.frame(h.HEADERS, h.END_HEADERS, streams[3], shifted))[0].headers == dict(STATUS_OK)
