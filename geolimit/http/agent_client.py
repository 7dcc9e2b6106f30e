"""A :class:`~geolimit.http.guard.Decider` that asks the region's agent (``POST /v1/check``).

For processes that should not talk to Redis themselves: the proxy can use the
local agent instead of a Redis URL. Errors reaching the agent raise
:class:`~geolimit.errors.StorageError`, so failure policies apply the same way.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from geolimit.core.decision import Decision, RuleDecision, combine
from geolimit.errors import StorageError, UnknownRuleError

__all__ = ["AgentClient", "AgentRules"]


@dataclass(frozen=True)
class AgentRules:
    """What an agent decides: its rules' names, and its multi-rate ``[[rule]]`` tables (a table's name
    stands for its rules: ``api`` -> ``("api.1h", "api.1m")``)."""

    names: frozenset[str]
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict, hash=False)

    def expand(self, name: str) -> tuple[str, ...] | None:
        """The rules ``name`` stands for at the agent (None: it knows no such rule or table)."""
        if name in self.names:
            return (name,)
        return self.groups.get(name)


class AgentClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 1.0) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def hit(self, rules: str | Sequence[str], subject: str | bytes, cost: int = 1) -> Decision:
        """``POST /v1/check``: several rules are decided all-or-nothing."""
        return await self._decide("/v1/check", rules, subject, cost)

    async def peek(self, rules: str | Sequence[str], subject: str | bytes, cost: int = 1) -> Decision:
        """``POST /v1/peek``: the same decision, consuming nothing."""
        return await self._decide("/v1/peek", rules, subject, cost)

    async def _decide(self, path: str, rules: str | Sequence[str], subject: str | bytes, cost: int) -> Decision:
        body: dict[str, Any] = {"rule": rules} if isinstance(rules, str) else {"rules": list(rules)}
        body["cost"] = cost
        if isinstance(subject, bytes):
            import base64

            body["subject_b64"] = base64.b64encode(subject).decode()
        else:
            body["subject"] = subject
        try:
            async with self._client().post(self.url + path, data=json.dumps(body), headers=self._headers) as resp:
                payload = await resp.json(content_type=None)
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            raise StorageError(f"agent {self.url} unreachable: {type(exc).__name__}: {exc}") from exc
        if status == 404:
            raise UnknownRuleError(rules if isinstance(rules, str) else ", ".join(rules))
        if status != 200:
            raise StorageError(f"agent {self.url} answered HTTP {status}: {payload}")
        return _decision(payload)

    async def rules(self) -> AgentRules:
        """The agent's rules and multi-rate tables (``GET /v1/status``); StorageError when it cannot be asked."""
        try:
            async with self._client().get(self.url + "/v1/status", headers=self._headers) as resp:
                payload = await resp.json(content_type=None)
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            raise StorageError(f"agent {self.url} unreachable: {type(exc).__name__}: {exc}") from exc
        if status != 200 or not isinstance(payload, dict) or not isinstance(payload.get("rules"), dict):
            raise StorageError(f"agent {self.url} answered /v1/status with HTTP {status}: {str(payload)[:200]}")
        groups = payload.get("rule_groups") or {}  # absent: an agent that takes no table names
        return AgentRules(frozenset(payload["rules"]), {str(k): tuple(v) for k, v in dict(groups).items()})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _decision(payload: dict[str, Any]) -> Decision:
    results = [
        RuleDecision(
            rule=r["rule"], allowed=r["allowed"], limit=r["limit"], remaining=r["remaining"],
            retry_after=math.inf if r["retry_after"] is None else float(r["retry_after"]),
            reset_after=float(r["reset_after"]), window=float(r["window"]),
            stable_for=float(r.get("stable_for", 0.0)),
        )
        for r in payload.get("rules", [])
    ]
    if not results:
        raise StorageError(f"agent answered without per-rule results: {payload}")
    decision = combine(results)
    decision.degraded = bool(payload.get("degraded", False))
    return decision
