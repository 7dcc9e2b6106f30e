"""HTTP/2 and gRPC wire pieces for :mod:`geolimit.server.rls.h2c` (no I/O).

Frames are built with :mod:`struct`; the answers' header blocks are precomputed
bytes (HPACK literals without indexing, no Huffman, so the encoder keeps no state).
Request header blocks are decoded by the ``hpack`` package; :class:`HeadCache`
keeps the outcome of blocks that leave the decoder's dynamic table unchanged, so
the same bytes (a client's repeated, fully indexed request headers) are not decoded
again while the table stays as it was.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from urllib.parse import quote

__all__ = [
    "PREFACE", "FrameType", "Head", "HeadCache", "Settings", "answer_frames", "frame", "goaway", "hpack_int",
    "leaves_table_unchanged", "read_head", "rst_stream", "settings_frame", "trailers_only", "window_update",
]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

HEADER = struct.Struct(">HBBBL")  # length (high 16 bits, low 8 bits), type, flags, stream id
_U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")
_GOAWAY = struct.Struct(">LL")


class FrameType:
    DATA = 0
    HEADERS = 1
    PRIORITY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PUSH_PROMISE = 5
    PING = 6
    GOAWAY = 7
    WINDOW_UPDATE = 8
    CONTINUATION = 9


END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20


class Error:
    """HTTP/2 error codes (RFC 9113 §7)."""

    NO_ERROR = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2
    FLOW_CONTROL_ERROR = 3
    SETTINGS_TIMEOUT = 4
    STREAM_CLOSED = 5
    FRAME_SIZE_ERROR = 6
    REFUSED_STREAM = 7
    CANCEL = 8
    COMPRESSION_ERROR = 9
    ENHANCE_YOUR_CALM = 11


class Settings:
    HEADER_TABLE_SIZE = 1
    ENABLE_PUSH = 2
    MAX_CONCURRENT_STREAMS = 3
    INITIAL_WINDOW_SIZE = 4
    MAX_FRAME_SIZE = 5
    MAX_HEADER_LIST_SIZE = 6


MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return HEADER.pack(n >> 8, n & 0xFF, kind, flags, stream) + payload


def settings_frame(values: dict[int, int]) -> bytes:
    return frame(FrameType.SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in values.items()))


def window_update(stream: int, increment: int) -> bytes:
    return frame(FrameType.WINDOW_UPDATE, 0, stream, _U32.pack(increment))


def rst_stream(stream: int, code: int) -> bytes:
    return frame(FrameType.RST_STREAM, 0, stream, _U32.pack(code))


def goaway(last_stream: int, code: int, debug: bytes = b"") -> bytes:
    return frame(FrameType.GOAWAY, 0, 0, _GOAWAY.pack(last_stream, code) + debug[:256])


def hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) with ``first``'s high bits set in its first byte."""
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


def _literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman coding."""
    return b"\x00" + hpack_int(len(name), 7, 0) + name + hpack_int(len(value), 7, 0) + value


def _status(code: int) -> bytes:
    return b"\x88" if code == 200 else b"\x08" + hpack_int(3, 7, 0) + str(code).encode()  # index 8 / name of 8


_CONTENT_TYPE = b"\x0f\x10" + hpack_int(16, 7, 0) + b"application/grpc"  # name: static index 31
RESPONSE_BLOCK = _status(200) + _CONTENT_TYPE
OK_TRAILERS = _literal(b"grpc-status", b"0")
_MAX_DETAILS = 1024


def error_trailers(code: int, details: str) -> bytes:
    """``grpc-status`` and a percent-encoded ``grpc-message`` (at most 1 KiB of it)."""
    message = quote(details[:_MAX_DETAILS], safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode("ascii")
    return _literal(b"grpc-status", str(code).encode()) + _literal(b"grpc-message", message)


def trailers_only(stream: int, code: int, details: str, http_status: int = 200) -> bytes:
    """A whole error answer: one HEADERS frame that ends the stream."""
    block = _status(http_status) + _CONTENT_TYPE + error_trailers(code, details)
    return frame(FrameType.HEADERS, END_HEADERS | END_STREAM, stream, block)


_RESPONSE_LEN = len(RESPONSE_BLOCK)
_OK_LEN = len(OK_TRAILERS)


def answer_frames(stream: int, message: bytes) -> bytes:
    """HEADERS, one DATA frame (the 5-byte gRPC prefix and ``message``) and the OK trailers."""
    n = len(message) + 5
    return b"".join((
        HEADER.pack(0, _RESPONSE_LEN, FrameType.HEADERS, END_HEADERS, stream), RESPONSE_BLOCK,
        HEADER.pack(n >> 8, n & 0xFF, FrameType.DATA, 0, stream), b"\x00", _U32.pack(len(message)), message,
        HEADER.pack(0, _OK_LEN, FrameType.HEADERS, END_HEADERS | END_STREAM, stream), OK_TRAILERS,
    ))


# -- request heads ---------------------------------------------------------------------------

_PSEUDO = {b":method", b":scheme", b":path", b":authority"}
_CONNECTION_SPECIFIC = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}


@dataclass(frozen=True, slots=True)
class Head:
    """What the transport needs of a request's header list."""

    method: bytes
    path: bytes
    content_type: bytes
    encoding: bytes  # grpc-encoding ("" when absent)
    size: int  # RFC 9113 §6.5.2: names, values and 32 bytes per field
    malformed: str  # why the request is malformed ("" when it is not)


