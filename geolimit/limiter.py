"""The synchronous limiter: one atomic Lua script call per decision."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import redis
import redis.cluster
from redis.exceptions import RedisError

from geolimit.core.clock import Clock
from geolimit.core.decision import Decision
from geolimit.core.keys import KeyLayout, encode_subject
from geolimit.core.rule import Rule
from geolimit.core.usage import Usage
from geolimit.errors import StorageError
from geolimit.limiter_base import ESCROW_FIELD, LimiterBase, OnError, RuleSpec
from geolimit.store.connect import check_client, open_sync_store
from geolimit.store.protocol import (
    HitRequest,
    decode_hit,
    encode_hit,
    encode_hit_resp,
    encode_reset,
)
from geolimit.store.redis_store import ClusterStore, RedisStore, SyncStore, describe_error
from geolimit.store.scripts import load_script

__all__ = ["Limiter"]

_HIT = load_script("hit")
_RESET = load_script("reset")


class Limiter(LimiterBase):
    """Decides requests against this region's Redis.

    >>> limiter = Limiter.from_url("redis://127.0.0.1:6379/0", region="us-east",
    ...                            rules=[Rule("api", limit=5, window=10)])
    >>> d = limiter.hit("api", "user:42")
    >>> d.allowed, d.remaining

    Thread-safe. ``on_error`` decides what happens when Redis cannot be reached:
    ``"raise"`` (default) raises :class:`StorageError`; ``"allow"`` and ``"deny"``
    return a decision marked ``degraded``.
    """

    def __init__(
        self,
        store: SyncStore | redis.Redis | redis.cluster.RedisCluster,
        region: str,
        rules: Iterable[Rule],
        *,
        prefix: str = "gl",
        shards: int = 64,
        on_error: OnError = "raise",
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            region=region, rules=rules, layout=KeyLayout(prefix, shards), on_error=on_error, clock=clock
        )
        check_client(store, asynchronous=False)
        if isinstance(store, redis.cluster.RedisCluster):
            store = ClusterStore(store)
        elif isinstance(store, redis.Redis):
            store = RedisStore(store.connection_pool)
        self._store: SyncStore = store

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
        **redis_options: Any,
    ) -> Limiter:
        """Connect to ``redis://``, ``rediss://``, ``unix://`` or ``redis+cluster://`` URLs.

        ``timeout`` (seconds) bounds connecting and every command; extra keyword
        arguments go to redis-py.
        """
        store = open_sync_store(url, cluster=cluster, timeout=timeout, **redis_options)
        return cls(store, region, rules, prefix=prefix, shards=shards, on_error=on_error, clock=clock)

    @property
    def store(self) -> SyncStore:
        return self._store

    def hit(self, rules: RuleSpec, subject: str | bytes, cost: int = 1) -> Decision:
        """Consume ``cost`` from every named rule if all of them allow it."""
        self._check_before_building()
        return self._decide([self._request(rules, subject, cost, True)])[0]

    def peek(self, rules: RuleSpec, subject: str | bytes, cost: int = 1) -> Decision:
        """Would a hit of ``cost`` be allowed now? Consumes nothing."""
        self._check_before_building()
        return self._decide([self._request(rules, subject, cost, False)])[0]

    def _check_before_building(self) -> None:
        """Look for the regions of escrow mode before a request is built with them."""
        if self._escrow is None and self._rules_check_due() and self._has_escrow():
            with contextlib.suppress(StorageError):  # _decide meets the same error and applies on_error
                self._check_rules()

    def hit_many(
        self, requests: Sequence[tuple[RuleSpec, str | bytes, int]], *, max_batch: int = 128
    ) -> list[Decision]:
        """Decide several independent requests with one script call per ``max_batch``
        requests (per hash slot on a cluster), so Redis is never blocked for long."""
        built = [self._request(rules, subject, cost, True) for rules, subject, cost in requests]
        groups: dict[int, list[int]] = {}
        for i, request in enumerate(built):
            groups.setdefault(request.shard if isinstance(self._store, ClusterStore) else 0, []).append(i)
        out: list[Decision | None] = [None] * len(built)
        for indices in groups.values():
            for start in range(0, len(indices), max_batch):
                chunk = indices[start : start + max_batch]
                for i, decision in zip(chunk, self._decide([built[i] for i in chunk]), strict=True):
                    out[i] = decision
        return [d for d in out if d is not None]

    def reset(self, rules: RuleSpec, subject: str | bytes) -> None:
        """Forget the counts of ``subject`` for the given rules, in every region.

        The reset replicates as per-slot floors; hits made elsewhere that this
        region has not seen yet still count.
        """
        chosen = self.reset_rules(rules)
        data = encode_subject(subject)
        if self._rules_check_due():
            self._check_rules()
        self._store.run(_RESET, encode_reset(self._layout, chosen, data, self._now(), self._region_b, self._nonce))

    def usage(self, rule: str, subject: str | bytes) -> Usage:
        """The global count of ``subject`` under ``rule``, by region (strict window)."""
        chosen = self.rule(rule)
        data = encode_subject(subject)
        shard = self._layout.shard_of(data)
        if chosen.escrow:
            self._check_before_building()  # the regions, for this region's rights
        registry, fields = self._store.read(
            [self._layout.registry_key(shard), self._layout.data_key(chosen.name, data)]
        )
        return self._summarize(chosen, data, registry, fields, self._now() or self.redis_time_us())

    def redis_time_us(self) -> int:
        """Redis ``TIME`` in microseconds."""
        try:
            seconds, micros = self._store.client().time()
        except RedisError as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc
        return int(seconds) * 1_000_000 + int(micros)

    def close(self) -> None:
        self.degraded_lines.close()  # what the log holds back
        self._store.close()

    def __enter__(self) -> Limiter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _decide(self, requests: list[HitRequest]) -> list[Decision]:
        try:
            if self._rules_check_due():
                self._check_rules()
            store = self._store
            if isinstance(store, RedisStore):
                reply = store.run_resp(_HIT, *encode_hit_resp(requests, self._now(), self._region_b, self._nonce))
            else:
                reply = store.run(_HIT, encode_hit(requests, self._now(), self._region_b, self._nonce))
            return decode_hit(reply, requests)
        except StorageError as exc:
            return self._degrade(requests, exc)

    def _check_rules(self) -> None:
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
            *_, theirs, _, escrow = pipe.execute()
        except RedisError as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc
        self._verify_rule_specs(names, specs, theirs)
        self._apply_escrow_field(escrow)
        self._rules_checked()
