"""Replay guards: remember which (sender, seq) pairs a region already accepted.

The :class:`~geolimit.replication.auth.Verifier` refuses any message whose time
is more than ``window`` seconds off before it asks the guard, so a guard only
needs to remember a pair for about ``window`` seconds after the message's time.

:class:`MemoryReplayGuard` forgets everything when the process exits;
:class:`RedisReplayGuard` keeps the pairs in the region's Redis, so a message
captured before an agent restart is still refused after it::

    <prefix>#seen:{<region>}:<sender>   sorted set: member = seq, score = message time

One atomic script call per message (``replay.lua``) refuses a known seq, or
records it, drops members older than the window, bounds the set's size and
renews its expiry (about ``2 * window``, so the sets of idle senders disappear).
"""

from __future__ import annotations

import heapq
from typing import Protocol

from geolimit.errors import ConfigError
from geolimit.store.async_store import AsyncStore
from geolimit.store.scripts import load_script

__all__ = ["DEFAULT_MAX_ENTRIES", "MemoryReplayGuard", "RedisReplayGuard", "ReplayGuard"]

DEFAULT_MAX_ENTRIES = 100_000  # per sender

_REPLAY = load_script("replay")


class ReplayGuard(Protocol):
    async def check_and_record(self, sender: str, seq: int, stamp: float, now: float) -> bool:
        """True the first time (``sender``, ``seq``) is seen (and records it), False for a replay.

        ``stamp`` is the message's time and ``now`` the verifier's clock, both in
        seconds since the epoch.
        """
        ...


def _check_window(window: float, max_entries: int) -> None:
    if not window > 0:
        raise ConfigError(f"the replay window must be positive, got {window!r}")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
        raise ConfigError(f"max_entries must be a positive integer, got {max_entries!r}")


class MemoryReplayGuard:
    """In-process guard: accepted pairs are lost on restart.

    Memory is bounded: entries whose time is older than ``now - window - 1`` are
    dropped, and at most ``max_entries`` (the newest) are kept per sender.
    """

    def __init__(self, window: float, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        _check_window(window, max_entries)
        self.window = window
        self.max_entries = max_entries
        self._seen: dict[str, set[int]] = {}
        self._ages: dict[str, list[tuple[float, int]]] = {}  # min-heap of (stamp, seq)

    async def check_and_record(self, sender: str, seq: int, stamp: float, now: float) -> bool:
        seen = self._seen.setdefault(sender, set())
        if seq in seen:
            return False
        ages = self._ages.setdefault(sender, [])
        seen.add(seq)
        heapq.heappush(ages, (stamp, seq))
        horizon = now - self.window - 1.0
        while ages and (ages[0][0] < horizon or len(ages) > self.max_entries):
            seen.discard(heapq.heappop(ages)[1])
        return True

    def __len__(self) -> int:
        """Pairs currently remembered, over all senders."""
        return sum(len(s) for s in self._seen.values())

    def __repr__(self) -> str:
        return f"MemoryReplayGuard(window={self.window:g}, entries={len(self)})"


class RedisReplayGuard:
    """Guard backed by the region's Redis: survives agent restarts.

    ``store`` is the agent's :class:`~geolimit.store.async_store.AsyncStore`;
    ``key_prefix`` its key prefix (e.g. ``"gl"``) and ``region`` this region's
    name. Redis failures raise :class:`~geolimit.errors.StorageError`: the
    message must then be refused (the caller cannot know whether it is a replay).
    """

    def __init__(
        self,
        store: AsyncStore,
        key_prefix: str,
        region: str,
        window: float,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        _check_window(window, max_entries)
        if not key_prefix or any(c in key_prefix for c in "{}"):
            raise ConfigError(f"invalid key prefix {key_prefix!r}: must be non-empty, without '{{' or '}}'")
        if not region or any(c in region for c in "{}"):
            raise ConfigError(f"invalid region name {region!r}")
        self.store = store
        self.key_prefix = key_prefix
        self.region = region
        self.window = window
        self.max_entries = max_entries
        self._base = f"{key_prefix}#seen:{{{region}}}:".encode()
        self._ttl = b"%d" % max(1000, int(2 * window * 1000) + 2000)
        self._max = b"%d" % max_entries

    def key(self, sender: str) -> bytes:
        """The Redis key of ``sender``'s seen set."""
        return self._base + sender.encode()

    async def check_and_record(self, sender: str, seq: int, stamp: float, now: float) -> bool:
        horizon = now - self.window - 1.0
        reply = await self.store.run(
            _REPLAY,
            [
                b"1", self.key(sender),
                b"%d" % seq, repr(float(stamp)).encode(), repr(float(horizon)).encode(), self._ttl, self._max,
            ],
        )
        return int(reply) == 1

    def __repr__(self) -> str:
        return f"RedisReplayGuard(region={self.region!r}, prefix={self.key_prefix!r}, window={self.window:g})"
