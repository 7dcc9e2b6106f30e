"""Anti-entropy inside real agents: lost writes, refused batches, and hostile steps.

Three (or two) real agents on loopback with real redis-servers, stepped by hand
under a manual clock, so every round is deterministic.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from geolimit import ManualClock, Rule
from geolimit.core.keys import KeyLayout
from geolimit.replication import wire
from geolimit.replication.auth import Signer
from geolimit.replication.gossip_repair import periodic_wait
from geolimit.server.agent import Agent
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions, dead_url, dump_all

Factory = Callable[..., EmbeddedRedis]
API = Rule("api", 1000, 60, 10)  # 10 s buckets: the whole test stays in one
KEY = KeyLayout().data_key("api", b"victim")


def by_region(rs: Regions, name: str) -> dict[str, int]:
    return rs[name].app().usage("api", "victim").by_region


def ae_ok(agent: Agent, peer: str) -> int:
    assert agent.engine is not None
    return agent.engine.peers[peer].ae_ok


@pytest.fixture
async def three(redis_server_factory: Factory) -> AsyncIterator[Regions]:
    start = float(int(time.time()) // 10 * 10)  # the start of a bucket
    async with Regions(redis_server_factory, ["a", "b", "c"], [API], run_loops=False, clock=ManualClock(start)) as rs:
        await rs.step(2)  # leases, and the first anti-entropy with every peer
        yield rs


async def test_a_region_that_lost_its_latest_writes_is_repaired_without_raising_its_own_slot(three: Regions) -> None:
    """A failover to a replica that missed writes: peers hold more for a's own slot than a does.

    Anti-entropy still completes (the own-slot cells are skipped and counted, the
    rest is merged); a relay that carries the higher count is refused by a, and
    the relaying region drops that batch instead of retrying it for ever.
    """
    rs = three
    a = rs["a"].app()
    a.hit("api", "victim", cost=4)
    await rs.step(2)
    client = rs["a"].client()
    snapshot, ttl = client.dump(KEY), client.pttl(KEY)
    assert snapshot is not None
    a.hit("api", "victim", cost=6)
    await rs.step(2)
    assert by_region(rs, "b") == by_region(rs, "c") == {"a": 10}
    client.restore(KEY, ttl, snapshot, replace=True)  # the replica a fails over to had only 4
    assert by_region(rs, "a") == {"a": 4}

    b_engine = rs["b"].agent.engine
    a_engine = rs["a"].agent.engine
    assert b_engine is not None
    assert a_engine is not None
    runs = ae_ok(rs["b"].agent, "a")
    b_engine.peers["a"].ae_needed = True
    await rs.step(1, ["b"])
    assert ae_ok(rs["b"].agent, "a") == runs + 1, b_engine.peers["a"].ae_last_error
    assert a_engine.stats["own_ahead"] >= 1  # skipped and counted, not written
    assert by_region(rs, "a") == {"a": 4}

    # c cannot reach a, and says so: c's hit reaches a only through b, whose relay
    # also carries a's slot at 10. a refuses that batch; b drops it, and the
    # anti-entropy it starts brings c's hit (skipping a's own slot).
    rs.cut("c", "a")
    for _ in range(20):
        await rs.step(1)
        if "a" in b_engine.peers["c"].failing:
            break
    assert "a" in b_engine.peers["c"].failing, "c reports that it cannot reach a"
    rs["c"].app().hit("api", "victim", cost=1)
    await rs.step(3)
    assert by_region(rs, "b") == {"a": 10, "c": 1}
    assert b_engine.peers["a"].refused >= 1
    assert by_region(rs, "a") == {"a": 4, "c": 1}  # c's hit arrived; a's own slot untouched
    status = rs["b"].agent.status()["peers"]["a"]
    assert status["outbox"] == 0, "a refused batch must not block the outbox behind it"
    assert status["refused_cells"] == b_engine.peers["a"].refused
    rs.heal("c", "a")
    # Later hits still flow both ways.
    rs["b"].app().hit("api", "victim", cost=2)
    a.hit("api", "victim", cost=1)
    await rs.step(3)
    assert by_region(rs, "a") == {"a": 5, "b": 2, "c": 1}
    assert by_region(rs, "b") == by_region(rs, "c") == {"a": 10, "b": 2, "c": 1}


@pytest.fixture
async def pair(redis_server_factory: Factory) -> AsyncIterator[Regions]:
    """Region b receives; region a is its configured peer (whose secret we hold)."""
    async with Regions(redis_server_factory, ["a", "b"], [API], run_loops=False) as rs:
        await rs.step()
        rs["b"].app().hit("api", "existing", cost=3)
        yield rs


def _ae(payload: dict[str, object]) -> bytes:
    return wire.encode(wire.Message(kind="ae", sender="a", dest="b", rules={"api": API.structure}, shards=64,
                                    ae=payload))


async def _post(rs: Regions, body: bytes, headers: dict[str, str]) -> tuple[int, object]:
    async with aiohttp.ClientSession() as http, http.post(rs.urls["b"] + "/v1/gossip", data=body,
                                                           headers=headers) as resp:
        if resp.status == 200:
            return 200, wire.decode(await resp.read()).ae
        return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize(
    "payload",
    [
        {"op": "tree", "x": b"0" * 16, "level": 0, "nodes": [0]},  # no such exchange
        {"op": "begin", "x": b"short", "now": 0, "shards": 64, "leaves": 1, "rules": []},
        {"op": "begin", "x": b"1" * 16, "now": 1, "shards": 64, "leaves": 1, "rules": []},  # clock far off
        {"op": "begin", "x": b"1" * 16, "shards": 32, "leaves": 1, "rules": []},
        {"op": "push", "x": b"1" * 16, "blobs": [[0, b"\xc1"]]},
        {"op": "dance"},
    ],
)
async def test_a_bad_anti_entropy_step_gets_400_and_changes_nothing(pair: Regions, payload: dict[str, object]) -> None:
    client = pair["b"].client()
    before = dump_all(client)
    if payload.get("op") == "begin" and "now" not in payload:
        payload = {**payload, "now": pair.clock.now_us()}
    body = _ae(payload)
    status, reply = await _post(pair, body, Signer(pair.secret, "a", pair.clock).headers(body, "b"))
    assert status == 400, reply
    assert "anti-entropy" in str(reply)
    assert dump_all(client) == before  # not even the replay guard remembers it


async def test_a_replayed_anti_entropy_step_is_refused_and_changes_nothing(pair: Regions) -> None:
    client = pair["b"].client()
    payload = {"op": "begin", "x": os.urandom(16), "now": pair.clock.now_us(), "shards": 64,
               "leaves": 1, "rules": [["api", API.window_us, API.resolution_us]]}
    body = _ae(payload)
    headers = Signer(pair.secret, "a", pair.clock).headers(body, "b")
    status, reply = await _post(pair, body, headers)
    assert status == 200
    assert isinstance(reply, dict)
    assert reply["rules"] == ["api"]
    after_first = dump_all(client)
    status, _ = await _post(pair, body, headers)
    assert status == 401
    assert dump_all(client) == after_first


def test_periodic_anti_entropy_waits_ten_times_its_last_duration_and_never_less_than_the_interval() -> None:
    assert periodic_wait(30.0, 0.2) == 30.0  # a small keyspace: the configured interval
    assert periodic_wait(30.0, 9.5) == 95.0  # 1M keys, 9.5 s an exchange: at most ~10% of the time
    assert periodic_wait(300.0, 9.5) == 300.0


async def test_an_unreachable_peers_outbox_forgets_keys_that_expired_meanwhile(pair: Regions) -> None:
    rs = pair
    rs.cut("a", "b")
    app = rs["a"].app()
    for i in range(20):
        app.hit("api", f"gone{i}")
    app.hit("api", "kept", cost=2)
    engine = rs["a"].agent.engine
    assert engine is not None
    await rs.step(2, ["a"])
    assert engine.peers["b"].failures > 0
    assert rs["a"].agent.status()["peers"]["b"]["outbox"] == 21
    client = rs["a"].client()
    for i in range(20):  # as if they expired while b was unreachable
        client.delete(KeyLayout().data_key("api", b"gone%d" % i))
    # A long backoff: no probe packs (which would skip those keys too) until the heal,
    # so pruning alone (a page of 4 shards a round: 16 rounds cover the 64) drops them.
    engine.peers["b"].next_attempt = float("inf")
    for _ in range(40):
        await rs.step(1, ["a"])
        if rs["a"].agent.status()["peers"]["b"]["outbox"] == 1:
            break
    assert rs["a"].agent.status()["peers"]["b"]["outbox"] == 1, "only the live key stays queued"
    assert engine.stats["pruned"] == 20
    engine.peers["b"].next_attempt = 0.0
    rs.heal("a", "b")
    await rs.step(3)
    assert rs["b"].app().usage("api", "kept").by_region == {"a": 2}


async def test_after_a_wipe_the_other_peers_agree_on_the_wiped_regions_last_hits(three: Regions) -> None:
    """b's last hits reached a but not c when b's Redis lost its data (b's outbox to c with it).

    b's repair exchanges with a and c start together at the wipe; when the one with c
    concludes before a's cells come back (forced here: a is unreachable for that round),
    nothing brought them to c (a reaches c, so nothing relayed), and c counted 3
    hits fewer than a and b until a periodic exchange (30 s, settled: up to about
    50 s with 10 s buckets; seen with real agents: 5-15 s of unequal views after the
    traffic stopped). Now b relays what the exchanges that repair its wipe merge to
    every other peer.
    """
    rs = three
    b = rs["b"].app()
    b.hit("api", "victim", cost=5)
    await rs.step(2)
    b.hit("api", "victim", cost=3)
    rs["b"].agent.set_peer_url("c", dead_url())
    await rs.step(1, ["b"])  # delivered to a only
    await rs.step(1, ["a", "c"])
    assert (by_region(rs, "a"), by_region(rs, "c")) == ({"b": 8}, {"b": 5})
    rs["b"].client().flushall()
    rs["b"].agent.set_peer_url("c", rs.urls["c"])
    rs["b"].agent.set_peer_url("a", dead_url())  # the exchange with c concludes first
    await rs.step(1, ["b"])
    rs["b"].agent.set_peer_url("a", rs.urls["a"])
    await rs.step(30)  # 3 s of rounds: the wipe's exchanges and every delta
    assert by_region(rs, "a") == by_region(rs, "b") == by_region(rs, "c") == {"b": 8}


async def test_a_region_whose_redis_is_wiped_again_and_again_still_replicates(
    redis_server_factory: Factory,
) -> None:
    """Every wipe of b's Redis gives each of b's shards a new incarnation, one more slot id in
    a's registry of that shard. Nothing used to remove the ids of incarnations whose cells
    were gone: with the default cap (256 ids) a refused b's blobs after about 250 wipes
    ("the shard's slot registry is full", seen in a real run: a Redis without persistence
    restarted nightly gets there in 8 months), and b's hits never reached a again. Now a
    takes back the index of an incarnation idle for twice the key TTL plus parking plus a
    minute (reclaim.lua; 148 s here) and hands it to the next new one. The cap is 12
    here to be quick: 20 wipes 20 s apart need at most 9 ids at once.
    """
    from geolimit.replication.redis_io import Limits

    rule = Rule("api", 1000, 10, 1)
    async with Regions(redis_server_factory, ["a", "b"], [rule], run_loops=False) as rs:
        await rs.step(2)
        engine = rs["a"].agent.engine
        assert engine is not None
        engine.store.limits = Limits(max_slots=12)
        b = rs["b"].app()
        for _ in range(20):
            rs["b"].client().flushall()
            b.hit("api", "victim")
            await rs.step(3)
            assert rs["a"].app().usage("api", "victim").total == 1
            rs.clock.advance(20)  # the hit leaves the window: the old incarnation holds nothing
            await rs.step(1)
        assert engine.stats["slots_reclaimed"] >= 10


async def test_an_agent_whose_peer_is_down_at_start_becomes_ready(redis_server_factory: Factory) -> None:
    """Readiness waits for a first anti-entropy exchange with every peer, concluded even if
    it failed; a peer unreachable from the first send on is not waited for (that used to
    depend on the exchange starting before the first send had failed). Its exchange runs
    once it answers."""
    async with Regions(redis_server_factory, ["a", "b"], [Rule("api", 1000, 10, 1)], run_loops=False) as rs:
        rs["a"].agent.set_peer_url("b", dead_url())
        engine = rs["a"].agent.engine
        assert engine is not None
        engine.peers["b"].failures = 1  # the first send failed before the exchange could start
        engine.peers["b"].next_attempt = 10**12
        await rs.step(3, ["a"])
        assert engine.peers["b"].failures > 0
        assert engine.initial_sync_done
        assert engine.peers["b"].ae_ok == 0
        rs["a"].agent.set_peer_url("b", rs.urls["b"])
        engine.peers["b"].next_attempt = 0.0
        for _ in range(20):
            await rs.step(1)
            if engine.peers["b"].ae_ok:
                break
        assert engine.peers["b"].ae_ok == 1, "the exchange ran once b answered"
