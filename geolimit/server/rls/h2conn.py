"""One HTTP/2 client connection of :mod:`geolimit.server.rls.h2c`: frames in, calls out, answers back."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import cast

import hpack
from hpack import HPACKError, OversizedHeaderListError

from geolimit.http.connections import ListenerGuard
from geolimit.server.rls import h2wire as w
from geolimit.server.rls.h2control import _H2ConnectionError, control
from geolimit.server.rls.h2deadline import RequestDeadline, Timers
from geolimit.server.rls.h2send import Limits, Stream
from geolimit.server.rls.h2wire import Error, FrameType

__all__ = ["H2Connection", "Limits", "RequestDeadline"]

log = logging.getLogger("geolimit.agent")

_CONN_WINDOW = 1 << 20  # the connection's receive window (raised from 65,535 at start)
_MAX_BLOCK = 64 * 1024  # encoded header block (HEADERS + CONTINUATION) bytes before the connection is dropped
_MAX_DECODED = 256 * 1024  # decoded header list bytes before the connection is dropped (HPACK bombs)
_MAX_BUFFERED = 8 << 20  # request bytes held per connection: past it, the largest unfinished request is refused
#: Request bytes held over all connections: past it, a connection holding more than
#: _BLAME_ABOVE loses its largest unfinished request (60 connections of 2 x 4 MiB
#: unfinished requests took an agent to 760 MiB).
_MAX_BUFFERED_ALL = 64 << 20
_BLAME_ABOVE = 1 << 20  # (a real request is a few hundred bytes: below this, nothing is summed)
_UNIMPLEMENTED, _RESOURCE_EXHAUSTED, _INTERNAL = 12, 8, 13


class H2Connection(Timers, asyncio.Protocol):
    """Server side of one connection; ``dispatch(conn, stream, request)`` gets each complete request."""

    def __init__(self, method: bytes, dispatch: Callable[[H2Connection, int, bytes], None], limits: Limits,
                 registry: set[H2Connection], gone: Callable[[], None], deadline: RequestDeadline,
                 guard: ListenerGuard | None = None) -> None:
        self._guard = guard  # the listener's cap on open connections
        self._counted = False  # holds one of its places
        self._method = method
        self._dispatch = dispatch
        self._limits = limits
        self._deadline = deadline
        self._registry = registry
        self._gone = gone
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._preface = False
        self._settings_seen = False
        self._streams: dict[int, Stream] = {}
        self._last = 0  # the highest stream id the client opened
        self._cont: tuple[int, int] | None = None  # (stream, flags of its HEADERS) while CONTINUATION is due
        self._block = bytearray()
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = _MAX_DECODED
        self._heads = w.HeadCache()
        self._recv_window = _CONN_WINDOW
        self._unacked = 0
        self._buffered = 0
        self._send_window = w.DEFAULT_WINDOW
        self._peer_window = w.DEFAULT_WINDOW  # SETTINGS_INITIAL_WINDOW_SIZE of the peer
        self._peer_frame = w.DEFAULT_MAX_FRAME
        self._blocked: dict[int, Stream] = {}  # streams whose answer waits for a window
        # Streams the client reset while their call was still being decided: they count
        # against max_streams until the call ends, so resets cannot pile up work (rapid reset).
        self._orphans: set[int] = set()
        self._out: list[bytes] = []
        self._paused = False
        self._draining = False
        self.closed = False
        self._partial_since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._next_due = math.inf
        self._due_timer: asyncio.TimerHandle | None = None
        self._active_at = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._guard is not None:
            if not self._guard.admit():  # over max_connections: closed before anything is sent
                self.closed = True
                transport.close()
                return
            self._counted = True
        self.transport = cast(asyncio.Transport, transport)
        self._registry.add(self)
        lim = self._limits
        self._write(w.settings_frame({
            w.Settings.MAX_CONCURRENT_STREAMS: lim.max_streams,
            w.Settings.INITIAL_WINDOW_SIZE: self._stream_window,
            w.Settings.MAX_HEADER_LIST_SIZE: lim.max_header_list,
        }) + w.window_update(0, _CONN_WINDOW - w.DEFAULT_WINDOW))
        self._partial()
        self._active()

    @property
    def _stream_window(self) -> int:
        return min(self._limits.max_message + 1024, w.MAX_WINDOW)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted and self._guard is not None:
            self._counted = False
            self._guard.release()
        self.closed = True
        self._registry.discard(self)
        self._gone()
        self._streams.clear()
        self._blocked.clear()
        self._stop_timers()

    def pause_writing(self) -> None:
        self._paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._active()
        buf = self._buf
        buf += data
        try:
            if not self._preface:
                if len(buf) < 24:
                    if not w.PREFACE.startswith(bytes(buf)):
                        raise _H2ConnectionError(Error.PROTOCOL_ERROR, "not an HTTP/2 preface")
                    return
                if buf[:24] != w.PREFACE:
                    raise _H2ConnectionError(Error.PROTOCOL_ERROR, "not an HTTP/2 preface")
                self._preface = True
                del buf[:24]
            self._frames(buf)
        except _H2ConnectionError as exc:
            self._die(exc.code, str(exc))
            return
        except Exception:  # a bug here must cost this connection only
            log.exception("rate limit service: HTTP/2 connection failed")
            self._die(Error.INTERNAL_ERROR, "internal error")
            return
        if self.closed:
            return
        while self._buffered > _MAX_BUFFERED and self._streams:  # bounded memory, and no stream waits forever
            sid = max(self._streams, key=lambda s: len(self._streams[s].body))
            self.fail(sid, _RESOURCE_EXHAUSTED, "too much request data on this connection")
            if self.closed:
                return
        if self._buffered > _BLAME_ABOVE:
            total = sum(c._buffered for c in self._registry)
            while total > _MAX_BUFFERED_ALL and self._buffered > _BLAME_ABOVE and self._streams:
                held = self._buffered
                sid = max(self._streams, key=lambda s: len(self._streams[s].body))
                self.fail(sid, _RESOURCE_EXHAUSTED, "too much request data on all connections")
                if self.closed or self._buffered >= held:
                    return
                total -= held - self._buffered
        if self._unacked >= _CONN_WINDOW // 4:
            self._replenish()
        self._due_check()
        if buf or self._cont is not None:
            if not self._partial_since:
                self._partial()
        else:
            self._partial_since = 0.0

    def _frames(self, buf: bytearray) -> None:
        pos, n = 0, len(buf)
        unpack = w.HEADER.unpack_from
        max_frame = w.DEFAULT_MAX_FRAME
        try:
            while n - pos >= 9:
                high, low, kind, flags, stream = unpack(buf, pos)
                length = high << 8 | low
                if length > max_frame:
                    raise _H2ConnectionError(Error.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                end = pos + 9 + length
                if end > n:
                    break
                payload = bytes(buf[pos + 9:end])
                pos = end
                stream &= 0x7FFFFFFF
                if not self._settings_seen and (kind != FrameType.SETTINGS or flags & w.ACK):
                    raise _H2ConnectionError(Error.PROTOCOL_ERROR, "the client preface must end with SETTINGS")
                if self._cont is not None and (kind != FrameType.CONTINUATION or stream != self._cont[0]):
                    raise _H2ConnectionError(Error.PROTOCOL_ERROR, "CONTINUATION expected")
                if kind == FrameType.DATA:
                    self._data(flags, stream, payload)
                elif kind == FrameType.HEADERS:
                    self._headers(flags, stream, payload)
                elif kind == FrameType.CONTINUATION:
                    self._continuation(flags, stream, payload)
                else:
                    self._control(kind, flags, stream, payload)
                if self.closed:
                    return
        finally:
            del buf[:pos]

    # -- requests ----------------------------------------------------------------------

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise _H2ConnectionError(Error.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        if size > self._recv_window:
            raise _H2ConnectionError(Error.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._recv_window -= size
        self._unacked += size
        stream = self._streams.get(sid)
        if stream is None or stream.ended:
            if sid > self._last:
                raise _H2ConnectionError(Error.PROTOCOL_ERROR, "DATA on an idle stream")
            if stream is not None:  # half-closed (remote): a stream error
                self._reset(sid, Error.STREAM_CLOSED)
            return  # a stream closed or reset here: ignored (its bytes still count for the connection)
        if size > stream.recv_window:
            self._reset(sid, Error.FLOW_CONTROL_ERROR)
            return
        stream.recv_window -= size
        if flags & w.PADDED:
            payload = _unpad(payload)
        if stream.handed:  # answered early (an error): the rest of its body is not needed
            if flags & w.END_STREAM:
                self._forget(sid, stream)
            return
        if payload:
            body: bytes | bytearray
            if not stream.body:
                body = stream.body = payload
            else:  # a message in several frames: appended in place, not copied each time
                if not isinstance(stream.body, bytearray):
                    stream.body = bytearray(stream.body)
                stream.body += payload
                body = stream.body
            self._buffered += len(payload)
            if len(body) >= 5:
                declared = int.from_bytes(body[1:5], "big")
                if declared > self._limits.max_message:
                    self.fail(sid, _RESOURCE_EXHAUSTED,
                              f"request message larger than max ({declared} vs. {self._limits.max_message})")
                    return
                if len(body) > declared + 5:
                    self.fail(sid, _INTERNAL, "exactly one request message is required")
                    return
        if flags & w.END_STREAM:
            stream.ended = True
            self._request(sid, stream)
        elif stream.recv_window < self._stream_window // 2:
            self._write(w.window_update(sid, self._stream_window - stream.recv_window))
            stream.recv_window = self._stream_window

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or not sid & 1:
            raise _H2ConnectionError(Error.PROTOCOL_ERROR, "HEADERS on an even stream id")
        if flags & w.PADDED:
            payload = _unpad(payload)
        if flags & w.PRIORITY_FLAG:
            if len(payload) < 5:
                raise _H2ConnectionError(Error.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            payload = payload[5:]
        if flags & w.END_HEADERS:
            self._block_done(sid, flags, payload)
        else:
            self._cont = (sid, flags)
            self._block = bytearray(payload)

    def _continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if self._cont is None:
            raise _H2ConnectionError(Error.PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        self._block += payload
        if len(self._block) > _MAX_BLOCK:
            raise _H2ConnectionError(Error.ENHANCE_YOUR_CALM, "header block too large")
        if flags & w.END_HEADERS:
            _, first = self._cont
            self._cont = None
            block, self._block = bytes(self._block), bytearray()
            self._block_done(sid, first, block)

    def _block_done(self, sid: int, flags: int, block: bytes) -> None:
        head = self._heads.get(block)
        if head is None:
            static = w.leaves_table_unchanged(block)
            try:
                fields = self._decoder.decode(block, raw=True)
            except OversizedHeaderListError:
                raise _H2ConnectionError(Error.ENHANCE_YOUR_CALM, "header list too large") from None
            except HPACKError as exc:
                raise _H2ConnectionError(Error.COMPRESSION_ERROR, f"header block: {exc}") from None
            head = w.read_head(cast(list[tuple[bytes, bytes]], fields))
            if static:
                self._heads.put(block, head)
            else:
                self._heads.clear()
        stream = self._streams.get(sid)
        if stream is not None:  # trailers from the client: they must end the stream
            if stream.ended or not flags & w.END_STREAM:
                raise _H2ConnectionError(Error.PROTOCOL_ERROR, "a second HEADERS without END_STREAM")
            stream.ended = True
            if not stream.handed:
                self._request(sid, stream)
            elif sid not in self._blocked:
                self._forget(sid, stream)
            return
        if sid <= self._last:  # a stream closed here (answered early, or reset): its block was still decoded
            self._write(w.rst_stream(sid, Error.STREAM_CLOSED))
            return
        self._last = sid
        if self._draining:
            self._write(w.rst_stream(sid, Error.REFUSED_STREAM))
            return
        if len(self._streams) + len(self._orphans) >= self._limits.max_streams:
            self._write(w.rst_stream(sid, Error.REFUSED_STREAM))
            return
        stream = self._streams[sid] = Stream(self._peer_window, self._stream_window)
        stream.ended = bool(flags & w.END_STREAM)
        if head.malformed:
            self._reset(sid, Error.PROTOCOL_ERROR)
        elif head.size > self._limits.max_header_list:
            self.fail(sid, _RESOURCE_EXHAUSTED, f"header list of {head.size} bytes")
        elif head.method != b"POST":
            self.fail(sid, _UNIMPLEMENTED, "only POST", 405)
        elif not head.content_type.startswith(b"application/grpc"):
            self.fail(sid, _UNIMPLEMENTED, "content-type must be application/grpc", 415)
        elif head.path != self._method:
            self.fail(sid, _UNIMPLEMENTED, "Method not found!")
        elif head.encoding not in (b"", b"identity"):
            self.fail(sid, _UNIMPLEMENTED, f"grpc-encoding {head.encoding[:32]!r} is not supported")
        elif stream.ended:
            self._request(sid, stream)
        else:
            self._opened(stream)

    def _request(self, sid: int, stream: Stream) -> None:
        """The request is complete: one uncompressed message goes to the handler."""
        body = stream.body
        stream.body = b""
        self._buffered -= len(body)
        if len(body) < 5 or len(body) != 5 + int.from_bytes(body[1:5], "big"):
            self.fail(sid, _UNIMPLEMENTED if not body else _INTERNAL, "exactly one request message is required")
        elif body[0]:
            self.fail(sid, _UNIMPLEMENTED if body[0] == 1 else _INTERNAL, "compressed messages are not supported")
        else:
            stream.handed = True
            self._dispatch(self, sid, bytes(body[5:]))

    # -- control frames ----------------------------------------------------------------

    def _control(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        control(self, kind, flags, sid, payload)  # the rarer frames, in a module of their own

    def _replenish(self) -> None:
        if self._unacked:
            self._write(w.window_update(0, self._unacked))
            self._recv_window += self._unacked
            self._unacked = 0

    @property
    def busy(self) -> bool:
        """Calls in progress (answers not yet sent)."""
        return bool(self._streams) and not self.closed

def _unpad(payload: bytes) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise _H2ConnectionError(Error.PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1:len(payload) - payload[0]]
