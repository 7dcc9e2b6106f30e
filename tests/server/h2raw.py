"""A raw HTTP/2 client for the hostile-input tests of the rate limit service's fast path.

It writes whatever frames a test asks for (valid or not) and reads the server's
frames with deadlines; header blocks are encoded by the ``hpack`` package as a
real client's are (Huffman coding and the dynamic table).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct

import hpack
from envoy.service.ratelimit.v3 import rls_pb2

from geolimit.server.rls.h2wire import PREFACE, FrameType, frame, settings_frame
from geolimit.server.rls.server import METHOD

__all__ = ["Answer", "Raw", "grpc_message", "request_fields", "rls_request"]

_HEADER = struct.Struct(">HBBBL")
DEADLINE = 10.0


def grpc_message(message: bytes, flag: int = 0) -> bytes:
    """One length-prefixed gRPC message."""
    return bytes((flag,)) + len(message).to_bytes(4, "big") + message


def rls_request(address: str = "10.9.9.9") -> bytes:
    """A serialized ShouldRateLimit request of the EDGE domain (tests/server/test_rls.py)."""
    req = rls_pb2.RateLimitRequest(domain="edge")
    req.descriptors.add().entries.add(key="remote_address", value=address)
    data: bytes = req.SerializeToString()
    return data


def request_fields(path: str = METHOD, *extra: tuple[str, str]) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "rls"),
            ("content-type", "application/grpc"), ("te", "trailers"), *extra]


class Answer:
    """What the server sent on one stream."""

    def __init__(self) -> None:
        self.headers: list[tuple[str, str]] = []
        self.trailers: list[tuple[str, str]] = []
        self.data = b""
        self.reset: int | None = None

    @property
    def status(self) -> int | None:
        """grpc-status, from the trailers (or a trailers-only answer)."""
        for name, value in self.trailers or self.headers:
            if name == "grpc-status":
                return int(value)
        return None

    def message(self) -> bytes:
        assert self.data[:1] == b"\x00"
        assert int.from_bytes(self.data[1:5], "big") == len(self.data) - 5
        return self.data[5:]


class Raw:
    """One client connection; ``send`` writes raw bytes, the readers wait at most :data:`DEADLINE`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.next_stream = 1
        self.pings: list[bytes] = []
        self.settings_acks = 0
        self.answers: dict[int, Answer] = {}
        self.ended: set[int] = set()

    @classmethod
    async def connect(cls, address: tuple[str, int], settings: dict[int, int] | None = None,
                      preface: bool = True) -> Raw:
        reader, writer = await asyncio.open_connection(*address)
        raw = cls(reader, writer)
        if preface:
            raw.send(PREFACE + settings_frame(settings or {}))
        return raw

    def send(self, *chunks: bytes) -> None:
        self.writer.write(b"".join(chunks))

    def block(self, fields: list[tuple[str, str]]) -> bytes:
        data: bytes = self.encoder.encode(fields)
        return data

    def headers(self, sid: int, fields: list[tuple[str, str]], end_stream: bool = False) -> bytes:
        """HEADERS (and CONTINUATION frames when the block exceeds 16 KiB) for ``fields``."""
        block = self.block(fields)
        chunks = [block[i:i + 16384] for i in range(0, len(block), 16384)]
        out = []
        for i, chunk in enumerate(chunks):
            flags = (0x4 if i == len(chunks) - 1 else 0) | (0x1 if end_stream and i == 0 else 0)
            out.append(frame(FrameType.HEADERS if i == 0 else FrameType.CONTINUATION, flags, sid, chunk))
        return b"".join(out)

    def stream(self) -> int:
        sid, self.next_stream = self.next_stream, self.next_stream + 2
        return sid

    def call(self, message: bytes, path: str = METHOD) -> int:
        """A whole unary call (HEADERS, then DATA with END_STREAM); its stream id."""
        sid = self.stream()
        self.send(frame(FrameType.HEADERS, 0x4, sid, self.block(request_fields(path))),
                  frame(FrameType.DATA, 0x1, sid, grpc_message(message)))
        return sid

    async def frame(self) -> tuple[int, int, int, bytes]:
        """The next frame: (type, flags, stream, payload); EOFError when the server closed."""
        try:
            head = await asyncio.wait_for(self.reader.readexactly(9), DEADLINE)
            high, low, kind, flags, sid = _HEADER.unpack(head)
            payload = await asyncio.wait_for(self.reader.readexactly(high << 8 | low), DEADLINE)
        except asyncio.IncompleteReadError as exc:
            raise EOFError("the server closed the connection") from exc
        if kind == FrameType.PING and flags & 1:
            self.pings.append(payload)
        if kind == FrameType.SETTINGS and flags & 1:
            self.settings_acks += 1
        return kind, flags, sid & 0x7FFFFFFF, payload

    async def answer(self, sid: int) -> Answer:
        """Stream ``sid``'s answer, once it ended (END_STREAM or RST_STREAM); other streams' frames are kept."""
        while sid not in self.ended:
            kind, flags, stream, payload = await self.frame()
            if kind == FrameType.GOAWAY:
                raise AssertionError(f"GOAWAY {int.from_bytes(payload[4:8], 'big')}: {payload[8:]!r}")
            if not stream or kind not in (FrameType.HEADERS, FrameType.DATA, FrameType.RST_STREAM):
                continue
            out = self.answers.setdefault(stream, Answer())
            if kind == FrameType.HEADERS:
                fields = [(str(n), str(v)) for n, v in self.decoder.decode(payload)]
                if out.headers:
                    out.trailers = fields
                else:
                    out.headers = fields
            elif kind == FrameType.DATA:
                out.data += payload
            else:
                out.reset = int.from_bytes(payload, "big")
            if kind == FrameType.RST_STREAM or flags & 0x1:
                self.ended.add(stream)
        return self.answers[sid]

    async def goaway(self) -> int:
        """Frames until GOAWAY; its error code, once the server has closed the connection too."""
        while True:
            kind, _, _, payload = await self.frame()
            if kind == FrameType.GOAWAY:
                code = int.from_bytes(payload[4:8], "big")
                await self.closed()
                return code

    async def closed(self) -> None:
        """Until the server closes the connection (frames before that are read and dropped)."""
        while True:
            try:
                await self.frame()
            except EOFError:
                return

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()
