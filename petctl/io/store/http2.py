"""The client side of one HTTP/2 connection (RFC 9113), as much of it as a gRPC client needs: no I/O.

Why petctl's own and not the `h2` package: h2 checks every frame through general state machines. With
it a v3 get cost the client process 0.878 ms of CPU, against 0.466 ms with this module, and a fleet of
nodes in one process saturated its loop at 64 nodes (bench/results/storecall-http2.json and
fleetreal-v3wire.json; bench/README.md, "HTTP/2 framing of petctl's own").

Header blocks are still HPACK: etcd's answers are decoded by the `hpack` package (Huffman codes and
the dynamic table), and requests are encoded here as literals that are never indexed, which needs no
table.

What it does, and what it refuses:
- sends the preface, its SETTINGS (no server push; a stream window of STREAM_WINDOW) and a connection
  window of CONNECTION_WINDOW; acknowledges the server's SETTINGS and answers its PINGs;
- opens streams with odd, increasing IDs (`open`), up to the server's MAX_CONCURRENT_STREAMS;
- sends DATA within the server's flow-control windows (`sendable`, `send_data`); the caller waits for
  a `WindowOpened` event when they are shut;
- hands back received DATA's flow-control credit as it arrives: the caller queues what arrives for its
  reader and never leaves it in the window, so a long watch stream never stalls. The credit goes back
  in one WINDOW_UPDATE once half a window is used, not one per frame;
- turns frames into events: `Headers`, `Data` (each with `end` for END_STREAM), `Reset`,
  `WindowOpened`, `PingAck`, `GoAway`;
- raises ProtocolError for what a server must not send (a frame too large, a push, a header block
  broken up by another frame, a header block that does not decode): the connection is then unusable.

Frames for a stream this side already reset still count toward the connection's window, and their
header blocks are still decoded, so the HPACK table stays in step with the server's.
"""

from __future__ import annotations

from typing import NamedTuple

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
(DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE,
 CONTINUATION) = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x4, 0x5
NO_ERROR, PROTOCOL_ERROR, CANCEL, REFUSED_STREAM = 0x0, 0x1, 0x8, 0x7

DEFAULT_WINDOW = 65535  # RFC 9113 6.9.2: every window before SETTINGS or WINDOW_UPDATE changes it
MAX_WINDOW = 2**31 - 1
MAX_STREAM_ID = 2**31 - 1
FRAME_SIZE = 16384  # the largest frame this side accepts (the default; it never asks for more)
STREAM_WINDOW = 1 << 20  # what etcd may send on one stream before this side hands credit back
CONNECTION_WINDOW = 1 << 24  # ... and on the whole connection


class ProtocolError(Exception):
    """The server broke HTTP/2 (or sent what this client refused in its SETTINGS): the connection is
    unusable; a GOAWAY is queued in `data_to_send`."""


class NoStreamAvailable(Exception):
    """No stream can be opened now: `exhausted` when every stream ID of the connection is used (a new
    connection is needed), else the server's limit of concurrent streams is reached."""

    def __init__(self, message: str, exhausted: bool) -> None:
        super().__init__(message)
        self.exhausted = exhausted


class Headers(NamedTuple):
    stream_id: int
    headers: dict[bytes, bytes]
    end: bool


class Data(NamedTuple):
    stream_id: int
    data: bytes
    end: bool


class Reset(NamedTuple):
    stream_id: int
    error_code: int


class WindowOpened(NamedTuple):
    """The server opened a flow-control window: a sender waiting on one may go on."""


class PingAck(NamedTuple):
    payload: bytes


class GoAway(NamedTuple):
    error_code: int
    last_stream_id: int


