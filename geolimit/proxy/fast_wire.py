"""HTTP/1.1 message heads and chunked framing for the proxy's fast path (no I/O).

The request parser accepts a deliberately small, strict subset of HTTP/1.1 and
returns None for anything else, so that the connection can be handed to
aiohttp's server, which serves or refuses it exactly as the proxy always did:

* request line ``METHOD SP /origin-form SP HTTP/1.1`` (no ``#``);
* printable ASCII only (and tabs in values): no obs-fold, no bare CR or LF, no
  byte above 0x7e or control byte anywhere in the head;
* no ``Transfer-Encoding``, ``Expect`` or ``Upgrade``, at most one ``Host`` and
  one ``Content-Length`` (digits only).

Responses from upstreams are parsed more leniently (their bytes are passed on as
they are: Latin-1 in, Latin-1 out) but a head that cannot be framed, with control
bytes, folded lines or conflicting lengths, is a protocol error (502).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus

from multidict import CIMultiDict

__all__ = ["ChunkedDecoder", "FastRequest", "UpstreamHead", "http_date", "parse_request_head",
           "parse_response_head", "plausible_start", "request_head", "response_head", "serialize_head",
           "status_phrase"]

_BAD_REQUEST_BYTE = re.compile(rb"[^\t\r\n\x20-\x7e]|\r(?!\n)|(?<!\r)\n")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
_DIGITS = re.compile(r"[0-9]{1,18}\Z")
_TCHAR = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]"
#: Printable ASCII only; the request line's target is origin-form without '#'.
_REQUEST_HEAD = re.compile(rb"(" + _TCHAR + rb"+) (/[!\x22\x24-\x7e]*) HTTP/1\.1\r\n((?:" + _TCHAR
                           + rb"+:[\t\x20-\x7e]*\r\n)*)\r\n\Z")
#: Upstreams' header values may hold obs-text (bytes above 0x7f), passed on as they are.
_RESPONSE_HEAD = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: ([\t\x20-\x7e\x80-\xff]*))?\r\n((?:" + _TCHAR
                            + rb"+:[\t\x20-\x7e\x80-\xff]*\r\n)*)\r\n\Z")
_REQUEST_LINE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+ /[!\x22\x24-\x7e]* HTTP/1\.1\Z")
_HANDED_OFF = frozenset({"transfer-encoding", "expect", "upgrade"})
_SPECIAL = _HANDED_OFF | {"content-length", "host", "connection"}


class _WireError(Exception):
    """An upstream's message cannot be framed."""


class _ChunkError(_WireError):
    """Bad chunked encoding."""


@dataclass(slots=True)
class FastRequest:
    """A request head the fast path serves."""

    method: str
    target: str  # origin-form, raw
    path: str  # decoded, as aiohttp's request.path
    items: list[tuple[str, str, str]]  # (name, lower-case name, value)
    headers: dict[str, str]  # lower-case name -> its first value (what the limit keys read)
    named: frozenset[str]  # the tokens of Connection (header names to drop, and close / keep-alive)
    content_length: int | None
    close: bool  # the client sent Connection: close
    #: What the fast path derives from this head alone, kept for the next request with the same
    #: bytes (see :func:`request_head`): ``peer -> (trusted networks, upstream head parts)``.
    memo: dict[str | None, tuple[object, str, str | None, str]] = field(default_factory=dict, repr=False,
                                                                       compare=False)
    #: ``peer -> `` the request's :class:`~geolimit.http.keys.RequestInfo` (frozen, so shared too).
    infos: dict[str | None, object] = field(default_factory=dict, repr=False, compare=False)

    def values(self, lower: str) -> list[str]:
        """Every value of a header (``lower``: its name in lower case)."""
        return [value for _, name, value in self.items if name == lower]


