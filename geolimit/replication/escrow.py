"""Escrow replication: one region's rebalancing rounds and the exchange of escrow fields.

Every round the agent (:meth:`EscrowReplicator.round`):

1. publishes the regions for the apps (``@escrow`` in the rules hash);
2. releases the hold of shards whose escrow state is intact again: one window
   after the hold began and after a complete pull from every peer started past it;
3. takes the escrow keys that changed, plans each key's rebalance
   (:func:`geolimit.core.escrow.plan_round`) and writes this region's advert and
   gifts (``escrow_give.lua`` re-checks the spare in Redis);
4. pushes every key whose replicated fields changed to every peer (``push``,
   acknowledged; a failed push stays queued and is retried with backoff; at most
   :data:`MAX_PENDING` keys wait per peer, the periodic pull repairs the rest);
5. pulls every peer's whole escrow state at start, after a peer comes back, after
   refusing its push for a claim about this region's own transfers, and every
   ``pull_interval`` (``pull``: pages of keys from a SCAN cursor).

Peers' fields are vetted (:func:`~geolimit.store.escrow_fields.vet_fields`)
before anything is written; a bad message is refused whole. Only this region
writes its own transfers (``t:<me>:...``, what it gave away): a push claiming more
than it recorded is refused, and the pull that follows is the repair path, which
merges them (docs/design.md, escrow mode: own transfers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from geolimit.aio import cancel_and_wait
from geolimit.core.escrow import plan_round, share
from geolimit.core.keys import MAX_SUBJECT_BYTES, KeyLayout
from geolimit.core.rule import Rule
from geolimit.errors import GeolimitError, ProtocolError
from geolimit.replication.clock_steps import SteppedClock
from geolimit.replication.escrow_io import OWN_CLAIM, EscrowStore, Held
from geolimit.replication.escrow_wire import MAX_KEYS, EscrowMessage
from geolimit.store.escrow_fields import own_figures, state_of, vet_fields

__all__ = ["EscrowPeer", "EscrowReplicator", "EscrowTransport"]

log = logging.getLogger("geolimit.escrow")

#: Keys waiting per peer; beyond it the oldest are dropped (the peer's next pull repairs them).
MAX_PENDING = 100_000
#: Keys per push message.
PUSH_KEYS = 500


class EscrowTransport(Protocol):
    async def send(self, peer: str, message: EscrowMessage) -> EscrowMessage: ...

    async def close(self) -> None: ...


@dataclass
class EscrowPeer:
    name: str
    pending: dict[bytes, tuple[bytes, dict[bytes, bytes]]] = field(default_factory=dict)  # key -> (suffix, fields)
    failures: int = 0
    next_attempt: float = 0.0
    last_ok: float | None = None  # clock time of the last answered message (or a message received from it)
    pushing: bool = False
    pulling: bool = False
    pull_due: float = 0.0
    pulled_since_us: int | None = None  # decision time when the last complete pull began
    #: Shards in which the last complete pull found this region's own writes (its adverts
    #: or its gifts): it held escrow state there before, so a hold there lasts a window.
    traced: frozenset[int] = frozenset()
    #: Held shards in which the peer had recorded an earlier hold of this region (its first
    #: pull after a deployment records one): this Redis held escrow state there and lost it,
    #: whether or not any of its admissions were advertised before, so the hold lasts a window.
    known: frozenset[int] = frozenset()
    pulls: int = 0
    last_error: str | None = None


class EscrowReplicator:
    def __init__(
        self, region: str, peers: Sequence[str], store: EscrowStore, rules: Mapping[str, Rule],
        transport: EscrowTransport, *, owned: Sequence[int], interval: float, timeout: float,
        pull_interval: float, now_us: Callable[[], int | None], clock: Callable[[], float] = time.time,
    ) -> None:
        self.region = region
        self.regions = tuple(sorted({region, *peers}))
        self.store = store
        self.transport = transport
        self.owned = list(owned)
        self.interval = interval
        self.timeout = timeout
        self.pull_interval = pull_interval
        self._now_us = now_us
        self.clock = SteppedClock(clock, self._shift_times, f"region {region} (escrow)")  # clock_steps.py
        self.peers = {p: EscrowPeer(p) for p in peers}
        self.rules: dict[str, Rule] = {}
        self.set_rules(rules)
        self._tasks: set[asyncio.Task[None]] = set()
        self.held: int | None = None  # shards whose escrow rules are denied until restored (None: not looked yet)
        self.holds = Held()  # the last round's: held shards, and every shard's hold start (sent with pulls)
        self.stats: dict[str, int] = dict.fromkeys(
            ("rounds", "keys", "given", "pushed", "merged", "refused", "pulled", "released", "dropped",
             "own_refused", "own_relearned"), 0)

    @property
    def layout(self) -> KeyLayout:
        return self.store.layout

    def set_rules(self, rules: Mapping[str, Rule]) -> None:
        self.rules = {n: r for n, r in sorted(rules.items()) if r.escrow}

    async def now_us(self) -> int:
        injected = self._now_us()
        return injected if injected is not None else await self.store.time_us()

    def wait_us(self) -> int:
        """How soon rights a peer gives can arrive: two rounds and two one-way trips (taken as a timeout/4)."""
        return int((2 * self.interval + self.timeout / 2) * 1_000_000)

    def live(self) -> set[str]:
        """Peers heard from within three rounds and a round trip: only they get rights."""
        now = self.clock()
        horizon = 3 * self.interval + min(self.timeout, 1.0)
        return {p.name for p in self.peers.values() if p.last_ok is not None and now - p.last_ok <= horizon}

    def _shift_times(self, by: float) -> None:
        """The host's clock stepped back: the peers' recorded times move with it (else a dead peer
        stayed live, and pushes, pulls and retries waited, for as long as the step)."""
        for peer in self.peers.values():
            if peer.last_ok is not None:
                peer.last_ok += by
            if peer.next_attempt:
                peer.next_attempt += by
            if peer.pull_due:
                peer.pull_due += by

    # -- rounds ---------------------------------------------------------------

    async def round(self) -> None:
        self.stats["rounds"] += 1
        if not self.rules:
            return
        await self.store.publish(self.regions, self.wait_us())
        now = await self.now_us()
        await self._release(now)
        await self._rebalance(now)
        self._start(self.clock())

    async def _release(self, now: int) -> None:
        held = self.holds = await self.store.holds(self.owned, now)
        longest = max(r.window_us for r in self.rules.values())
        settle = int(self.timeout * 1_000_000)  # pushes in flight at the loss have landed by then
        self.held = len(held.since)
        released: list[int] = []
        for shard, since in held.since.items():
            fresh = [p for p in self.peers.values() if (p.pulled_since_us or 0) < since + settle]
            # No peer holds anything this region wrote in the shard, nor saw an earlier hold of
            # it: a new deployment, not a loss of state: no window to wait out.
            unknown_here = not any(shard in p.traced or shard in p.known for p in self.peers.values())
            if not fresh and (unknown_here or now >= since + longest):
                await self.store.release(shard)
                self.held -= 1
                self.stats["released"] += 1
                released.append(shard)
            elif now >= since + settle:
                for peer in fresh:  # ask for a pull that begins after the hold (once it is not running)
                    peer.pull_due = min(peer.pull_due, self.clock())
        if released:  # one line a round (a new region releases every shard at once)
            shown = ", ".join(map(str, released[:8])) + (f" and {len(released) - 8} more" if len(released) > 8 else "")
            log.info("region %s: escrow state of %d shard(s) restored from every peer (%s)", self.region,
                     len(released), shown)

    async def _rebalance(self, now: int) -> None:
        changed = await self.store.drain(self.owned)
        live = self.live()
        plans = []
        for key, fields in changed:
            try:
                _, name, _ = self.layout.parse_data_key(key)
            except ValueError:
                continue
            rule = self.rules.get(name)
            if rule is None:
                continue
            own = own_figures(fields, rule, now)
            _, gifts = plan_round(state_of(fields), self.region, self.regions, rule.limit, own.used, own.demand,
                                  own.bucket, rule.buckets, live)
            plans.append((key, rule, share(rule.limit, self.regions, self.region), gifts))
        self.stats["keys"] += len(plans)
        for given in await self.store.give(plans, self._now_us()):
            self.stats["given"] += given.given
            if given.changed and given.fields:
                _, name, subject = self.layout.parse_data_key(given.key)
                for peer in self.peers.values():
                    peer.pending.pop(given.key, None)  # re-queued at the end: the oldest go first
                    peer.pending[given.key] = (name.encode() + b":" + subject, given.fields)
                    if len(peer.pending) > MAX_PENDING:
                        peer.pending.pop(next(iter(peer.pending)))
                        self.stats["dropped"] += 1

    def _start(self, now: float) -> None:
        for peer in self.peers.values():
            if now < peer.next_attempt:
                continue
            if peer.pending and not peer.pushing:
                peer.pushing = True
                self._spawn(self._push(peer))
            if not peer.pulling and now >= peer.pull_due:
                peer.pulling = True
                self._spawn(self._pull(peer))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self) -> None:
        """Wait for the pushes and pulls started so far."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks))
        await self.transport.close()

    def _message(self, kind: str, peer: str, **extra: Any) -> EscrowMessage:
        return EscrowMessage(kind, self.region, peer, self.layout.shards,
                             {n: (r.window_us, r.resolution_us) for n, r in self.rules.items()}, **extra)

    async def _push(self, peer: EscrowPeer) -> None:
        try:
            while peer.pending:
                batch = list(peer.pending.items())[:PUSH_KEYS]
                message = self._message("push", peer.name, keys=[(s, _pairs(f)) for _, (s, f) in batch])
                if not await self._send(peer, message):
                    return
                for key, item in batch:
                    if peer.pending.get(key) is item:
                        del peer.pending[key]
                self.stats["pushed"] += len(batch)
        finally:
            peer.pushing = False

    async def _pull(self, peer: EscrowPeer) -> None:
        try:
            started = await self.now_us()
            cursor: tuple[int, int, int] | None = (0, 0, 0)
            traced: set[int] = set()
            known: set[int] = set()
            held, holds = self.holds, self.holds.starts
            while cursor is not None:
                reply = await self._send(peer, self._message("pull", peer.name, cursor=cursor, holds=holds))
                if reply is None:
                    return
                self.stats["pulled"] += len(reply.keys)
                await self.merge(reply, None, repair=True)  # vets the page first
                traced.update(self._traces(reply))
                known.update(s for s in reply.known if s in held.since)
                holds = {}  # recorded by the first page
                cursor = None if reply.done else reply.cursor
            peer.traced = frozenset(traced)
            peer.known = frozenset(known)
            peer.pulled_since_us = started
            peer.pulls += 1
            peer.pull_due = self.clock() + self.pull_interval
        except GeolimitError as exc:
            peer.last_error = str(exc)[:300]
            peer.pull_due = self.clock() + min(self.pull_interval, max(self.interval, 1.0))
        finally:
            peer.pulling = False

    def _traces(self, page: EscrowMessage) -> set[int]:
        """Shards of ``page`` holding fields this region wrote: its advert or its gifts."""
        advert, gifts = b"a:" + self.region.encode(), b"t:" + self.region.encode() + b":"
        return {self.layout.shard_of(suffix.partition(b":")[2]) for suffix, fields in page.keys
                if any(name == advert or name.startswith(gifts) for name in _names(fields))}

    async def _send(self, peer: EscrowPeer, message: EscrowMessage) -> EscrowMessage | None:
        try:
            reply = await self.transport.send(peer.name, message)
        except GeolimitError as exc:
            peer.failures += 1
            peer.last_error = str(exc)[:300]
            peer.next_attempt = self.clock() + min(2 * self.interval * 2 ** min(peer.failures, 6), 5.0)
            if peer.failures in (1, 10) or peer.failures % 100 == 0:
                log.warning("region %s: escrow exchange with %s failed (%d in a row): %s", self.region, peer.name,
                            peer.failures, exc)
            return None
        if peer.failures:
            peer.pull_due = 0.0  # back after a failure: pull what it missed
        peer.failures = 0
        peer.next_attempt = 0.0
        peer.last_ok = self.clock()
        return reply

    # -- receiving ------------------------------------------------------------

    async def receive(self, message: EscrowMessage, admit: Callable[[], Awaitable[object]] | None = None
                      ) -> EscrowMessage:
        """Answer a peer's authenticated message (ProtocolError: refused, nothing written)."""
        peer = self.peers.get(message.sender)
        if peer is None or message.dest != self.region:
            raise ProtocolError(f"escrow: message from {message.sender!r} to {message.dest!r} is not for this region")
        if message.shards != self.layout.shards:
            raise ProtocolError(f"escrow: peer has {message.shards} shards, this region {self.layout.shards}")
        if message.kind == "push":
            try:
                await self.merge(message, admit)
            except ProtocolError as exc:
                if OWN_CLAIM in str(exc):  # refused; the peer's whole state is the repair path
                    self.stats["own_refused"] += 1
                    peer.pull_due = 0.0
                raise
            reply = self._message("ack", peer.name)
        elif message.kind == "pull":
            if admit is not None:
                await admit()
            rules = list(self.rules.values())
            known = await self.store.recall(peer.name, message.holds)
            keys, cursor = await self.store.page(rules, message.cursor or (0, 0, 0))
            reply = self._message("page", peer.name, keys=[(s, _pairs(f)) for s, f in keys], cursor=cursor,
                                  done=cursor is None, known=known)
        else:
            raise ProtocolError(f"escrow: a peer cannot send {message.kind!r}")
        peer.last_ok = self.clock()
        return reply

    async def merge(self, message: EscrowMessage, admit: Callable[[], Awaitable[object]] | None, *,
                    repair: bool = False) -> int:
        """Vet every key of ``message``, then merge them (nothing is written if one is bad).
        ``repair``: a page this region pulled, whose claims about its own transfers are merged."""
        accepted = {n for n, s in message.rules.items()
                    if n in self.rules and (self.rules[n].window_us, self.rules[n].resolution_us) == s}
        by_shard: dict[int, list[tuple[bytes, Rule, int, list[tuple[bytes, bytes]]]]] = {}
        if len(message.keys) > MAX_KEYS:
            raise ProtocolError(f"escrow: more than {MAX_KEYS} keys")
        if len({suffix for suffix, _ in message.keys}) < len(message.keys):
            raise ProtocolError("escrow: a key is given twice")
        for suffix, fields in message.keys:
            name, sep, subject = suffix.partition(b":")
            if not sep or len(subject) > MAX_SUBJECT_BYTES:
                raise ProtocolError("escrow: a key is rule:subject, the subject at most 4096 bytes")
            pairs = vet_fields(fields, self.regions)
            rule = self.rules.get(name.decode(errors="replace"))
            if rule is None or rule.name not in accepted or not pairs:
                continue
            by_shard.setdefault(self.layout.shard_of(subject), []).append(
                (self.layout.data_key(rule.name, subject), rule, share(rule.limit, self.regions, self.region), pairs))
        now_us = self._now_us()
        if by_shard:  # a key grown past what a message carries, a claim about our own transfers: refused
            await self.store.check(by_shard, now_us, repair=repair)
        if admit is not None:
            await admit()
        if not by_shard:
            return 0
        changed, raised = await self.store.merge(by_shard, now_us, repair=repair)
        self.stats["merged"] += changed
        if raised:
            self.stats["own_relearned"] += raised
            log.warning("region %s: %s holds %d of this region's own escrow transfers above what this Redis "
                        "recorded (lost writes or an expired key here, or a gift someone forged in this region's "
                        "name); merged: this region gave them, as far as the others know", self.region,
                        message.sender, raised)
        return changed

    def status(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "rules": sorted(self.rules),
            "held_shards": self.held,
            "stats": dict(self.stats),
            "peers": {p.name: {"pending": len(p.pending), "failures": p.failures, "pulls": p.pulls,
                               "last_contact_age": None if p.last_ok is None else round(now - p.last_ok, 3),
                               "last_error": p.last_error} for p in self.peers.values()},
        }


def _names(flat: Sequence[Any]) -> list[bytes]:
    """The field names of a flat ``[name, value, ...]`` list."""
    return [x for x in flat[0::2] if isinstance(x, bytes)]


def _pairs(fields: Mapping[bytes, bytes]) -> list[bytes]:
    out: list[bytes] = []
    for name, value in fields.items():
        out += (name, value)
    return out