def read_head(fields: list[tuple[bytes, bytes]]) -> Head:
    """The request's pseudo-headers and the few fields gRPC needs; malformed requests named (RFC 9113 §8.1.1)."""
    pseudo: dict[bytes, bytes] = {}
    content_type = encoding = b""
    size = 0
    malformed = ""
    regular = False
    for name, value in fields:
        size += len(name) + len(value) + 32
        if name[:1] == b":":
            if regular or name not in _PSEUDO or name in pseudo:
                malformed = malformed or f"bad pseudo-header {name[:64]!r}"
            pseudo[name] = value
            continue
        regular = True
        if name != name.lower() or name in _CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
            malformed = malformed or f"bad header field {name[:64]!r}"
        elif name == b"content-type":
            content_type = value
        elif name == b"grpc-encoding":
            encoding = value
    for required in (b":method", b":scheme", b":path"):
        if not pseudo.get(required):
            malformed = malformed or f"missing {required.decode()}"
    return Head(pseudo.get(b":method", b""), pseudo.get(b":path", b""), content_type, encoding, size, malformed)


def _skip_int(block: bytes, i: int, prefix_bits: int) -> int:
    """The offset after the HPACK integer at ``i``; raises IndexError if the block ends inside it."""
    if block[i] & ((1 << prefix_bits) - 1) != (1 << prefix_bits) - 1:
        return i + 1
    i += 1
    while block[i] & 0x80:
        i += 1
    return i + 1


def _read_int(block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    limit = (1 << prefix_bits) - 1
    value = block[i] & limit
    i += 1
    if value < limit:
        return value, i
    shift = 0
    while True:
        byte = block[i]
        i += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i
        if shift > 28:
            raise IndexError("HPACK integer too long")


def leaves_table_unchanged(block: bytes) -> bool:
    """True if decoding ``block`` cannot change the dynamic table: only indexed fields and literals
    without indexing (no incremental indexing, no size update). False also for a truncated block."""
    i, n = 0, len(block)
    try:
        while i < n:
            c = block[i]
            if c & 0x80:
                i = _skip_int(block, i, 7)
            elif c & 0x60:  # 01xxxxxx literal with incremental indexing, 001xxxxx size update
                return False
            else:
                index, i = _read_int(block, i, 4)
                if index == 0:
                    length, i = _read_int(block, i, 7)
                    i += length
                length, i = _read_int(block, i, 7)
                i += length
    except IndexError:
        return False
    return i == n


class HeadCache:
    """Heads of header blocks that leave the dynamic table unchanged, valid until the table changes."""

    __slots__ = ("_heads", "_limit")

    def __init__(self, limit: int = 256) -> None:
        self._heads: dict[bytes, Head] = {}
        self._limit = limit

    def get(self, block: bytes) -> Head | None:
        return self._heads.get(block)

    def put(self, block: bytes, head: Head) -> None:
        if len(self._heads) >= self._limit:
            self._heads.clear()
        self._heads[block] = head

    def clear(self) -> None:
        """The table changed: every cached block may now mean something else."""
        self._heads.clear()