def parse_request_head(head: bytes) -> FastRequest | None:
    """``head`` ends with the blank line; None: not for the fast path."""
    match = _REQUEST_HEAD.match(head)
    if match is None:
        return None
    method, target = match.group(1).decode("ascii"), match.group(2).decode("ascii")
    items: list[tuple[str, str, str]] = []
    headers: dict[str, str] = {}
    length: int | None = None
    named: set[str] = set()
    hosts = 0
    block = match.group(3)
    for line in block.decode("ascii").split("\r\n")[:-1] if block else ():
        name, _, value = line.partition(":")
        value = value.strip(" \t")
        lower = name.lower()
        if lower in _SPECIAL:
            if lower in _HANDED_OFF:
                return None
            if lower == "content-length":
                if length is not None or not _DIGITS.match(value):
                    return None
                length = int(value)
            elif lower == "host":
                hosts += 1
            else:  # connection
                named.update(t.strip().lower() for t in value.split(","))
                if "upgrade" in named:
                    return None
        items.append((name, lower, value))
        headers.setdefault(lower, value)
    if hosts > 1:
        return None
    raw_path = target.split("?", 1)[0]
    path = raw_path if "%" not in raw_path else _decoded(raw_path)
    named.discard("")
    return FastRequest(method, target, path, items, headers, frozenset(named), length, "close" in named)


def plausible_start(partial: bytes) -> bool:
    """Whether an incomplete head could still become one the fast path serves."""
    if _BAD_REQUEST_BYTE.search(partial[:-1] if partial.endswith(b"\r") else partial):  # a CR before its LF
        return False
    line_end = partial.find(b"\r\n")
    first = partial if line_end < 0 else partial[:line_end]
    method, _, rest = first.partition(b" ")
    if not _TOKEN.match(method.decode("ascii", "replace")) and (method or rest):
        return False
    return line_end < 0 or _REQUEST_LINE.match(first) is not None


def _decoded(raw_path: str) -> str:
    from yarl import URL

    return URL.build(path=raw_path, encoded=True).path


@dataclass(slots=True)
class UpstreamHead:
    """An upstream response's head and how its body is framed."""

    status: int
    reason: str
    items: list[tuple[str, str, str]]  # (name, lower-case name, value)
    named: frozenset[str]  # the header names that Connection lists (and its other tokens)
    length: int | None  # Content-Length, when that frames the body
    chunked: bool
    keep_alive: bool  # the connection can carry another request after this body
    #: The client's response head made from this one, in parts (see :func:`response_head`).
    memo: dict[tuple[object, ...], tuple[str, str, bool, str]] = field(default_factory=dict, repr=False,
                                                                       compare=False)


#: Parsed heads by their bytes: a client usually sends the same head again (the same path, the same
#: headers) and an upstream answers with the same head but for its Date, so most requests skip the
#: parsing and what is derived from a head (each FastRequest or UpstreamHead is never changed once
#: made, and what is derived from it is kept in its ``memo``). Bounded: emptied when full.
_CACHE_ENTRIES = 256
_CACHED_HEAD = 4096  # longer heads are parsed every time
_requests: dict[bytes, FastRequest | None] = {}
_responses: dict[tuple[bytes, bool], UpstreamHead] = {}


def request_head(head: bytes) -> FastRequest | None:
    """:func:`parse_request_head`, the same result for the same bytes (shared: never change it)."""
    try:
        return _requests[head]
    except KeyError:
        pass
    req = parse_request_head(head)
    if len(head) <= _CACHED_HEAD:
        if len(_requests) >= _CACHE_ENTRIES:
            _requests.clear()
        _requests[head] = req
    return req


def response_head(head: bytes, method: str) -> UpstreamHead:
    """:func:`parse_response_head`, the same result for the same bytes and kind of method (shared)."""
    key = (head, method == "HEAD")
    try:
        return _responses[key]
    except KeyError:
        pass
    parsed = parse_response_head(head, method)
    if len(head) <= _CACHED_HEAD:
        if len(_responses) >= _CACHE_ENTRIES:
            _responses.clear()
        _responses[key] = parsed
    return parsed


