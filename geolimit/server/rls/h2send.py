"""The answering side of :class:`~geolimit.server.rls.h2conn.H2Connection`: answers within the
client's windows, stream ends and resets, the output buffer, GOAWAY and close."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from geolimit.server.rls import h2wire as w
from geolimit.server.rls.h2wire import Error, FrameType

__all__ = ["Answering", "Limits", "Stream"]

log = logging.getLogger("geolimit.agent")


@dataclass(frozen=True)
class Limits:
    max_message: int
    max_header_list: int
    max_streams: int
    frame_timeout: float


class Stream:
    __slots__ = ("allowed", "body", "due", "ended", "handed", "pending", "recv_window", "send_window", "trailers")

    def __init__(self, send_window: int, recv_window: int) -> None:
        self.body: bytes | bytearray = b""
        self.ended = False  # the client's END_STREAM arrived
        self.handed = False  # the request went to the handler
        self.recv_window = recv_window
        self.send_window = send_window
        self.pending = b""  # DATA payload waiting for the peer's windows
        self.trailers = b""  # the trailers block to send after ``pending``
        self.due = math.inf  # when an unfinished request must have ended its stream (loop-independent clock)
        self.allowed = 0.0  # the seconds it was given then (rls_request_timeout as of its HEADERS)


class Answering:
    """Answers and connection lifetime; the attributes are :class:`H2Connection`'s."""

    transport: asyncio.Transport | None
    closed: bool
    _loop: asyncio.AbstractEventLoop
    _streams: dict[int, Stream]
    _blocked: dict[int, Stream]
    _orphans: set[int]
    _send_window: int
    _peer_frame: int
    _buffered: int
    _draining: bool
    _active_at: float  # loop time of the connection's last read, or of its last stream's end
    _last: int
    _out: list[bytes]

    def answer(self, sid: int, message: bytes) -> None:
        stream = self._streams.get(sid)
        if stream is None:
            self._orphans.discard(sid)  # its call has ended
            return
        if self.closed or stream.pending or stream.trailers:
            return  # reset, answered already, or the connection is gone
        stream.handed = True
        n = len(message) + 5
        if n <= stream.send_window and n <= self._send_window and n <= self._peer_frame:
            stream.send_window -= n
            self._send_window -= n
            self._write(w.answer_frames(sid, message))
            self._done(sid, stream)
        else:
            self._write(w.frame(FrameType.HEADERS, w.END_HEADERS, sid, w.RESPONSE_BLOCK))
            stream.pending = b"\x00" + len(message).to_bytes(4, "big") + message
            stream.trailers = w.OK_TRAILERS
            self._blocked[sid] = stream
            self._pump(sid, stream)

    def fail(self, sid: int, code: int, details: str, http_status: int = 200) -> None:
        stream = self._streams.get(sid)
        if stream is None:
            self._orphans.discard(sid)
            return
        if self.closed or stream.pending or stream.trailers:
            return
        stream.handed = True
        self._buffered -= len(stream.body)
        stream.body = b""
        self._write(w.trailers_only(sid, code, details, http_status))
        self._done(sid, stream)

    def _done(self, sid: int, stream: Stream) -> None:
        """The answer is sent: the stream closes, or is reset (NO_ERROR) if the client is still sending."""
        if stream.ended:
            self._forget(sid, stream)
        else:
            self._reset(sid, Error.NO_ERROR)

    def _pump(self, sid: int, stream: Stream) -> None:
        while stream.pending:
            n = min(len(stream.pending), stream.send_window, self._send_window, self._peer_frame)
            if n <= 0:
                return
            chunk, stream.pending = stream.pending[:n], stream.pending[n:]
            stream.send_window -= n
            self._send_window -= n
            self._write(w.frame(FrameType.DATA, 0, sid, chunk))
        self._write(w.frame(FrameType.HEADERS, w.END_HEADERS | w.END_STREAM, sid, stream.trailers))
        self._blocked.pop(sid, None)
        self._done(sid, stream)

    def _pump_all(self) -> None:
        for sid, stream in list(self._blocked.items()):
            if self._send_window <= 0:
                return
            self._pump(sid, stream)

    def _reset(self, sid: int, code: int) -> None:
        self._write(w.rst_stream(sid, code))
        stream = self._streams.get(sid)
        if stream is not None:
            self._forget(sid, stream)

    def _forget(self, sid: int, stream: Stream) -> None:
        self._buffered -= len(stream.body)
        stream.body = b""
        stream.pending = stream.trailers = b""
        self._streams.pop(sid, None)
        self._blocked.pop(sid, None)
        if not self._streams:
            self._active_at = self._loop.time()  # idle from now
            if self._draining:
                self.close()

    def _write(self, data: bytes) -> None:
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def drain(self) -> None:
        """GOAWAY(NO_ERROR): no new streams; the connection closes once its calls are answered."""
        if self.closed or self._draining:
            return
        self._draining = True
        self._write(w.goaway(self._last, Error.NO_ERROR))
        if not self._streams:
            self.close()

    def _die(self, code: int, why: str) -> None:
        """A connection error: GOAWAY with ``code`` and the connection closed."""
        log.info("rate limit service: closing an HTTP/2 connection: %s", why)
        self._write(w.goaway(self._last, code, why.encode("ascii", "replace")))
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self._flush()
        self.closed = True
        if self.transport is not None:
            self.transport.close()
