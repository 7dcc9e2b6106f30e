"""Gossip authentication: HMAC-SHA256 with a timestamp and a per-sender sequence.

Every request carries four headers::

    X-Geolimit-Region     sender region name
    X-Geolimit-Time       sender clock, seconds since the epoch (decimal)
    X-Geolimit-Seq        sender sequence number (strictly increasing, also across restarts)
    X-Geolimit-Signature  hex HMAC-SHA256(secret, "geolimit/1\\n" region "\\n" time "\\n" seq "\\n" body)

A request is refused (401) when a header is missing, the sender is not a
configured peer, the time is more than ``window`` seconds off, the signature is
wrong, or the (sender, seq) pair was already accepted. Responses are signed the
same way with the request's sequence number, so a forged acknowledgement cannot
make a sender drop cells.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Collection, Mapping

from geolimit.errors import AuthenticationError

__all__ = ["HEADERS", "ReplayGuard", "Signer", "Verifier", "sign"]

REGION, TIME, SEQ, SIGNATURE = "X-Geolimit-Region", "X-Geolimit-Time", "X-Geolimit-Seq", "X-Geolimit-Signature"
HEADERS = (REGION, TIME, SEQ, SIGNATURE)
MIN_SECRET_BYTES = 16


def sign(secret: bytes, region: str, stamp: str, seq: str, body: bytes) -> str:
    mac = hmac.new(secret, b"geolimit/1\n", hashlib.sha256)
    mac.update(f"{region}\n{stamp}\n{seq}\n".encode())
    mac.update(body)
    return mac.hexdigest()


class Signer:
    """Signs this region's messages."""

    def __init__(self, secret: bytes, region: str, clock: Callable[[], float] = time.time) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the gossip secret must be at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret
        self.region = region
        self._clock = clock
        self._seq = 0

    def next_seq(self) -> int:
        # Microsecond time keeps the sequence increasing across restarts.
        self._seq = max(self._seq + 1, int(self._clock() * 1_000_000))
        return self._seq

    def headers(self, body: bytes, seq: int | None = None) -> dict[str, str]:
        seq_s = str(self.next_seq() if seq is None else seq)
        stamp = f"{self._clock():.6f}"
        return {
            REGION: self.region,
            TIME: stamp,
            SEQ: seq_s,
            SIGNATURE: sign(self._secret, self.region, stamp, seq_s, body),
        }

    def __repr__(self) -> str:
        return f"Signer(region={self.region!r}, secret=<redacted>)"


class ReplayGuard:
    """Remembers accepted (sender, seq) pairs for as long as their time is acceptable."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._seen: dict[str, dict[int, float]] = {}

    def check_and_record(self, sender: str, seq: int, stamp: float, now: float) -> bool:
        seen = self._seen.setdefault(sender, {})
        if len(seen) > 256:
            horizon = now - self.window - 1.0
            for old in [s for s, t in seen.items() if t < horizon]:
                del seen[old]
        if seq in seen:
            return False
        seen[seq] = stamp
        return True


class Verifier:
    """Checks requests from peers (and, with ``expect_seq``, their responses)."""

    def __init__(
        self,
        secret: bytes,
        peers: Collection[str],
        window: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._secret = secret
        self._peers = frozenset(peers)
        self.window = window
        self._clock = clock
        self._guard = ReplayGuard(window)

    def verify(self, headers: Mapping[str, str], body: bytes, expect_seq: int | None = None) -> str:
        """The sender's region, or :class:`AuthenticationError` with the reason."""
        region, stamp, seq_s, signature = (headers.get(h) for h in HEADERS)
        if not (region and stamp and seq_s and signature):
            raise AuthenticationError("unsigned message: X-Geolimit-* headers missing")
        if region not in self._peers:
            raise AuthenticationError(f"message from unknown region {region[:64]!r}")
        try:
            when = float(stamp)
            seq = int(seq_s)
        except ValueError:
            raise AuthenticationError("malformed X-Geolimit-Time or X-Geolimit-Seq") from None
        now = self._clock()
        if not abs(now - when) <= self.window:
            raise AuthenticationError(f"message time is {now - when:+.1f}s off (allowed ±{self.window:g}s)")
        expected = sign(self._secret, region, stamp, seq_s, body)
        if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace")):
            raise AuthenticationError("bad signature")
        if expect_seq is not None:
            if seq != expect_seq:
                raise AuthenticationError("response is for another request")
        elif not self._guard.check_and_record(region, seq, when, now):
            raise AuthenticationError(f"replayed message (seq {seq} from {region!r} already accepted)")
        return region

    def __repr__(self) -> str:
        return f"Verifier(peers={sorted(self._peers)}, secret=<redacted>)"
