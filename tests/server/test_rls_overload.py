"""Envoy RLS calls share the agent's bound on checks in progress ([region] max_checks_in_progress).

The rate limit service decides on the same event loop as /v1/check and the gossip rounds
(docs/design.md §14, *Overload*): a call arriving while the bound is reached is answered
UNAVAILABLE at once (Envoy's failure_mode_deny then decides), on both transports.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import grpc
import pytest

from geolimit.store.embedded import EmbeddedRedis
from tests.server.conftest import StartAgent
from tests.server.test_rls import EDGE, OK, Client, rls_options
from tests.support.regions import eventually


async def test_calls_beyond_the_bound_are_unavailable_at_once_and_count_with_checks(
    start_agent: StartAgent, region_redis: EmbeddedRedis, tmp_path: Path, rls_fast_path: bool,
    session: aiohttp.ClientSession,
) -> None:
    agent = await start_agent(max_checks_in_progress=2, **rls_options(tmp_path, EDGE, fast=rls_fast_path))
    host, port = agent.rls_address
    admin = region_redis.client()
    async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
        client = Client(channel)
        assert await client.codes("edge", [("remote_address", "10.0.0.1")]) == (OK, [OK])
        admin.client_pause(20_000, all=False)  # hit.lua waits; unpaused below
        try:
            waiting = [asyncio.ensure_future(client.codes("edge", [("remote_address", f"10.0.0.{i}")]))
                       for i in (2, 3)]
            await eventually(lambda: agent.checks.in_progress == 2, what="2 calls in progress")
            began = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.ask("edge", [("remote_address", "10.0.0.4")])
            assert time.monotonic() - began < 2.0, "answered at once, not after the paused Redis"
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "max_checks_in_progress 2" in (caught.value.details() or "")
            async with session.post(agent.api_url + "/v1/check", json={"rule": "api", "subject": "u"}) as resp:
                assert resp.status == 503  # one bound for both
            assert not any(w.done() for w in waiting)
        finally:
            admin.client_unpause()
        assert await asyncio.gather(*waiting) == [(OK, [OK])] * 2
    assert agent.checks.in_progress == 0
    assert agent.checks.shed == 2
