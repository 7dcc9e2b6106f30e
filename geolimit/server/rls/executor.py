"""Running RLS transactions in Redis: the I/O shell of :mod:`geolimit.server.rls.decide`.

One Redis server: concurrent requests are coalesced (as
:class:`~geolimit.AsyncLimiter` coalesces hits): every transaction submitted
while a call is in flight joins the next call, and each call decides its
transactions one after the other, each atomically and all-or-nothing, whatever
shards their counters are in.

Redis Cluster: one script call can only touch one hash slot, and a counter's
slot follows from its own subject. A transaction whose counters share a shard
is one atomic call, as above. One that spans shards is decided in two steps:
every shard is peeked (``hit.lua``, consuming nothing) and, only if every
enforced counter has room, each shard is decided atomically by the RLS script.
A concurrent request that takes the last room of a counter between the two
steps makes the second step deny on that shard while the other shards have
counted the request: the error is on the safe side (counts for a denied
request, never an admission over a limit), and only under such a race.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Sequence

from geolimit.aio import Coalescer
from geolimit.async_limiter import AsyncLimiter
from geolimit.core.decision import Decision
from geolimit.server.rls.decide import Transaction, decode_batch, encode_batch, encode_batch_resp
from geolimit.server.rls.script import rls_script
from geolimit.store.async_store import AsyncRedisStore
from geolimit.store.protocol import decode_hit, encode_hit
from geolimit.store.scripts import load_script

__all__ = ["Executor"]

_HIT = load_script("hit")


class Executor:
    """Decides transactions for one agent's limiter (``max_batch`` per call, ``max_in_flight`` calls)."""

    def __init__(self, limiter: AsyncLimiter, region: bytes, now_us: Callable[[], int | None], *,
                 max_batch: int = 64, max_in_flight: int = 2) -> None:
        self._limiter = limiter
        self._region = region
        self._now_us = now_us
        self._nonce = secrets.token_hex(3).encode()  # tells apart registries created in the same microsecond
        self._script = rls_script()
        self._batches: Coalescer[Transaction, list[Decision]] = Coalescer(self._run, max_batch, max_in_flight)

    def decide(self, tx: Transaction) -> asyncio.Future[list[Decision]]:
        """The decision of each of ``tx``'s requests (counted only if the transaction is admitted).

        A future rather than a coroutine: the caller may await it or add a callback
        (no task per request on one Redis server).
        """
        if self._limiter.store.clustered:
            return asyncio.ensure_future(self._clustered(tx))
        return self._batches.submit(tx)

    async def wait(self) -> None:
        """Until the calls in flight are done."""
        await self._batches.wait()

    async def _prepare(self) -> int | None:
        """Register and check the rules in Redis when due (as the limiter's own calls do); the time."""
        limiter = self._limiter
        if limiter._rules_check_due():
            await limiter._check_rules()
        return self._now_us()

    async def _run(self, transactions: Sequence[Transaction]) -> list[list[Decision]]:
        now = await self._prepare()
        store = self._limiter.store
        if isinstance(store, AsyncRedisStore):  # pre-encoded: the rules' arguments are RESP already
            nargs, body = encode_batch_resp(transactions, now, self._region, self._nonce)
            return decode_batch(await store.run_resp(self._script, nargs, body), transactions)
        return decode_batch(await store.run(self._script, encode_batch(transactions, now, self._region, self._nonce)),
                            transactions)

    async def _clustered(self, tx: Transaction) -> list[Decision]:
        by_shard: dict[int, list[int]] = {}
        for i, request in enumerate(tx.requests):
            by_shard.setdefault(request.shard, []).append(i)
        if len(by_shard) == 1:
            return (await self._run([tx]))[0]
        parts = [_part(tx, indexes) for indexes in by_shard.values()]
        now = await self._prepare()
        store = self._limiter.store
        peeks = await asyncio.gather(*(
            store.run(_HIT, encode_hit(part.requests, now, self._region, self._nonce)) for part in parts
        ))
        decided = [decode_hit(reply, part.requests) for reply, part in zip(peeks, parts, strict=True)]
        room = all(d.allowed for part, ds in zip(parts, decided, strict=True)
                   for d, enforced in zip(ds, part.enforced, strict=True) if enforced)
        if room:
            replies = await asyncio.gather(*(
                store.run(self._script, encode_batch([part], now, self._region, self._nonce)) for part in parts
            ))
            decided = [decode_batch(reply, [part])[0] for reply, part in zip(replies, parts, strict=True)]
        out: list[Decision | None] = [None] * len(tx.requests)
        for indexes, decisions in zip(by_shard.values(), decided, strict=True):
            for i, decision in zip(indexes, decisions, strict=True):
                out[i] = decision
        return [d for d in out if d is not None]


def _part(tx: Transaction, indexes: Sequence[int]) -> Transaction:
    """The requests ``indexes`` of ``tx`` as a transaction of their own (descriptor fields unused)."""
    return Transaction(tx.domain, [], [], [tx.requests[i] for i in indexes], [tx.enforced[i] for i in indexes], [])
