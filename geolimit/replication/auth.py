"""Gossip authentication: HMAC-SHA256 over sender, destination, time and sequence.

Every request carries four headers::

    X-Geolimit-Region     sender region name
    X-Geolimit-Time       sender clock, seconds since the epoch (decimal)
    X-Geolimit-Seq        sender sequence number (strictly increasing, also across restarts)
    X-Geolimit-Signature  hex HMAC-SHA256(secret,
                              "geolimit/2\\n" sender "\\n" destination "\\n" time "\\n" seq "\\n" body)

The destination is not sent: each verifier checks the signature as addressed
to its own region, so a message captured on its way to region B is refused by
region C ("bad signature (or addressed to another region)": the two cannot be
told apart).

A request is refused (:class:`~geolimit.errors.AuthenticationError`) when a
header is missing, the sender is not a configured peer, the time is more than
``window`` seconds off (:class:`~geolimit.errors.ClockSkewError`, checked after
the signature, naming the peer and its offset), the signature is wrong (or made
for another region), or
the (sender, seq) pair was already accepted, as recorded by a
:class:`~geolimit.replication.replay.ReplayGuard` (in memory, or in Redis so
that it survives restarts). Responses are signed by the responder for the
requester with the request's sequence number, so a forged acknowledgement
cannot make a sender drop cells.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import time
from collections.abc import Callable, Collection, Mapping
from typing import NamedTuple

from geolimit.errors import AuthenticationError, ClockSkewError, ConfigError, ProtocolError
from geolimit.replication.replay import MemoryReplayGuard, ReplayGuard

__all__ = [
    "HEADERS",
    "MIN_SECRET_BYTES",
    "REGION",
    "SEQ",
    "SIGNATURE",
    "TIME",
    "ReplayGuard",
    "Signer",
    "Verifier",
    "sign",
]

REGION, TIME, SEQ, SIGNATURE = "X-Geolimit-Region", "X-Geolimit-Time", "X-Geolimit-Seq", "X-Geolimit-Signature"
HEADERS = (REGION, TIME, SEQ, SIGNATURE)
MIN_SECRET_BYTES = 16

# Strict forms: the signed string is split by newlines, so no field may carry one.
_STAMP_RE = re.compile(r"-?[0-9]{1,12}(?:\.[0-9]{1,9})?")
_SEQ_RE = re.compile(r"[0-9]{1,20}")


def _region_name(region: str, what: str) -> str:
    if not isinstance(region, str) or not region or "\n" in region:
        raise ConfigError(f"{what} must be a non-empty region name without newlines, got {region!r}")
    return region


def sign(secret: bytes, region: str, dest: str, stamp: str, seq: str, body: bytes, response: bool = False) -> str:
    """Hex HMAC-SHA256 of a message from ``region`` to ``dest``.

    Requests and responses are signed under different labels, so a captured
    response can never pass as a request (and the other way round).
    """
    mac = hmac.new(secret, b"geolimit/2 response\n" if response else b"geolimit/2\n", hashlib.sha256)
    mac.update(f"{region}\n{dest}\n{stamp}\n{seq}\n".encode())
    mac.update(body)
    return mac.hexdigest()


class Signer:
    """Signs this region's messages."""

    def __init__(self, secret: bytes, region: str, clock: Callable[[], float] = time.time) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"the gossip secret must be at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret
        self.region = _region_name(region, "region")
        self._clock = clock
        self._seq = 0

    def next_seq(self) -> int:
        # Microsecond time keeps the sequence increasing across restarts.
        self._seq = max(self._seq + 1, int(self._clock() * 1_000_000))
        return self._seq

    def headers(self, body: bytes, dest: str, seq: int | None = None, *, response: bool = False) -> dict[str, str]:
        """Headers of a message to region ``dest``.

        Requests take a fresh sequence number; a response passes ``response=True``,
        the request's ``seq`` and the requester as ``dest``.
        """
        _region_name(dest, "dest")
        seq_s = str(self.next_seq() if seq is None else seq)
        stamp = f"{self._clock():.6f}"
        return {
            REGION: self.region,
            TIME: stamp,
            SEQ: seq_s,
            SIGNATURE: sign(self._secret, self.region, dest, stamp, seq_s, body, response=response),
        }

    def __repr__(self) -> str:
        return f"Signer(region={self.region!r}, secret=<redacted>)"


#: Bodies this large or larger are hashed in a thread by the ``*_async`` checks.
THREAD_HASH_BYTES = 1 << 20


class Authenticated(NamedTuple):
    """A request whose signature checked out (not yet checked for replay)."""

    sender: str
    stamp: float
    seq: int
    now: float


