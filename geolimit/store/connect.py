"""Opening stores from URLs.

``redis://``, ``rediss://`` and ``unix://`` select one server;
``redis+cluster://`` and ``rediss+cluster://`` (or ``cluster=True``) select a
Redis Cluster, discovered from the node in the URL.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from geolimit.errors import ConfigError, StorageError
from geolimit.store.async_store import AsyncClusterStore, AsyncRedisStore, AsyncStore
from geolimit.store.redis_store import ClusterStore, RedisStore, SyncStore, describe_error

__all__ = ["open_async_store", "open_sync_store", "redact_url", "split_cluster_url"]

_SCHEMES = {"redis", "rediss", "unix"}
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to log)."""
    return re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", url)


def split_cluster_url(url: str, cluster: bool | None = None) -> tuple[bool, str]:
    """``(is_cluster, url redis-py understands)``; ConfigError for unknown schemes."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"invalid Redis URL {redact_url(str(url))!r}: expected redis://host:port/db")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # an unclosed IPv6 bracket
        raise ConfigError(f"invalid Redis URL {redact_url(url)!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme in _CLUSTER_SCHEMES:
        if cluster is False:
            raise ConfigError(f"{redact_url(url)!r} is a cluster URL but cluster=False was given")
        return True, urlunsplit(parts._replace(scheme=_CLUSTER_SCHEMES[scheme]))
    if scheme not in _SCHEMES:
        raise ConfigError(
            f"invalid Redis URL {redact_url(url)!r}: scheme must be redis, rediss, unix, "
            f"redis+cluster or rediss+cluster"
        )
    if scheme == "unix" and cluster:
        raise ConfigError("a Redis Cluster cannot be reached through a unix socket URL")
    return bool(cluster), url


def _options(timeout: float | None, kwargs: dict[str, Any], cluster: bool = False) -> dict[str, Any]:
    opts = dict(kwargs)
    if timeout is not None:
        opts.setdefault("socket_timeout", timeout)
        opts.setdefault("socket_connect_timeout", timeout)
        if cluster:
            # redis-py's cluster client retries a timed-out command (3 times by
            # default, refreshing the slot map in between), so one call against a
            # hung master took 4+ timeouts. A decision must honour the timeout:
            # no retries (MOVED/ASK redirections are followed regardless).
            opts.setdefault("retry", Retry(NoBackoff(), 0))
    opts.pop("decode_responses", None)
    return opts


def check_client(client: object, *, asynchronous: bool) -> None:
    """Refuse a redis-py client the limiter cannot use, saying what to pass instead: a client of
    the other kind (sync for :class:`~geolimit.AsyncLimiter`, asyncio for :class:`~geolimit.Limiter`),
    or one made with ``decode_responses=True`` (the scripts' replies are bytes)."""
    sync_types = (redis.Redis, redis.cluster.RedisCluster)
    async_types = (redis.asyncio.Redis, redis.asyncio.cluster.RedisCluster)
    name = f"{type(client).__module__}.{type(client).__qualname__}"
    if asynchronous and isinstance(client, sync_types):
        raise ConfigError(f"AsyncLimiter needs an asyncio client (redis.asyncio.Redis or redis.asyncio.RedisCluster), "
                          f"got {name}: use geolimit.Limiter with it, or AsyncLimiter.from_url(url, ...)")
    if not asynchronous and isinstance(client, async_types):
        raise ConfigError(f"Limiter needs a sync client (redis.Redis or redis.cluster.RedisCluster), got {name}: "
                          f"use geolimit.AsyncLimiter with it, or Limiter.from_url(url, ...)")
    if isinstance(client, (*sync_types, *async_types)) and client.get_encoder().decode_responses:
        raise ConfigError("this Redis client was made with decode_responses=True; geolimit reads raw bytes: pass a "
                          "client made without it (the default), e.g. redis.Redis(host, port), or use from_url(url, ...)")


def open_sync_store(
    url: str, *, cluster: bool | None = None, timeout: float | None = 1.0, **kwargs: Any
) -> SyncStore:
    is_cluster, plain = split_cluster_url(url, cluster)
    opts = _options(timeout, kwargs, is_cluster)
    try:
        if is_cluster:
            return ClusterStore(redis.cluster.RedisCluster.from_url(plain, **opts))
        return RedisStore(redis.ConnectionPool.from_url(plain, **opts))
    except (RedisError, ValueError, TypeError) as exc:
        if isinstance(exc, RedisError) and not isinstance(exc, ValueError):
            raise StorageError(f"cannot reach Redis at {redact_url(url)}: {describe_error(exc)}") from exc
        raise ConfigError(f"invalid Redis URL {redact_url(url)!r}: {exc}") from exc


def open_async_store(
    url: str, *, cluster: bool | None = None, timeout: float | None = 1.0, **kwargs: Any
) -> AsyncStore:
    is_cluster, plain = split_cluster_url(url, cluster)
    opts = _options(timeout, kwargs, is_cluster)
    try:
        if is_cluster:
            return AsyncClusterStore(redis.asyncio.cluster.RedisCluster.from_url(plain, **opts))
        return AsyncRedisStore(redis.asyncio.ConnectionPool.from_url(plain, **opts))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"invalid Redis URL {redact_url(url)!r}: {exc}") from exc
