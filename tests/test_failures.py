"""What happens when Redis is unreachable or restarts."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import pytest

from geolimit import AsyncLimiter, Limiter, Rule, StorageError
from geolimit.store.embedded import EmbeddedRedis


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def test_unreachable_redis_raises_storage_error_with_the_cause() -> None:
    limiter = Limiter.from_url(_closed_port_url(), region="e", rules=[Rule("api", 5, 10)], timeout=0.5)
    with pytest.raises(StorageError, match="Redis unreachable") as info:
        limiter.hit("api", "k")
    assert info.value.__cause__ is not None


@pytest.mark.parametrize(("policy", "allowed"), [("allow", True), ("deny", False)])
def test_fail_open_and_fail_closed_are_marked_degraded(
    policy: str, allowed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    limiter = Limiter.from_url(_closed_port_url(), region="e", rules=[Rule("api", 5, 10)], on_error=policy, timeout=0.5)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="geolimit"):
        first = limiter.hit("api", "k")
        second = limiter.hit("api", "k")
    assert first.allowed is allowed
    assert second.allowed is allowed
    assert first.degraded
    assert first.error
    assert "unreachable" in first.error
    assert sum("Redis unavailable" in r.message for r in caplog.records) == 1, "logged once, not per call"


async def test_async_fail_open() -> None:
    limiter = AsyncLimiter.from_url(_closed_port_url(), region="e", rules=[Rule("api", 5, 10)], on_error="allow", timeout=0.5)
    decision = await limiter.hit("api", "k")
    assert decision.allowed
    assert decision.degraded
    with pytest.raises(StorageError):
        await limiter.usage("api", "k")
    await limiter.aclose()


def test_a_restarted_redis_is_used_again_without_errors(redis_server_factory: Callable[..., EmbeddedRedis]) -> None:
    server = redis_server_factory()
    with Limiter.from_url(server.url, region="e", rules=[Rule("api", 5, 10)]) as limiter:
        assert limiter.hit("api", "k").remaining == 4
        server.restart()  # no persistence: the counts and the loaded scripts are gone
        assert limiter.hit("api", "k").remaining == 4


async def test_async_limiter_survives_a_restart(redis_server_factory: Callable[..., EmbeddedRedis]) -> None:
    server = redis_server_factory()
    async with AsyncLimiter.from_url(server.url, region="e", rules=[Rule("api", 5, 10)]) as limiter:
        assert (await limiter.hit("api", "k")).remaining == 4
        server.restart()
        assert (await limiter.hit("api", "k")).remaining == 4