class Verifier:
    """Checks requests addressed to ``own_region`` by its peers, and the responses it receives."""

    def __init__(
        self,
        secret: bytes,
        peers: Collection[str],
        own_region: str,
        window: float = 30.0,
        clock: Callable[[], float] = time.time,
        guard: ReplayGuard | None = None,
    ) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"the gossip secret must be at least {MIN_SECRET_BYTES} bytes")
        if not window > 0:
            raise ConfigError(f"the auth window must be positive, got {window!r}")
        self._secret = secret
        self._peers = frozenset(peers)
        self.own_region = _region_name(own_region, "own_region")
        self.window = window
        self._clock = clock
        self.guard: ReplayGuard = MemoryReplayGuard(window) if guard is None else guard

    def _check(
        self, headers: Mapping[str, str], body: bytes, sender: str | None
    ) -> tuple[str, float, int, float]:
        """Headers, sender, time and signature; returns (sender, its time, seq, now)."""
        region, stamp, seq_s, signature = (headers.get(h) for h in HEADERS)
        if not (region and stamp and seq_s and signature):
            raise AuthenticationError("unsigned message: X-Geolimit-* headers missing")
        if sender is None:
            if region not in self._peers:
                raise AuthenticationError(f"message from unknown region {region[:64]!r} (not among this region's "
                                          f"peers: the two configs must name each other exactly)")
        elif region != sender:
            raise AuthenticationError(f"response from {region[:64]!r}, but the request went to {sender!r}")
        if not (_STAMP_RE.fullmatch(stamp) and _SEQ_RE.fullmatch(seq_s)):
            raise AuthenticationError("malformed X-Geolimit-Time or X-Geolimit-Seq")
        when, seq = float(stamp), int(seq_s)
        now = self._clock()
        expected = sign(self._secret, region, self.own_region, stamp, seq_s, body, response=sender is not None)
        if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace")):
            raise AuthenticationError(
                f"bad signature on a message naming region {region[:64]!r} (or addressed to another region): "
                f"every region's secret_file must hold the same secret, and the [peers] of region {region[:64]!r} "
                f"must name this region {self.own_region!r}")
        # Checked after the signature, so that only a peer holding the secret is
        # reported as skewed (a replay of an old message looks the same).
        if not abs(now - when) <= self.window:
            raise ClockSkewError(
                f"message time is {now - when:+.1f}s off: {region}'s clock is {when - now:+.1f}s off ours "
                f"(allowed ±{self.window:g}s; fix the clocks, e.g. NTP)", region, when - now,
            )
        return region, when, seq, now

    async def authenticate_async(self, headers: Mapping[str, str], body: bytes) -> Authenticated:
        """:meth:`authenticate`, hashing a body of :data:`THREAD_HASH_BYTES` or more in a
        thread (hashlib releases the GIL): a 16 MiB body takes about 26 ms to hash, and
        anyone who can reach the port could otherwise stall the event loop that long."""
        if len(body) < THREAD_HASH_BYTES:
            return self.authenticate(headers, body)
        return Authenticated(*await asyncio.to_thread(self._check, headers, body, None))

    async def verify_response_async(
        self, headers: Mapping[str, str], body: bytes, expect_seq: int, sender: str
    ) -> str:
        """:meth:`verify_response`, hashing a large body in a thread (see :meth:`authenticate_async`)."""
        if len(body) < THREAD_HASH_BYTES:
            return self.verify_response(headers, body, expect_seq, sender)
        return await asyncio.to_thread(self.verify_response, headers, body, expect_seq, sender)

    def authenticate(self, headers: Mapping[str, str], body: bytes) -> Authenticated:
        """Every check but the replay guard: headers, sender, time and signature.

        Callers that must leave Redis untouched by a message they later refuse
        (a body that does not decode) call :meth:`check_replay` only once it passed.
        """
        return Authenticated(*self._check(headers, body, None))

    async def check_replay(self, auth: Authenticated) -> str:
        """Record the message's (sender, seq); :class:`AuthenticationError` for a replay."""
        if not await self.guard.check_and_record(auth.sender, auth.seq, auth.stamp, auth.now):
            raise AuthenticationError(f"replayed message (seq {auth.seq} from {auth.sender!r} already accepted)")
        return auth.sender

    async def verify_request(self, headers: Mapping[str, str], body: bytes) -> str:
        """The sender's region, or :class:`AuthenticationError` with the reason.

        Records the (sender, seq) pair in the replay guard; a guard backed by
        Redis raises :class:`~geolimit.errors.StorageError` when Redis fails
        (the request must then be refused, e.g. with a 503).
        """
        region, when, seq, now = self._check(headers, body, None)
        if not await self.guard.check_and_record(region, seq, when, now):
            raise AuthenticationError(f"replayed message (seq {seq} from {region!r} already accepted)")
        return region

    def check_body_time(self, now_us: int) -> None:
        """A decoded message's own time (``now``, µs; 0: absent) must be within the auth window
        of ours, as its header's time is: it feeds the peer's clock offset (the agreed clock)
        and its update gap (prediction). :class:`ProtocolError` otherwise."""
        if now_us and not abs(now_us / 1_000_000 - self._clock()) <= self.window:
            raise ProtocolError(
                f"message body time now is {now_us / 1_000_000 - self._clock():+.1f}s off ours "
                f"(allowed ±{self.window:g}s)"
            )

    def verify_response(self, headers: Mapping[str, str], body: bytes, expect_seq: int, sender: str) -> str:
        """Checks that ``sender`` answered our request ``expect_seq``, for us; returns ``sender``."""
        region, _, seq, _ = self._check(headers, body, sender)
        if seq != expect_seq:
            raise AuthenticationError("response is for another request")
        return region

    def __repr__(self) -> str:
        return f"Verifier(region={self.own_region!r}, peers={sorted(self._peers)}, secret=<redacted>)"