def parse_response_head(head: bytes, method: str) -> UpstreamHead:
    """``head`` ends with the blank line (raises _WireError)."""
    match = _RESPONSE_HEAD.match(head)
    if match is None:
        raise _WireError(f"bad response head {head[:80]!r}")
    minor, status = int(match.group(1)), int(match.group(2))
    reason = (match.group(3) or b"").decode("latin-1")
    items: list[tuple[str, str, str]] = []
    lengths: set[str] = set()
    encodings: list[str] = []
    named: set[str] = set()
    block = match.group(4)
    for line in block.decode("latin-1").split("\r\n")[:-1] if block else ():
        name, _, value = line.partition(":")
        value = value.strip(" \t")
        lower = name.lower()
        if lower == "content-length":
            lengths.update(v.strip() for v in value.split(","))
        elif lower == "transfer-encoding":
            encodings.extend(v.strip().lower() for v in value.split(",") if v.strip())
        elif lower == "connection":
            named.update(v.strip().lower() for v in value.split(",") if v.strip())
        items.append((name, lower, value))
    keep_alive = minor == 1 and "close" not in named
    frozen = frozenset(named)
    if method == "HEAD" or status in (204, 304) or status < 200:
        return UpstreamHead(status, reason, items, frozen, 0, False, keep_alive)
    if encodings:
        chunked = encodings[-1] == "chunked"
        return UpstreamHead(status, reason, items, frozen, None, chunked, keep_alive and chunked)
    if lengths:
        if len(lengths) != 1 or not _DIGITS.match(next(iter(lengths))):
            raise _WireError("bad or conflicting Content-Length")
        return UpstreamHead(status, reason, items, frozen, int(next(iter(lengths))), False, keep_alive)
    return UpstreamHead(status, reason, items, frozen, None, False, False)  # until the upstream closes


class ChunkedDecoder:
    """Incremental chunked decoding: :meth:`feed` returns the data pieces; ``done`` after the last chunk."""

    __slots__ = ("_buf", "_left", "_state", "done")

    MAX_LINE = 4096

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0  # data bytes of the current chunk still to come
        self._state = 0  # 0 size line, 1 data, 2 CRLF after data, 3 trailers
        self.done = False

    def feed(self, data: bytes) -> list[bytes]:
        out: list[bytes] = []
        buf = self._buf + data if self._buf else data
        pos = 0
        while pos < len(buf) and not self.done:
            if self._state == 1:
                take = min(self._left, len(buf) - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = 2
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if len(buf) - pos > self.MAX_LINE:
                    raise _ChunkError("chunk line too long")
                break
            line = buf[pos:end]
            pos = end + 2
            if self._state == 2:
                if line:
                    raise _ChunkError("no CRLF after chunk data")
                self._state = 0
            elif self._state == 0:
                size = line.split(b";", 1)[0].strip(b" \t")
                if not size or len(size) > 15 or size.strip(b"0123456789abcdefABCDEF"):
                    raise _ChunkError(f"bad chunk size {line[:40]!r}")
                self._left = int(size, 16)
                self._state = 1 if self._left else 3
            elif not line:  # state 3: the end of the trailers (dropped, as aiohttp does)
                self.done = True
        self._buf = buf[pos:]
        if self.done and self._buf:
            raise _ChunkError("data after the last chunk")
        return out


_date_cache: tuple[int, str] = (0, "")


def http_date() -> str:
    """The Date header's value (cached for a second)."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, formatdate(now, usegmt=True))
    return _date_cache[1]


def serialize_head(first_line: str, headers: CIMultiDict[str] | list[tuple[str, str]]) -> bytes:
    """A message head: the first line, the headers, the blank line (Latin-1)."""
    items = headers.items() if isinstance(headers, CIMultiDict) else headers
    return (first_line + "\r\n" + "".join([f"{k}: {v}\r\n" for k, v in items]) + "\r\n").encode("latin-1")


def status_phrase(status: int) -> str:
    """The standard reason phrase of ``status`` ("" for a code it does not know)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""
