"""@limited, limit() and alimit() on a real Redis: sync and async, raise and return, failures."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis

from geolimit import AsyncLimiter, ConfigError, GeolimitError, Limiter, Rule, StorageError
from geolimit.decorators import RateLimited, alimit, limit, limited
from tests.middleware.servers import closed_port, prefix

RULES = [Rule("calls", limit=3, window=10), Rule("tokens", limit=10, window=60)]


@pytest.fixture
def limiter(redis_url: str, redis_client: redis.Redis) -> Iterator[Limiter]:
    with Limiter.from_url(redis_url, region="east", rules=RULES, prefix=prefix()) as made:
        yield made


@pytest.fixture
async def alimiter(redis_url: str, redis_client: redis.Redis) -> AsyncIterator[AsyncLimiter]:
    async with AsyncLimiter.from_url(redis_url, region="east", rules=RULES, prefix=prefix()) as made:
        yield made


def test_sync_decorator_raises_with_the_decision_and_keys_by_arguments(limiter: Limiter) -> None:
    calls: list[str] = []

    @limited(limiter, "calls", subject=lambda user, **kw: f"user:{user}", cost=lambda user, **kw: kw.get("n", 1))
    def fetch(user: str, *, n: int = 1) -> str:
        """Fetch something."""
        calls.append(user)
        return user.upper()

    assert (fetch.__name__, fetch.__doc__) == ("fetch", "Fetch something.")
    assert fetch("ada") == "ADA"
    assert fetch("ada", n=2) == "ADA"
    with pytest.raises(RateLimited, match=r"rate limit 'calls' exceeded \(3 per window\): retry in") as caught:
        fetch("ada")
    assert isinstance(caught.value, GeolimitError)
    assert caught.value.decision.rule == "calls"
    assert caught.value.decision.remaining == 0
    assert 0 < caught.value.retry_after <= 11
    assert fetch("bob") == "BOB", "another subject, another bucket"
    assert calls == ["ada", "ada", "bob"], "a denied call never runs"
    assert limiter.usage("calls", "user:ada").total == 3
    with pytest.raises(RateLimited, match="the cost exceeds the limit"):
        fetch("eve", n=4)


def test_sync_decorator_default_subject_and_on_denied_return(limiter: Limiter) -> None:
    @limited(limiter, "calls", on_denied="return")
    def job() -> int:
        return 7

    assert [job() for _ in range(4)] == [7, 7, 7, None]
    assert limiter.usage("calls", f"{__name__}.{job.__qualname__}").total == 3


async def test_async_decorator_raise_and_return(alimiter: AsyncLimiter) -> None:
    @limited(alimiter, ["calls", "tokens"], subject="shared", cost=lambda n: n)
    async def spend(n: int) -> str:
        return f"spent {n}"

    @limited(alimiter, "calls", subject=lambda who: who, on_denied="return")
    async def poll(who: str) -> str:
        return f"polled {who}"

    assert await spend(3) == "spent 3"
    with pytest.raises(RateLimited) as caught:
        await spend(1)  # "tokens" would allow it, "calls" (3 per 10 s) does not: all or nothing
    assert caught.value.decision.rule == "calls"
    assert [r.allowed for r in caught.value.decision.results] == [False, True]
    assert (await alimiter.usage("tokens", "shared")).total == 3
    assert [await poll("a") for _ in range(4)] == ["polled a"] * 3 + [None]
    assert await poll("b") == "polled b"


async def test_context_managers(limiter: Limiter, alimiter: AsyncLimiter) -> None:
    with limit(limiter, "tokens", "user:1", cost=6) as decision:
        assert decision.allowed
        assert decision.remaining == 4
    ran = False
    with pytest.raises(RateLimited) as caught, limit(limiter, "tokens", "user:1", cost=6):
        ran = True
    assert not ran, "the block does not run when denied"
    assert caught.value.decision.rule == "tokens"
    with pytest.raises(KeyError), limit(limiter, "tokens", "user:2"):
        raise KeyError("errors inside the block propagate")

    async with alimit(alimiter, "tokens", "user:1", cost=10) as decision:
        assert decision.remaining == 0
    with pytest.raises(RateLimited):
        async with alimit(alimiter, "tokens", "user:1"):
            ran = True
    assert not ran


async def test_misuse_is_a_config_error(limiter: Limiter, alimiter: AsyncLimiter) -> None:
    async def coro() -> int:
        return 5

    def plain() -> None: ...

    with pytest.raises(ConfigError, match="needs an AsyncLimiter"):
        limited(limiter, "calls")(coro)
    with pytest.raises(ConfigError, match="needs a \\(sync\\) Limiter"):
        limited(alimiter, "calls")(plain)
    with pytest.raises(ConfigError, match="on_denied"):
        limited(limiter, "calls", on_denied="ignore")  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match="use `async with alimit"), limit(alimiter, "calls", "s"):  # type: ignore[arg-type]
        pass
    with pytest.raises(ConfigError, match="use `with limit"):
        async with alimit(limiter, "calls", "s"):  # type: ignore[arg-type]
            pass
    partial = limited(alimiter, "calls", "p")(functools.partial(coro))
    assert await partial() == 5, "partials of coroutine functions are async too"


@pytest.mark.parametrize("on_error", ["raise", "allow", "deny"])
async def test_unreachable_redis_follows_the_limiters_on_error(on_error: Any) -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"
    sync_down = Limiter.from_url(url, region="east", rules=RULES, on_error=on_error, timeout=0.3)
    async_down = AsyncLimiter.from_url(url, region="east", rules=RULES, on_error=on_error, timeout=0.3)
    sync_fn: Callable[[], str] = limited(sync_down, "calls", "s")(lambda: "ran")

    @limited(async_down, "calls", "s")
    async def async_fn() -> str:
        return "ran"

    try:
        if on_error == "raise":
            with pytest.raises(StorageError):
                sync_fn()
            with pytest.raises(StorageError):
                await async_fn()
        elif on_error == "allow":
            assert sync_fn() == "ran"
            assert await async_fn() == "ran"
            with limit(sync_down, "calls", "s") as decision:
                assert decision.degraded
        else:
            with pytest.raises(RateLimited) as caught:
                sync_fn()
            assert caught.value.decision.degraded
            with pytest.raises(RateLimited):
                await async_fn()
    finally:
        sync_down.close()
        await async_down.aclose()


def test_decorator_with_a_multi_rate_string(redis_url: str, redis_client: redis.Redis) -> None:
    """``Rule.parse_many`` turns "3/hour;2/minute" into rules that one decorator applies all-or-nothing."""
    rules = Rule.parse_many("export", "3/hour;2/minute")
    with Limiter.from_url(redis_url, region="east", rules=rules, prefix=prefix()) as limiter:
        @limited(limiter, rules, subject="tenant:1", on_denied="return")
        def export() -> str:
            return "done"

        assert [export() for _ in range(3)] == ["done", "done", None]
        assert limiter.usage("export.1h", "tenant:1").total == 2, "the denied call consumed nothing of the hour"
