"""Rate limits for plain Python functions: a decorator and context managers.

::

    @limited(limiter, "api", subject=lambda user, *a, **k: f"user:{user}")
    def fetch(user: str) -> bytes: ...          # sync function: a Limiter

    @limited(alimiter, "api", subject="batch-job", on_denied="return")
    async def poll() -> dict: ...               # async function: an AsyncLimiter; None when denied

    with limit(limiter, "api", "user:42") as decision: ...
    async with alimit(alimiter, "api", "user:42", cost=5) as decision: ...

A denied call raises :class:`RateLimited` (the function or block does not run),
or with ``on_denied="return"`` the decorated function returns ``None`` instead.
The limit is consumed when the call starts, whatever the function then does.
When Redis is unreachable the limiter's ``on_error`` applies: ``"raise"`` (its
default) raises :class:`~geolimit.StorageError`; ``"allow"`` / ``"deny"`` fail
open / closed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal, ParamSpec, TypeVar, cast, overload

from geolimit.async_limiter import AsyncLimiter
from geolimit.core.decision import Decision
from geolimit.errors import ConfigError, RateLimited
from geolimit.limiter import Limiter
from geolimit.limiter_base import RuleSpec

__all__ = ["RateLimited", "alimit", "limit", "limited"]

P = ParamSpec("P")
R = TypeVar("R")
Subject = str | bytes | Callable[..., str | bytes] | None
Cost = int | Callable[..., int]


def _qualified_name(func: Callable[..., Any]) -> str:
    while isinstance(func, functools.partial):
        func = func.func
    name = getattr(func, "__qualname__", None) or type(func).__qualname__
    return f"{getattr(func, '__module__', None) or '?'}.{name}"


@dataclass(frozen=True)
class _Spec:
    limiter: Limiter | AsyncLimiter
    rule: RuleSpec
    subject: Subject
    cost: Cost
    raise_on_denial: bool

    def wrap(self, func: Callable[..., Any]) -> Callable[..., Any]:
        default = _qualified_name(func)

        def resolve(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | bytes, int]:
            subject = self.subject(*args, **kwargs) if callable(self.subject) else self.subject
            cost = self.cost(*args, **kwargs) if callable(self.cost) else self.cost
            return (default if subject is None else subject), cost

        def denied(decision: Decision) -> None:
            if self.raise_on_denial:
                raise RateLimited(decision)

        if inspect.iscoroutinefunction(func):
            alimiter = self.limiter
            if not isinstance(alimiter, AsyncLimiter):
                raise ConfigError(f"@limited async function {default} needs an AsyncLimiter")

            @functools.wraps(func)
            async def async_call(*args: Any, **kwargs: Any) -> Any:
                subject, cost = resolve(args, kwargs)
                decision = await alimiter.hit(self.rule, subject, cost)
                if not decision.allowed:
                    return denied(decision)
                return await func(*args, **kwargs)

            return async_call

        limiter = self.limiter
        if not isinstance(limiter, Limiter):
            raise ConfigError(f"@limited function {default} is not async: it needs a (sync) Limiter")

        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            subject, cost = resolve(args, kwargs)
            decision = limiter.hit(self.rule, subject, cost)
            if not decision.allowed:
                return denied(decision)
            return func(*args, **kwargs)

        return call


class RaisingDecorator:
    """What ``limited(...)`` returns: decorates sync or async functions."""

    def __init__(self, spec: _Spec) -> None:
        self._spec = spec

    @overload
    def __call__(self, func: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]: ...
    @overload
    def __call__(self, func: Callable[P, R]) -> Callable[P, R]: ...
    def __call__(self, func: Callable[P, Any]) -> Callable[P, Any]:
        return cast(Callable[P, Any], self._spec.wrap(func))


class ReturningDecorator:
    """What ``limited(..., on_denied="return")`` returns: denied calls return ``None``."""

    def __init__(self, spec: _Spec) -> None:
        self._spec = spec

    @overload
    def __call__(
        self, func: Callable[P, Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R | None]]: ...
    @overload
    def __call__(self, func: Callable[P, R]) -> Callable[P, R | None]: ...
    def __call__(self, func: Callable[P, Any]) -> Callable[P, Any]:
        return cast(Callable[P, Any], self._spec.wrap(func))


@overload
def limited(
    limiter: Limiter | AsyncLimiter,
    rule: RuleSpec,
    subject: Subject = None,
    cost: Cost = 1,
    *,
    on_denied: Literal["raise"] = "raise",
) -> RaisingDecorator: ...
@overload
def limited(
    limiter: Limiter | AsyncLimiter,
    rule: RuleSpec,
    subject: Subject = None,
    cost: Cost = 1,
    *,
    on_denied: Literal["return"],
) -> ReturningDecorator: ...
def limited(
    limiter: Limiter | AsyncLimiter,
    rule: RuleSpec,
    subject: Subject = None,
    cost: Cost = 1,
    *,
    on_denied: Literal["raise", "return"] = "raise",
) -> RaisingDecorator | ReturningDecorator:
    """Rate-limit every call of the decorated function.

    ``limiter`` is a :class:`~geolimit.Limiter` for ``def`` functions and an
    :class:`~geolimit.AsyncLimiter` for ``async def`` ones (checked when
    decorating: :class:`~geolimit.ConfigError`). ``subject`` is a fixed string,
    a callable receiving the call's ``*args, **kwargs``, or ``None`` (default:
    one bucket for the function, named ``module.qualname``); ``cost`` an integer
    or such a callable. ``on_denied="raise"`` raises :class:`RateLimited`;
    ``"return"`` makes the call return ``None``.
    """
    if on_denied not in ("raise", "return"):
        raise ConfigError(f"on_denied must be 'raise' or 'return', got {on_denied!r}")
    spec = _Spec(limiter, rule, subject, cost, on_denied == "raise")
    return RaisingDecorator(spec) if on_denied == "raise" else ReturningDecorator(spec)


@contextmanager
def limit(limiter: Limiter, rule: RuleSpec, subject: str | bytes, cost: int = 1) -> Iterator[Decision]:
    """``with limit(limiter, "api", "user:42") as decision:``; raises :class:`RateLimited` on entry."""
    if not isinstance(limiter, Limiter):
        raise ConfigError("limit() needs a (sync) Limiter; use `async with alimit(...)` with an AsyncLimiter")
    decision = limiter.hit(rule, subject, cost)
    if not decision.allowed:
        raise RateLimited(decision)
    yield decision


@asynccontextmanager
async def alimit(
    limiter: AsyncLimiter, rule: RuleSpec, subject: str | bytes, cost: int = 1
) -> AsyncIterator[Decision]:
    """``async with alimit(limiter, "api", "user:42") as decision:``; raises :class:`RateLimited` on entry."""
    if not isinstance(limiter, AsyncLimiter):
        raise ConfigError("alimit() needs an AsyncLimiter; use `with limit(...)` with a sync Limiter")
    decision = await limiter.hit(rule, subject, cost)
    if not decision.allowed:
        raise RateLimited(decision)
    yield decision
