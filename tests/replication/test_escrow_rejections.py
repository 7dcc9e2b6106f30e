"""Signed escrow messages that are well-formed but would leave a region unable to
replicate: a key grown past what a message may carry, values at the top of the range.
Three real regions (a Redis and an aiohttp agent each) in manual time; messages are
posted to b as its configured peer a."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from geolimit import ManualClock, Rule
from geolimit.core.escrow import rights
from geolimit.replication import escrow_wire
from geolimit.replication.auth import Signer
from geolimit.replication.escrow_fields import MAX_VALUE, state_of
from geolimit.replication.escrow_wire import EscrowMessage
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions

Factory = Callable[..., EmbeddedRedis]
LOGIN = Rule("login", 100, 60, escrow=True)
NAMES = ["a", "b", "c"]


@pytest.fixture
async def rs(redis_server_factory: Factory) -> AsyncIterator[Regions]:
    async with Regions(redis_server_factory, NAMES, [LOGIN], run_loops=False) as regions:
        await regions.step(2)
        regions.clock.advance(LOGIN.window)  # the new Redises' escrow hold ends
        await regions.step(3)
        assert all(regions[n].agent.escrow.held == 0 for n in NAMES)  # type: ignore[union-attr]
        regions["b"].app().hit("login", "victim", cost=3)
        await regions.step(2)
        yield regions


def _push(keys: list[tuple[bytes, list[Any]]]) -> bytes:
    return escrow_wire.encode(EscrowMessage(
        "push", "a", "b", 64, {"login": (LOGIN.window_us, LOGIN.resolution_us)}, keys=keys))


async def _post(rs: Regions, body: bytes) -> tuple[int, Any]:
    clock = rs.clock
    assert isinstance(clock, ManualClock)
    clock.advance(0.001)  # a new sequence number
    headers = Signer(rs.secret, "a", clock).headers(body, "b")
    async with aiohttp.ClientSession() as http, http.post(rs.urls["b"] + "/v1/escrow", data=body,
                                                          headers=headers) as resp:
        return resp.status, await resp.read()


def _key(rs: Regions, region: str, subject: bytes) -> bytes:
    found = [k for k in rs[region].client().scan_iter(match=b"gl:{*}:login:" + subject)]
    assert len(found) == 1, found
    return found[0]


def _failures(rs: Regions, region: str) -> dict[str, Any]:
    status = rs[region].agent.escrow.status()  # type: ignore[union-attr]
    return {p: (s["failures"], s["last_error"]) for p, s in status["peers"].items()}


def _raise_history(rs: Regions, subject: bytes, pairs: list[tuple[bytes, bytes]], top: int) -> None:
    """As if each pair of regions had traded rights back and forth for a long time: in
    every region, both transfers of each pair rise by the same amount, the larger to ``top``."""
    fields = rs["b"].client().hgetall(_key(rs, "b", subject))
    for there, back in pairs:
        extra = top - max(int(fields.get(there, 0)), int(fields.get(back, 0)))
        for region in NAMES:
            client, key = rs[region].client(), _key(rs, region, subject)
            assert client.hget(key, there) == fields.get(there)
            assert client.hget(key, back) == fields.get(back)
            client.hincrby(key, there, extra)
            client.hincrby(key, back, extra)


async def test_rights_are_exact_when_transfers_are_near_2_53(rs: Regions) -> None:
    # b's transfers in sum past 2**53 while its net is small: added up one by one in
    # Lua's doubles, the sum rounded (b admitted one more than its rights, or one less).
    _raise_history(rs, b"victim", [(b"t:a:b:100", b"t:b:a:100"), (b"t:c:b:100", b"t:b:c:100")], MAX_VALUE - 2)
    fields = rs["b"].client().hgetall(_key(rs, "b", b"victim"))
    held = rights(state_of(fields), "b", NAMES, LOGIN.limit)
    assert 3 < held <= LOGIN.limit
    b = rs["b"].app()
    assert sum(b.hit("login", "victim").allowed for _ in range(LOGIN.limit)) == held - 3  # 3 admitted before
