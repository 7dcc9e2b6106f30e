"""What the workers of one region (``geolimit agent --workers N``) share through its Redis.

* Anti-entropy requests: only worker 0 starts exchanges; what another worker learns
  (here: Redis lost the data of a shard it owns) reaches worker 0.
* When each peer's deltas last arrived: they reach whichever worker accepted their
  connection, while each worker publishes the peers' freshness for its own shards.

Real agents and real redis-servers on loopback, stepped by hand under a manual clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import pytest

from geolimit import ManualClock, Rule
from geolimit.core.keys import KeyLayout
from geolimit.replication.ae_requests import MAX_REQUESTS, REQUEST_TTL_MS, AntiEntropyRequests
from geolimit.replication.heard import _HEARD as HEARD_SCRIPT
from geolimit.replication.heard import HEARD_MARGIN, HEARD_TTL_MS, SharedHeard
from geolimit.replication.takeover import FreshnessTakeover, stale_after
from geolimit.server.agent import Agent
from geolimit.store.connect import open_async_store, open_sync_store
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions

Factory = Callable[..., EmbeddedRedis]
API = Rule("api", 1000, 60, 10)  # 10 s buckets: the whole test stays in one
CLOSED = Rule("closed", 1_000_000, 10, 1, partition="closed")  # denies while a peer's counts are > 1 s old
LAYOUT = KeyLayout()


def owned_by(worker: int, workers: int) -> str:
    """A subject whose shard worker ``worker`` of ``workers`` owns."""
    return next(s for s in (f"user-{i}" for i in range(1000)) if LAYOUT.shard_of(s.encode()) % workers == worker)


@dataclass
class TwoWorkers:
    rs: Regions
    workers: list[Agent]  # region a's worker 0 and worker 1, on one Redis

    async def step_without_worker_1(self) -> None:
        """One round of worker 0 and of b (worker 1 stopped), then the clock moves a round."""
        await self.workers[0].step()
        await self.rs["b"].agent.step()
        assert isinstance(self.rs.clock, ManualClock)
        self.rs.clock.advance(self.rs.interval)

    async def step(self, rounds: int) -> None:
        for _ in range(rounds):
            for worker in self.workers:
                await worker.step()
            await self.rs["b"].agent.step()
            assert isinstance(self.rs.clock, ManualClock)
            self.rs.clock.advance(self.rs.interval)


@pytest.fixture
async def two_workers(redis_server_factory: Factory) -> AsyncIterator[TwoWorkers]:
    start = float(int(time.time()) // 10 * 10)  # the start of a bucket
    # No periodic exchange during the test: only what something asks for runs.
    async with Regions(redis_server_factory, ["a", "b"], [API, CLOSED], run_loops=False, clock=ManualClock(start),
                       anti_entropy_interval=3600) as rs:
        await rs["a"].agent.abort()
        config = replace(rs["a"].config, workers=2)
        workers = [Agent(config, clock=rs.clock, worker_index=i) for i in range(2)]
        try:
            for worker in workers:
                await worker.listen()
                worker.set_peer_url("b", rs.urls["b"])
            rs["b"].agent.set_peer_url("a", workers[0].url)
            pair = TwoWorkers(rs, workers)
            await pair.step(2)  # leases, and worker 0's first exchange with b
            yield pair
        finally:
            for worker in workers:
                await worker.abort()


def runs_with_b(agent: Agent) -> int:
    assert agent.engine is not None
    return agent.engine.peers["b"].ae_ok


async def test_a_wipe_that_only_worker_1_sees_is_repaired_by_worker_0_at_once(two_workers: TwoWorkers) -> None:
    """A Redis Cluster node that held only worker 1's shards lost its data: worker 1 finds
    the wipe, and worker 0 (the region's only initiator) repairs it from b within a few
    rounds. Before, nothing did until the next periodic exchange (an hour here)."""
    rs, (first, _) = two_workers.rs, two_workers.workers
    victim = owned_by(1, 2)
    rs["b"].app().hit("api", victim, cost=4)
    await two_workers.step(3)
    a = rs["a"].app()
    assert a.usage("api", victim).by_region == {"b": 4}
    shard = LAYOUT.shard_of(victim.encode())
    rs["a"].client().delete(LAYOUT.registry_key(shard), LAYOUT.data_key("api", victim.encode()))
    assert a.usage("api", victim).by_region == {}
    runs = runs_with_b(first)
    await two_workers.step(5)
    assert a.usage("api", victim).by_region == {"b": 4}
    assert runs_with_b(first) == runs + 1  # one exchange: the one worker 1 asked for


async def test_a_worker_that_b_never_sends_to_still_sees_b_current(two_workers: TwoWorkers) -> None:
    """b's deltas all reach worker 0 (b's address for a is worker 0's); worker 1 hears of
    them through Redis, so a closed rule on worker 1's shards allows while b is healthy,
    and denies once b's deltas stop (b answers nobody)."""
    rs = two_workers.rs
    a = rs["a"].app()
    mine, theirs = owned_by(0, 2), owned_by(1, 2)
    await two_workers.step(30)  # 3 s: only heartbeats and acknowledgements
    assert a.hit("closed", mine).allowed
    assert a.hit("closed", theirs).allowed
    await rs["b"].agent.abort()  # b is gone
    for _ in range(20):  # 2 s of a's rounds
        for worker in two_workers.workers:
            await worker.step()
        assert isinstance(rs.clock, ManualClock)
        rs.clock.advance(rs.interval)
    assert not a.hit("closed", mine).allowed
    assert not a.hit("closed", theirs).allowed


async def test_a_request_that_an_asked_for_exchange_already_covers_starts_none(two_workers: TwoWorkers) -> None:
    """Worker 0 saw it too (a peer back after failures: every worker sees that) and its
    exchange started after worker 1 asked: the request is not run a second time. A
    request posted after that exchange started is."""
    first, second = two_workers.workers
    assert first.engine is not None
    assert second.engine is not None
    peer = first.engine.peers["b"]
    assert peer.ae_asked_at is not None
    assert not peer.ae_needed
    requests = second.engine.repair.requests
    await requests.post({"b": False}, peer.ae_asked_at - 1.0)
    await first.engine.repair.share_requests()
    assert not peer.ae_needed
    await requests.post({"b": False}, peer.ae_asked_at + 1.0)
    await first.engine.repair.share_requests()
    assert peer.ae_needed
    assert not peer.ae_after_wipe


@pytest.fixture(params=["redis", "cluster"])
def request_url(request: pytest.FixtureRequest) -> str:
    """A real Redis, and a real 3-node Redis Cluster (the list lives on shard 0's node)."""
    if request.param == "cluster":
        request.getfixturevalue("cluster_client")  # flushed
        url: str = request.getfixturevalue("redis_cluster_url")
    else:
        request.getfixturevalue("redis_client")  # flushed
        url = request.getfixturevalue("redis_url")
    return url


async def test_requests_are_merged_per_peer_bounded_expire_and_junk_is_dropped(request_url: str) -> None:
    store = open_async_store(request_url)
    client = open_sync_store(request_url)
    try:
        requests = AntiEntropyRequests(store, LAYOUT)
        await requests.post({"b": False, "c": True}, 100.0)
        await requests.post({"b": True}, 90.0)
        raw = client.client()
        raw.rpush(LAYOUT.ae_requests_key, b"junk", b"n:notanumber:b", b"x:5:b", b"n:5:gone")
        taken = await requests.take(["b", "c"])
        assert {p: (r.after_wipe, r.posted) for p, r in taken.items()} == {"b": (True, 100.0), "c": (True, 100.0)}
        assert await requests.take(["b", "c"]) == {}  # taken once
        await requests.post({f"p{i}": False for i in range(MAX_REQUESTS + 50)}, 1.0)
        assert raw.llen(LAYOUT.ae_requests_key) == MAX_REQUESTS  # the oldest went
        assert 0 < raw.pttl(LAYOUT.ae_requests_key) <= REQUEST_TTL_MS
        assert set(await requests.take([f"p{i}" for i in range(MAX_REQUESTS + 50)])) == {
            f"p{i}" for i in range(50, MAX_REQUESTS + 50)
        }
    finally:
        await store.close()
        client.close()


async def test_junk_in_the_shared_keys_is_dropped_not_raised_nor_kept(request_url: str) -> None:
    """Junk in the region's shared keys, as found with real agents: a 400-digit time in the
    heard hash failed every gossip round of every worker (OverflowError; 5000 digits:
    ValueError), a time in the future made b look current after it was gone, a key of
    another type stopped the sharing for good (a worker no peer sends to then denied
    ``closed`` rules with b healthy), and 200k junk fields came back to every worker every
    round. Each is now dropped, and the caller's own time is kept."""
    store = open_async_store(request_url)
    client = open_sync_store(request_url)
    raw = client.client()
    heard = SharedHeard(store, LAYOUT)
    requests = AntiEntropyRequests(store, LAYOUT)
    now = 1_800_000_000.0
    try:
        for junk in (b"notanumber", b"-5", b"1e15", b"9" * 400, b"9" * 5000, b"%d" % ((now + 3600) * 1e6)):
            raw.delete(heard.key)
            raw.hset(heard.key, mapping={b"b": junk, b"c": junk})
            assert await heard.exchange({"b": now - 1.0, "c": None}, now) == {"b": now - 1.0}, junk
            assert raw.hget(heard.key, b"b") == b"%d" % ((now - 1.0) * 1e6)
            assert not raw.hexists(heard.key, b"c")  # junk with nothing to replace it goes
        assert await heard.exchange({"b": None, "c": None}, now) == {"b": now - 1.0}  # kept, and read by all
        assert await heard.exchange({"b": now - 5.0}, now) == {"b": now - 1.0}  # the larger wins
        assert await heard.exchange({"b": None}, now - 1.0 - HEARD_MARGIN - 0.5) == {}  # ahead of this clock
        raw.hset(heard.key, mapping={f"junk{i}": "x" for i in range(1000)})
        reply = await store.run(HEARD_SCRIPT, [b"1", heard.key, b"1000", b"%d" % (now * 1e6), b"b", b""])
        assert len(reply) == 1  # only the peers asked for, not the whole hash
        for wrong in (lambda k: raw.set(k, b"x"), lambda k: raw.rpush(k, b"x"), lambda k: raw.hset(k, b"x", b"y")):
            for key in (heard.key, LAYOUT.ae_requests_key):
                raw.delete(key)
                wrong(key)
            if raw.type(heard.key) != b"hash":
                assert await heard.exchange({"b": now}, now) == {"b": now}
                assert raw.type(heard.key) == b"hash"
                assert 0 < raw.pttl(heard.key) <= HEARD_TTL_MS
            if raw.type(LAYOUT.ae_requests_key) != b"list":
                assert await requests.take(["b"]) == {}
                raw.set(LAYOUT.ae_requests_key, b"x")
                await requests.post({"b": True}, now)
                assert {p: (r.after_wipe, r.posted) for p, r in (await requests.take(["b"])).items()} == {
                    "b": (True, now)}
        raw.rpush(LAYOUT.ae_requests_key, b"n:" + b"9" * 400 + b":b", b"w:" + b"9" * 5000 + b":b", b"n:12:b")
        assert {p: r.posted for p, r in (await requests.take(["b"])).items()} == {"b": 12e-6}
    finally:
        await store.close()
        client.close()


async def test_one_part_of_the_shared_state_failing_is_logged_once(
    two_workers: TwoWorkers, caplog: pytest.LogCaptureFixture,
) -> None:
    """Each round reaches the freshness hash, then fails on the request list: one warning
    (it used to flip between failing and back, a warning every round), one line when back."""
    engine = two_workers.workers[0].engine
    assert engine is not None
    caplog.set_level(logging.INFO, logger="geolimit.gossip")
    for _ in range(10):
        engine.note_sharing("freshness", None)
        engine.note_sharing("requests", "WRONGTYPE")
    engine.note_sharing("requests", None)
    lines = [r.getMessage() for r in caplog.records if "share" in r.getMessage() or "sharing" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "cannot share peers' anti-entropy requests" in lines[0]
    assert "again" in lines[1]


async def test_the_shards_of_a_worker_that_is_down_keep_their_peers_fresh(two_workers: TwoWorkers) -> None:
    """Worker 1 stops (killed; its supervisor restarts it after a backoff): nobody published
    b's freshness for its shards, so a closed rule there denied about a second later with b
    healthy. Worker 0 now publishes it for them while worker 1's rounds are stale, and stops
    when worker 1 is back."""
    rs = two_workers.rs
    first = two_workers.workers[0]
    a = rs["a"].app()
    theirs = owned_by(1, 2)
    await two_workers.step(10)
    assert a.hit("closed", theirs).allowed
    assert isinstance(rs.clock, ManualClock)
    for _ in range(30):  # 3 s of rounds without worker 1
        await two_workers.step_without_worker_1()
        assert a.hit("closed", theirs).allowed
    assert first.engine is not None
    assert first.engine.takeover.orphans(first.engine.worker_stamps, rs.clock(), rs.interval, 0.25) != []
    await two_workers.step(3)  # worker 1 is back
    assert first.engine.takeover.orphans(first.engine.worker_stamps, rs.clock(), rs.interval, 0.25) == []
    assert a.hit("closed", theirs).allowed


async def test_b_takes_a_as_current_only_while_every_worker_of_a_is_up(two_workers: TwoWorkers) -> None:
    """a's worker 1 stops: its shards' changes wait in a's Redis while worker 0's deltas and
    heartbeats still reach b. Those said nothing of it, so b took a as current and its closed
    rule allowed on (a tester saw b admit twice the limit). They now say they are partial:
    b's closed rule denies once a's counts are older than partition_after, as in a partition,
    and allows again when worker 1 is back."""
    rs = two_workers.rs
    first = two_workers.workers[0]
    b = rs["b"].app()
    subject = owned_by(1, 2)
    await two_workers.step(10)
    assert b.hit("closed", subject).allowed
    assert isinstance(rs.clock, ManualClock)
    allowed = []
    for _ in range(20):  # 2 s without worker 1
        await two_workers.step_without_worker_1()
        allowed.append(b.hit("closed", subject).allowed)
    assert first.engine is not None
    assert first.engine.workers_down == {1}
    assert all(allowed[:5])  # 0.5 s: a's counts were current a moment ago
    assert not any(allowed[16:])  # from 1.7 s on: a heartbeat, partition_after and two rounds
    await two_workers.step(5)  # worker 1 is back
    assert first.engine.workers_down == frozenset()
    assert b.hit("closed", subject).allowed


def test_the_lowest_numbered_live_worker_publishes_for_the_down_ones() -> None:
    layout = KeyLayout("gl", 12)

    def orphans(index: int, stamps: dict[int, float | None]) -> list[int]:
        return FreshnessTakeover(None, layout, index, 3).orphans(stamps, 100.0, 0.1, 0.25)  # type: ignore[arg-type]

    assert stale_after(0.1, 0.25) == 0.25  # the defaults: a heartbeat
    assert stale_after(0.5, 0.5) == 1.25  # slow rounds: two and a half of them
    up = 99.9  # a round 0.1 s ago; stale after 0.25 s
    assert orphans(0, {0: up, 1: up, 2: up}) == []
    assert orphans(0, {0: up, 1: 99.0, 2: up}) == [1, 4, 7, 10]  # worker 1's shards
    assert orphans(2, {0: up, 1: 99.0, 2: up}) == []  # worker 0 does it
    assert orphans(1, {0: None, 1: up, 2: up}) == [0, 3, 6, 9]  # worker 0 never seen: 1 does it
    assert orphans(2, {0: 99.0, 1: 99.0, 2: up}) == [0, 1, 3, 4, 6, 7, 9, 10]
