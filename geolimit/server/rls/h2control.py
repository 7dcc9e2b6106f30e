"""The control frames of :class:`~geolimit.server.rls.h2conn.H2Connection` (RFC 9113 §6)."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from geolimit.errors import ProtocolError
from geolimit.server.rls import h2wire as w
from geolimit.server.rls.h2wire import Error, FrameType, Settings

if TYPE_CHECKING:
    from geolimit.server.rls.h2conn import H2Connection

__all__ = ["control"]

_U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")


class _H2ConnectionError(ProtocolError):
    """A connection error: the connection ends with GOAWAY(``code``) (caught in the transport)."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


def control(conn: H2Connection, kind: int, flags: int, sid: int, payload: bytes) -> None:
    """One frame other than DATA, HEADERS and CONTINUATION; unknown types are ignored."""
    size = len(payload)
    if kind == FrameType.SETTINGS:
        _settings(conn, flags, sid, payload)
    elif kind == FrameType.WINDOW_UPDATE:
        if size != 4:
            raise _H2ConnectionError(Error.FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        _window_update(conn, sid, _U32.unpack(payload)[0] & 0x7FFFFFFF)
    elif kind == FrameType.PING:
        if size != 8:
            raise _H2ConnectionError(Error.FRAME_SIZE_ERROR, "PING of the wrong size")
        if sid:
            raise _H2ConnectionError(Error.PROTOCOL_ERROR, "PING on a stream")
        if not flags & w.ACK:
            conn._write(w.frame(FrameType.PING, w.ACK, 0, payload))
    elif kind == FrameType.RST_STREAM:
        if size != 4:
            raise _H2ConnectionError(Error.FRAME_SIZE_ERROR, "RST_STREAM of the wrong size")
        _idle_check(conn, sid, "RST_STREAM")
        stream = conn._streams.get(sid)
        if stream is not None:  # the call is cancelled: a late answer finds no stream
            if stream.handed and not stream.pending and not stream.trailers:
                conn._orphans.add(sid)  # still being decided: counts as open until it ends
            conn._forget(sid, stream)
    elif kind == FrameType.PRIORITY:
        if not sid:
            raise _H2ConnectionError(Error.PROTOCOL_ERROR, "PRIORITY on stream 0")
        if size != 5:
            conn._reset(sid, Error.FRAME_SIZE_ERROR)
    elif kind == FrameType.GOAWAY:
        if sid:
            raise _H2ConnectionError(Error.PROTOCOL_ERROR, "GOAWAY on a stream")
        if size < 8:
            raise _H2ConnectionError(Error.FRAME_SIZE_ERROR, "GOAWAY too short")
        conn.drain()  # the client is leaving: answer what it asked, then close
    elif kind == FrameType.PUSH_PROMISE:
        raise _H2ConnectionError(Error.PROTOCOL_ERROR, "PUSH_PROMISE from a client")


def _idle_check(conn: H2Connection, sid: int, what: str) -> None:
    if not sid:
        raise _H2ConnectionError(Error.PROTOCOL_ERROR, f"{what} on stream 0")
    if sid > conn._last:
        raise _H2ConnectionError(Error.PROTOCOL_ERROR, f"{what} on an idle stream")


def _settings(conn: H2Connection, flags: int, sid: int, payload: bytes) -> None:
    if sid:
        raise _H2ConnectionError(Error.PROTOCOL_ERROR, "SETTINGS on a stream")
    if flags & w.ACK:
        if payload:
            raise _H2ConnectionError(Error.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
        return
    if len(payload) % 6:
        raise _H2ConnectionError(Error.FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
    conn._settings_seen = True
    for offset in range(0, len(payload), 6):
        key, value = _SETTING.unpack_from(payload, offset)
        if key == Settings.ENABLE_PUSH and value > 1:
            raise _H2ConnectionError(Error.PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH not 0 or 1")
        if key == Settings.INITIAL_WINDOW_SIZE:
            if value > w.MAX_WINDOW:
                raise _H2ConnectionError(Error.FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE too large")
            delta = value - conn._peer_window
            conn._peer_window = value
            for stream in conn._streams.values():
                stream.send_window += delta
                if stream.send_window > w.MAX_WINDOW:
                    raise _H2ConnectionError(Error.FLOW_CONTROL_ERROR, "a stream window over 2^31-1")
        elif key == Settings.MAX_FRAME_SIZE:
            if not w.DEFAULT_MAX_FRAME <= value < 1 << 24:
                raise _H2ConnectionError(Error.PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
            conn._peer_frame = value
    conn._write(w.frame(FrameType.SETTINGS, w.ACK, 0))
    conn._pump_all()


def _window_update(conn: H2Connection, sid: int, increment: int) -> None:
    if not sid:
        if not increment:
            raise _H2ConnectionError(Error.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        conn._send_window += increment
        if conn._send_window > w.MAX_WINDOW:
            raise _H2ConnectionError(Error.FLOW_CONTROL_ERROR, "the connection window over 2^31-1")
        conn._pump_all()
        return
    if sid > conn._last:
        raise _H2ConnectionError(Error.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
    stream = conn._streams.get(sid)
    if stream is None:
        return  # closed: ignored
    if not increment:
        conn._reset(sid, Error.PROTOCOL_ERROR)
        return
    stream.send_window += increment
    if stream.send_window > w.MAX_WINDOW:
        conn._reset(sid, Error.FLOW_CONTROL_ERROR)
    elif sid in conn._blocked:
        conn._pump(sid, stream)