Event = Headers | Data | Reset | WindowOpened | PingAck | GoAway


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame: its 9-byte header (length, type, flags, stream ID), then `payload`."""
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big")
            + payload)


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) in a prefix of `prefix_bits` bits; `first` holds the bits above
    the prefix in the first byte."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """One header as a literal never indexed, with a literal name (RFC 7541 6.2.3): no table needed on
    either side, and no Huffman coding."""
    return b"\x10" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


class Stream(NamedTuple):
    """What this side tracks of an open stream: its send window, and whether each side has ended it."""

    window: list[int]  # one cell: the send window, changed in place
    local_ended: list[bool]


class ClientConnection:
    """One HTTP/2 connection's state, client side. Feed it what the socket read (`receive`), call its
    senders, and write `data_to_send()` to the socket after each. Not thread-safe."""

    def __init__(self) -> None:
        self._out = bytearray(PREFACE)
        self._out += frame(SETTINGS, 0, 0, SETTINGS_ENABLE_PUSH.to_bytes(2, "big") + (0).to_bytes(4, "big")
                           + SETTINGS_INITIAL_WINDOW_SIZE.to_bytes(2, "big")
                           + STREAM_WINDOW.to_bytes(4, "big"))
        self._out += frame(WINDOW_UPDATE, 0, 0, (CONNECTION_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big"))
        self._decoder = hpack.Decoder()
        # Header blocks of one-byte table references, and what they decoded to while the table stayed as
        # it is: etcd answers every call with the same two blocks once their fields are in its table.
        self._indexed: dict[bytes, dict[bytes, bytes]] = {}
        self._buffer = bytearray()
        self._next_id = 1
        self._streams: dict[int, Stream] = {}
        self._send_window = DEFAULT_WINDOW  # the connection's, for what this side sends
        self._stream_initial = DEFAULT_WINDOW  # the server's SETTINGS_INITIAL_WINDOW_SIZE
        self.max_frame_size = FRAME_SIZE  # the server's SETTINGS_MAX_FRAME_SIZE: the largest DATA to send
        self._max_streams = MAX_STREAM_ID  # the server's SETTINGS_MAX_CONCURRENT_STREAMS
        self._unacked = 0  # received on the connection, credit not yet handed back
        self._unacked_streams: dict[int, int] = {}
        self._header_block: tuple[int, int, bytearray] | None = None  # (stream, flags, block so far)

    def data_to_send(self) -> bytes:
        """What to write to the socket now (and forget)."""
        out = bytes(self._out)
        self._out.clear()
        return out

    # --- sending

    def open(self, header_block: bytes) -> int:
        """A new stream, its request headers sent (`header_block`: HPACK, see `literal`). Returns its ID.
        Raises NoStreamAvailable."""
        if self._next_id > MAX_STREAM_ID:
            raise NoStreamAvailable("the connection has used every stream ID", exhausted=True)
        if len(self._streams) >= self._max_streams:
            raise NoStreamAvailable("etcd's limit of open streams is reached", exhausted=False)
        if len(header_block) > self.max_frame_size:
            raise ValueError(f"a header block of {len(header_block)} bytes (one frame at most)")
        stream_id = self._next_id
        self._next_id += 2
        self._streams[stream_id] = Stream([self._stream_initial], [False])
        self._out += frame(HEADERS, END_HEADERS, stream_id, header_block)
        return stream_id

    def sendable(self, stream_id: int) -> int:
        """How many bytes of DATA `stream_id` may send now (at most one frame's); 0 when its windows are
        shut or it is no longer open."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.local_ended[0]:
            return 0
        return max(0, min(self._send_window, stream.window[0], self.max_frame_size))

    def send_data(self, stream_id: int, data: bytes, end: bool) -> None:
        """One DATA frame (`end`: END_STREAM too). `data` must fit `sendable(stream_id)`; empty data
        may always be sent to end a stream. Raises ValueError when it does not fit or the stream is not
        open."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.local_ended[0]:
            raise ValueError(f"stream {stream_id} is not open for sending")
        if len(data) > self.sendable(stream_id):
            raise ValueError(f"{len(data)} bytes do not fit the window ({self.sendable(stream_id)})")
        self._send_window -= len(data)
        stream.window[0] -= len(data)
        self._out += frame(DATA, END_STREAM if end else 0, stream_id, data)
        if end:
            stream.local_ended[0] = True

    def reset(self, stream_id: int, error_code: int = CANCEL) -> None:
        """RST_STREAM for `stream_id`, unless it is over already (ended both ways or reset)."""
        if self._streams.pop(stream_id, None) is not None:
            self._unacked_streams.pop(stream_id, None)
            self._out += frame(RST_STREAM, 0, stream_id, error_code.to_bytes(4, "big"))

    def ping(self, payload: bytes) -> None:
        """A PING; its answer comes as `PingAck(payload)`."""
        self._out += frame(PING, 0, 0, payload[:8].ljust(8, b"\0"))

    def close(self, error_code: int = NO_ERROR) -> None:
        """GOAWAY: this side opens no more streams."""
        self._out += frame(GOAWAY, 0, 0, (0).to_bytes(4, "big") + error_code.to_bytes(4, "big"))

    # --- receiving

    def receive(self, data: bytes) -> list[Event]:
        """The events in `data` (and in what earlier calls left of a frame). Raises ProtocolError."""
        buffer = self._buffer
        buffer += data
        events: list[Event] = []
        pos = 0
        size = len(buffer)
        try:
            while size - pos >= 9:
                length = int.from_bytes(buffer[pos:pos + 3], "big")
                if length > FRAME_SIZE:
                    raise ProtocolError(f"a frame of {length} bytes (at most {FRAME_SIZE} were allowed)")
                if size - pos < 9 + length:
                    break
                kind, flags = buffer[pos + 3], buffer[pos + 4]
                stream_id = int.from_bytes(buffer[pos + 5:pos + 9], "big") & MAX_STREAM_ID
                payload = bytes(buffer[pos + 9:pos + 9 + length])
                pos += 9 + length
                self._frame(kind, flags, stream_id, payload, events)
        except ProtocolError:
            self.close(PROTOCOL_ERROR)
            raise
        finally:
            del buffer[:pos]
        return events

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if self._header_block is not None and kind != CONTINUATION:
            raise ProtocolError("a header block broken up by another frame")
        if kind == DATA:
            self._data(flags, stream_id, payload, events)
        elif kind == HEADERS:
            if stream_id == 0:
                raise ProtocolError("HEADERS on stream 0")
            payload = self._unpad(flags, payload)
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            if flags & END_HEADERS:
                self._headers(stream_id, flags, payload, events)
            else:
                self._header_block = (stream_id, flags, bytearray(payload))
        elif kind == CONTINUATION:
            if self._header_block is None or self._header_block[0] != stream_id:
                raise ProtocolError("CONTINUATION without its HEADERS")
            self._header_block[2].extend(payload)
            if flags & END_HEADERS:
                first, first_flags, block = self._header_block
                self._header_block = None
                self._headers(first, first_flags, bytes(block), events)
        elif kind == RST_STREAM:
            if len(payload) != 4 or stream_id == 0:
                raise ProtocolError("a malformed RST_STREAM")
            if self._streams.pop(stream_id, None) is not None:
                self._unacked_streams.pop(stream_id, None)
                events.append(Reset(stream_id, int.from_bytes(payload, "big")))
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload, events)
        elif kind == PUSH_PROMISE:
            raise ProtocolError("a server push (this client disabled them)")
        elif kind == PING:
            if len(payload) != 8:
                raise ProtocolError("a PING that is not 8 bytes")
            if flags & ACK:
                events.append(PingAck(payload))
            else:
                self._out += frame(PING, ACK, 0, payload)
        elif kind == GOAWAY:
            if len(payload) < 8:
                raise ProtocolError("a malformed GOAWAY")
            events.append(GoAway(int.from_bytes(payload[4:8], "big"),
                                 int.from_bytes(payload[:4], "big") & MAX_STREAM_ID))
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload, events)
        # PRIORITY, and frame types this client does not know, are ignored (RFC 9113 4.1, 5.5)

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ProtocolError("padding longer than its frame")
        return payload[1:len(payload) - payload[0]]

    def _data(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id == 0:
            raise ProtocolError("DATA on stream 0")
        credit = len(payload)  # padding counts toward flow control too
        data = self._unpad(flags, payload)
        end = bool(flags & END_STREAM)
        self._unacked += credit
        if self._unacked >= CONNECTION_WINDOW // 2:
            self._out += frame(WINDOW_UPDATE, 0, 0, self._unacked.to_bytes(4, "big"))
            self._unacked = 0
        if stream_id not in self._streams:
            return  # reset by this side, or over: only the connection's credit matters
        if end:
            self._ended(stream_id)
        elif credit:
            owed = self._unacked_streams.get(stream_id, 0) + credit
            if owed >= STREAM_WINDOW // 2:
                self._out += frame(WINDOW_UPDATE, 0, stream_id, owed.to_bytes(4, "big"))
                owed = 0
            self._unacked_streams[stream_id] = owed
        events.append(Data(stream_id, data, end))

    def _headers(self, stream_id: int, flags: int, block: bytes, events: list[Event]) -> None:
        headers = self._indexed.get(block)
        if headers is None:
            try:
                headers = dict(self._decoder.decode(block, raw=True))
            except hpack.HPACKError as e:
                raise ProtocolError(f"a header block that does not decode: {e}") from e
            if all(0x80 < byte < 0xFF for byte in block):
                # one-byte references alone: decoding it changes no table, so it means the same until
                # another block changes the table
                self._indexed[block] = headers
            else:
                self._indexed.clear()
        if stream_id not in self._streams:
            return
        end = bool(flags & END_STREAM)
        if end:
            self._ended(stream_id)
        events.append(Headers(stream_id, headers, end))  # type: ignore[arg-type]

    def _ended(self, stream_id: int) -> None:
        """The server ended `stream_id`. A gRPC client sends nothing after the server's status, and the
        server resets a stream it ended first, so this side forgets it now."""
        del self._streams[stream_id]
        self._unacked_streams.pop(stream_id, None)

    def _settings(self, payload: bytes, events: list[Event]) -> None:
        if len(payload) % 6:
            raise ProtocolError("a SETTINGS frame that is not 6-byte entries")
        opened = False
        for i in range(0, len(payload), 6):
            key = int.from_bytes(payload[i:i + 2], "big")
            value = int.from_bytes(payload[i + 2:i + 6], "big")
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError(f"an initial window of {value}")
                delta = value - self._stream_initial
                self._stream_initial = value
                for stream in self._streams.values():
                    stream.window[0] += delta
                opened = opened or delta > 0
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not FRAME_SIZE <= value <= 2**24 - 1:
                    raise ProtocolError(f"a max frame size of {value}")
                self.max_frame_size = value
            elif key == SETTINGS_MAX_CONCURRENT_STREAMS:
                self._max_streams = value
            # HEADER_TABLE_SIZE: this side never indexes, so the server's table size changes nothing here
        self._out += frame(SETTINGS, ACK, 0)
        if opened:
            events.append(WindowOpened())

    def _window_update(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise ProtocolError("a WINDOW_UPDATE that is not 4 bytes")
        increment = int.from_bytes(payload, "big") & MAX_WINDOW
        if increment == 0:
            raise ProtocolError("a WINDOW_UPDATE of 0")
        if stream_id == 0:
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ProtocolError("the connection's window grew past 2^31-1")
        else:
            stream = self._streams.get(stream_id)
            if stream is None:
                return
            stream.window[0] += increment
            if stream.window[0] > MAX_WINDOW:
                raise ProtocolError(f"stream {stream_id}'s window grew past 2^31-1")
        events.append(WindowOpened())
