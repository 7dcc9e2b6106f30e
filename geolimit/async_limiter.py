"""The asyncio limiter, with automatic pipelining.

Concurrent calls are coalesced: every request submitted while a batch is being
prepared or is in flight joins the next batch, and a batch is one ``hit.lua``
call (per hash slot on a cluster). Each request is still decided atomically and
independently; batching only saves round trips.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio
import redis.asyncio.cluster
from redis.exceptions import RedisError

from geolimit.aio import Coalescer
from geolimit.core.clock import Clock
from geolimit.core.decision import Decision
from geolimit.core.keys import KeyLayout, encode_subject
from geolimit.core.rule import Rule
from geolimit.core.usage import Usage
from geolimit.errors import StorageError
from geolimit.limiter_base import (
    ESCROW_FIELD,
    REGION_FIELD,
    LimiterBase,
    OnError,
    RuleSpec,
    rule_spec,
)
from geolimit.store.async_store import AsyncClusterStore, AsyncRedisStore, AsyncStore
from geolimit.store.connect import check_client, open_async_store
from geolimit.store.protocol import (
    HitRequest,
    decode_hit,
    encode_hit,
    encode_hit_resp,
    encode_reset,
)
from geolimit.store.redis_store import describe_error
from geolimit.store.scripts import load_script

__all__ = ["AsyncLimiter"]

_HIT = load_script("hit")
_RESET = load_script("reset")


class AsyncLimiter(LimiterBase):
    """The asyncio twin of :class:`~geolimit.Limiter`: the same API with ``await``.

    ``max_batch`` caps how many requests share one script call, and
    ``max_in_flight`` how many batches may be in flight at once.
    """

    def __init__(
        self,
        store: AsyncStore | redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster,
        region: str,
        rules: Iterable[Rule],
        *,
        prefix: str = "gl",
        shards: int = 64,
        on_error: OnError = "raise",
        clock: Clock | None = None,
        max_batch: int = 128,
        max_in_flight: int = 2,
    ) -> None:
        super().__init__(
            region=region, rules=rules, layout=KeyLayout(prefix, shards), on_error=on_error, clock=clock
        )
        check_client(store, asynchronous=True)
        if isinstance(store, redis.asyncio.cluster.RedisCluster):
            store = AsyncClusterStore(store)
        elif isinstance(store, redis.asyncio.Redis):
            store = AsyncRedisStore(store.connection_pool)
        self._store: AsyncStore = store
        self._batches: Coalescer[HitRequest, Decision] = Coalescer(self._decide, max_batch, max_in_flight)
        self._check_lock: asyncio.Lock | None = None

    @classmethod
    def from_url(
        cls,
        url: str,
        region: str,
        rules: Iterable[Rule],
        *,
        cluster: bool | None = None,
        prefix: str = "gl",
        shards: int = 64,
        on_error: OnError = "raise",
        clock: Clock | None = None,
        timeout: float | None = 1.0,
        max_batch: int = 128,
        max_in_flight: int = 2,
        **redis_options: Any,
    ) -> AsyncLimiter:
        store = open_async_store(url, cluster=cluster, timeout=timeout, **redis_options)
        return cls(
            store, region, rules, prefix=prefix, shards=shards, on_error=on_error, clock=clock,
            max_batch=max_batch, max_in_flight=max_in_flight,
        )

    @property
    def store(self) -> AsyncStore:
        return self._store

    async def hit(self, rules: RuleSpec, subject: str | bytes, cost: int = 1) -> Decision:
        if self._escrow is None and self._rules_check_due():
            await self._check_before_building()
        return await self._submit(self._request(rules, subject, cost, True))

    async def peek(self, rules: RuleSpec, subject: str | bytes, cost: int = 1) -> Decision:
        if self._escrow is None and self._rules_check_due():
            await self._check_before_building()
        return await self._submit(self._request(rules, subject, cost, False))

    async def _check_before_building(self) -> None:
        """Look for the regions of escrow mode before a request is built with them."""
        if self._has_escrow():
            with contextlib.suppress(StorageError):  # _decide meets the same error and applies on_error
                await self._check_rules()

    async def hit_many(self, requests: Sequence[tuple[RuleSpec, str | bytes, int]]) -> list[Decision]:
        built = [self._request(rules, subject, cost, True) for rules, subject, cost in requests]
        return list(await asyncio.gather(*(self._submit(r) for r in built)))

    async def reset(self, rules: RuleSpec, subject: str | bytes) -> None:
        chosen = self.reset_rules(rules)
        data = encode_subject(subject)
        await self._check_rules()
        await self._store.run(
            _RESET, encode_reset(self._layout, chosen, data, self._now(), self._region_b, self._nonce)
        )

    async def usage(self, rule: str, subject: str | bytes) -> Usage:
        chosen = self.rule(rule)
        data = encode_subject(subject)
        shard = self._layout.shard_of(data)
        if chosen.escrow and self._escrow is None and self._rules_check_due():
            await self._check_before_building()  # the regions, for this region's rights
        registry, fields = await self._store.read(
            [self._layout.registry_key(shard), self._layout.data_key(chosen.name, data)]
        )
        return self._summarize(chosen, data, registry, fields, self._now() or await self.redis_time_us())

    async def redis_time_us(self) -> int:
        try:
            seconds, micros = await self._store.client().time()
        except RedisError as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc
        return int(seconds) * 1_000_000 + int(micros)

    async def aclose(self) -> None:
        """Wait for in-flight batches, then close the connections."""
        await self._batches.wait()
        self.degraded_lines.close()  # what the log holds back
        await self._store.close()

    close = aclose

    async def __aenter__(self) -> AsyncLimiter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- batching ---------------------------------------------------------

    def _submit(self, request: HitRequest) -> asyncio.Future[Decision]:
        return self._batches.submit(request)

    async def _decide(self, requests: list[HitRequest]) -> list[Decision]:
        try:
            if self._rules_check_due():
                await self._check_rules()
            now = self._now()
            store = self._store
            if isinstance(store, AsyncRedisStore):
                reply = await store.run_resp(_HIT, *encode_hit_resp(requests, now, self._region_b, self._nonce))
                return decode_hit(reply, requests)
            groups: dict[int, list[int]] = {}
            for i, request in enumerate(requests):
                groups.setdefault(request.shard, []).append(i)
            parts = await asyncio.gather(
                *(
                    self._store.run(_HIT, encode_hit([requests[i] for i in idx], now, self._region_b, self._nonce))
                    for idx in groups.values()
                )
            )
            out: list[Decision | None] = [None] * len(requests)
            for idx, reply in zip(groups.values(), parts, strict=True):
                for i, decision in zip(idx, decode_hit(reply, [requests[i] for i in idx]), strict=True):
                    out[i] = decision
            return [d for d in out if d is not None]
        except StorageError as exc:
            return self._degrade(requests, exc)

    async def verify_rules(self, rules: Iterable[Rule]) -> None:
        """Raise ConfigError if any of ``rules`` disagrees with this Redis, or if the Redis
        belongs to another region (no changes made)."""
        rules = list(rules)
        names = [*(r.name for r in rules), REGION_FIELD]
        specs = [*(rule_spec(r) for r in rules), self._region_b]
        try:
            theirs = await self._store.client().hmget(self._layout.rules_key, names)
        except RedisError as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc
        self._verify_rule_specs(names, specs, [t if isinstance(t, bytes) or t is None else t.encode() for t in theirs])

    async def _check_rules(self) -> None:
        if self._check_lock is None:
            self._check_lock = asyncio.Lock()
        async with self._check_lock:
            if not self._rules_check_due():
                return
            names, specs, ttl_ms = self._rule_check_plan()
            if not names:
                return
            key = self._layout.rules_key
            try:
                pipe = self._store.client().pipeline(transaction=False)
                for name, spec in zip(names, specs, strict=True):
                    pipe.hsetnx(key, name, spec)
                pipe.hmget(key, names)
                pipe.pexpire(key, ttl_ms)
                pipe.hget(key, ESCROW_FIELD)
                *_, theirs, _, escrow = await pipe.execute()
            except RedisError as exc:
                raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc
            self._verify_rule_specs(names, specs, theirs)
            self._apply_escrow_field(escrow)
            self._rules_checked()
