"""Message-level faults for gossip: a :class:`Transport` wrapper.

:class:`FaultyTransport` wraps any transport and, per peer, drops requests,
drops responses, duplicates and reorders messages, or partitions the peer. All
randomness comes from the injected :class:`random.Random`, so a seeded run is
reproducible.

Exactly what one ``send(peer, message)`` does, in this order:

1. It draws four numbers with ``rng.random()`` - for drop-request, reorder,
   duplicate and drop-response, always all four and always in that order, so
   the fate of the n-th message depends only on the seed and ``n`` (not on the
   other probabilities, nor on the outcome of earlier messages).
2. If another message to the same peer is being held (see 5), this call is its
   *overtaker*: when this call finishes, whatever its outcome, the held message
   is released. An overtaker is never held itself.
3. Peer partitioned: ``TransportError``, nothing delivered.
4. ``draw < drop_request``: ``TransportError``, nothing delivered.
5. ``draw < reorder`` and nothing is held for the peer: the message is *held*.
   It is released by whichever comes first: the next ``send()`` to that peer
   finishing, whatever its outcome (so that later message reaches the peer
   first: a swap); ``max_hold`` seconds since it was held (timed with the
   injectable ``sleep``; ``None`` = no limit), even if an overtaker is still in
   flight; :meth:`flush`. Then it goes through steps 6-8 with its own draws.
   If the peer is partitioned when the message is released, it is lost
   (``TransportError``). :meth:`close` fails held messages (``TransportError``).
6. Delivery: ``await inner.send(peer, message)``.
7. ``draw < duplicate``: delivered a second time (a deep copy, as a second
   network delivery would decode a fresh object); the second reply is returned.
8. ``draw < drop_response``: the message was delivered, but the caller gets a
   ``TransportError`` (the sender retries: a duplicate on the wire).

Errors raised by the inner transport propagate unchanged.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields, replace
from types import TracebackType
from typing import Any

from geolimit.errors import ConfigError
from geolimit.replication import wire
from geolimit.replication.transport import Transport, TransportError

__all__ = ["FaultCounters", "FaultyTransport", "PeerFaults"]

_PROBABILITIES = ("drop_request", "drop_response", "duplicate", "reorder")


class _Unset(enum.Enum):
    UNSET = 0


@dataclass(frozen=True, slots=True)
class PeerFaults:
    """Fault settings for one peer (probabilities in [0, 1])."""

    drop_request: float = 0.0
    drop_response: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    max_hold: float | None = 0.05  # seconds a held message waits for an overtaker
    partitioned: bool = False

    def __post_init__(self) -> None:
        for name in _PROBABILITIES:
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name} must be a probability in [0, 1], got {value!r}")
        if self.max_hold is not None and not self.max_hold >= 0.0:
            raise ConfigError(f"max_hold must be >= 0 or None, got {self.max_hold!r}")


@dataclass(slots=True)
class FaultCounters:
    """What a :class:`FaultyTransport` did for one peer."""

    sends: int = 0  # send() calls
    delivered: int = 0  # inner.send() calls that returned a reply (duplicates included)
    inner_errors: int = 0  # inner.send() calls that raised
    partitioned: int = 0  # refused by the partition switch (or lost while held)
    dropped_requests: int = 0  # never delivered
    dropped_responses: int = 0  # delivered, but the caller got a TransportError
    duplicated: int = 0  # delivered twice
    held: int = 0  # held back for reordering
    reordered: int = 0  # held, then released after a later send() to the peer finished
    hold_expired: int = 0  # held, then released by max_hold or flush() with no overtaker

    def __add__(self, other: FaultCounters) -> FaultCounters:
        return FaultCounters(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


class FaultyTransport:
    """A :class:`Transport` that injects drops, duplicates, reordering and partitions per peer."""

    def __init__(
        self,
        inner: Transport,
        rng: random.Random,
        *,
        default: PeerFaults | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.inner = inner
        self._rng = rng
        self._default = default or PeerFaults()
        self._sleep = sleep
        self._faults: dict[str, PeerFaults] = {}
        self._counters: dict[str, FaultCounters] = {}
        self._holds: dict[str, asyncio.Future[bool]] = {}
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> FaultyTransport:
        """Nothing to start (no background tasks); for symmetry with other netsim objects."""
        if self._closed:
            raise TransportError("FaultyTransport is closed")
        return self

    async def stop(self) -> None:
        await self.close()

    async def close(self) -> None:
        """Fail held messages with ``TransportError``, then close the inner transport."""
        if self._closed:
            return
        self._closed = True
        holds, self._holds = self._holds, {}
        for future in holds.values():
            if not future.done():
                future.set_exception(TransportError("FaultyTransport closed while holding the message"))
        await self.inner.close()

    async def __aenter__(self) -> FaultyTransport:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- settings -----------------------------------------------------------------

    def faults(self, peer: str) -> PeerFaults:
        """The settings in force for ``peer`` (the default unless configured)."""
        return self._faults.get(peer, self._default)

    def configure(
        self,
        peer: str,
        faults: PeerFaults | None = None,
        *,
        drop_request: float | None = None,
        drop_response: float | None = None,
        duplicate: float | None = None,
        reorder: float | None = None,
        max_hold: float | _Unset | None = _Unset.UNSET,
        partitioned: bool | None = None,
    ) -> PeerFaults:
        """Replace ``peer``'s settings with ``faults`` (or its current ones) updated by keywords.

        Takes effect for the next ``send()``; returns the new settings.
        """
        changes: dict[str, Any] = {
            name: value
            for name, value in (
                ("drop_request", drop_request),
                ("drop_response", drop_response),
                ("duplicate", duplicate),
                ("reorder", reorder),
                ("partitioned", partitioned),
            )
            if value is not None
        }
        if not isinstance(max_hold, _Unset):
            changes["max_hold"] = max_hold
        new = replace(faults if faults is not None else self.faults(peer), **changes)
        self._faults[peer] = new
        return new

    def reset(self, peer: str | None = None) -> None:
        """Back to the default settings for ``peer`` (or every peer)."""
        if peer is None:
            self._faults.clear()
        else:
            self._faults.pop(peer, None)

    def partition(self, peer: str) -> None:
        self.configure(peer, partitioned=True)

    def heal(self, peer: str) -> None:
        self.configure(peer, partitioned=False)

    # -- observation --------------------------------------------------------------

    def counters(self, peer: str) -> FaultCounters:
        """A snapshot of ``peer``'s counters."""
        return replace(self._counters.get(peer, FaultCounters()))

    def totals(self) -> FaultCounters:
        return sum(self._counters.values(), FaultCounters())

    def holding(self, peer: str) -> bool:
        """True while a message to ``peer`` is held back for reordering."""
        return peer in self._holds

    def flush(self, peer: str | None = None) -> int:
        """Release held messages (of ``peer`` or all) now, without an overtaker."""
        peers = list(self._holds) if peer is None else [peer]
        released = 0
        for name in peers:
            future = self._holds.pop(name, None)
            if future is not None and not future.done():
                future.set_result(False)
                released += 1
        return released

    # -- sending ------------------------------------------------------------------

    async def send(self, peer: str, message: wire.Message) -> wire.Message:
        if self._closed:
            raise TransportError("FaultyTransport is closed")
        draws = tuple(self._rng.random() for _ in range(4))
        counters = self._counters.setdefault(peer, FaultCounters())
        counters.sends += 1
        overtaken = self._holds.pop(peer, None)
        try:
            return await self._send(peer, message, draws, counters, may_hold=overtaken is None)
        finally:
            if overtaken is not None and not overtaken.done():
                overtaken.set_result(True)

    async def _send(
        self,
        peer: str,
        message: wire.Message,
        draws: tuple[float, ...],
        counters: FaultCounters,
        may_hold: bool,
    ) -> wire.Message:
        drop_request, reorder, duplicate, drop_response = draws
        faults = self.faults(peer)
        if faults.partitioned:
            counters.partitioned += 1
            raise TransportError(f"{peer} unreachable: partitioned (netsim)")
        if drop_request < faults.drop_request:
            counters.dropped_requests += 1
            raise TransportError(f"{peer} unreachable: request dropped (netsim)")
        if may_hold and reorder < faults.reorder:
            counters.held += 1
            if await self._hold(peer, faults.max_hold):
                counters.reordered += 1
            else:
                counters.hold_expired += 1
            if self.faults(peer).partitioned:
                counters.partitioned += 1
                raise TransportError(f"{peer} unreachable: partitioned while held (netsim)")
        reply = await self._deliver(peer, message, counters)
        if duplicate < faults.duplicate:
            counters.duplicated += 1
            reply = await self._deliver(peer, copy.deepcopy(message), counters)
        if drop_response < faults.drop_response:
            counters.dropped_responses += 1
            raise TransportError(f"{peer} unreachable: response dropped (netsim)")
        return reply

    async def _hold(self, peer: str, max_hold: float | None) -> bool:
        """Wait for release; True if an overtaker released us, False on timeout/flush."""
        release: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._holds[peer] = release
        timer = None if max_hold is None else asyncio.ensure_future(self._sleep(max_hold))
        waiters: set[asyncio.Future[Any]] = {release} if timer is None else {release, timer}
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if release.done():
                return release.result()  # raises TransportError after close()
            assert timer is not None
            timer.result()  # an injected sleep that crashed surfaces here
            return False
        finally:
            if self._holds.get(peer) is release:
                del self._holds[peer]
            if timer is not None and not timer.done():
                timer.cancel()
                await asyncio.gather(timer, return_exceptions=True)

    async def _deliver(self, peer: str, message: wire.Message, counters: FaultCounters) -> wire.Message:
        try:
            reply = await self.inner.send(peer, message)
        except Exception:
            counters.inner_errors += 1
            raise
        counters.delivered += 1
        return reply
