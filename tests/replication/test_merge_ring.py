"""Merges that move a key's ring forward clear exactly the buckets that left the window."""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
import pytest

from geolimit import ManualClock, Rule
from geolimit.core.keys import KeyLayout
from geolimit.core.window import SUBSTEPS
from geolimit.replication import wire
from geolimit.replication.auth import Signer
from geolimit.replication.redis_io import blobs_from_cells
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions

Factory = Callable[..., EmbeddedRedis]
API = Rule("api", 1000, 10, 1)  # 11 buckets counted (strict), a ring of 13 positions


async def _merge(rs: Regions, cells: list[tuple[int, str, int]]) -> None:
    """POST (bucket, slot, count) cells for subject "s" to region b, signed as region a."""
    six = [("api", b"s", bucket, slot, count * SUBSTEPS, 0) for bucket, slot, count in cells]
    message = wire.Message(kind="delta", sender="a", dest="b", rules={"api": API.structure}, shards=64,
                           blobs=blobs_from_cells(KeyLayout(), six))
    body = wire.encode(message)
    clock = rs.clock
    assert isinstance(clock, ManualClock)
    headers = Signer(rs.secret, "a", clock).headers(body, "b")
    async with aiohttp.ClientSession() as http, http.post(rs.urls["b"] + "/v1/gossip", data=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("advance", [1, 3, 8, 12, 13, 40])
async def test_a_later_bucket_never_revives_old_counts(redis_server_factory: Factory, advance: int) -> None:
    """Two remote slots fill 10 buckets; a merge `advance` buckets later must leave
    exactly the counts of the buckets still in the window (both ways of clearing:
    naming the ring positions, or listing the hash when that is cheaper)."""
    async with Regions(redis_server_factory, ["a", "b"], [API], run_loops=False) as rs:
        clock = rs.clock
        assert isinstance(clock, ManualClock)
        c0 = clock.now_us() // API.resolution_us
        await _merge(rs, [(c0 - d, slot, 1) for d in range(10) for slot in ("a/x", "a/y")])
        app = rs["b"].app()
        assert app.usage("api", "s").total == 20
        clock.advance(advance * API.resolution)
        c1 = c0 + advance
        await _merge(rs, [(c1, "a/x", 5)])
        live = sum(2 for d in range(10) if c0 - d >= c1 - 10)
        usage = app.usage("api", "s")
        assert usage.total == live + 5
        assert usage.by_slot == {s: n for s, n in {"a/x": live // 2 + 5, "a/y": live // 2}.items() if n}
