"""Decisions against a hung Redis honour ``[region] redis_timeout`` and ``on_error``.

A real redis-server is hung with SIGSTOP (always resumed with SIGCONT in a
``finally``): connections are accepted by the kernel and requests are written,
but nothing is ever answered, which is what a Redis stuck in a long command, a
swapping host or a half-dead network looks like. The agent is configured from a
TOML file, as an operator would. The bounds are generous (several times the
configured timeout, and well below 5 s): these are behaviour tests,
not timing tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from geolimit.core.keys import KeyLayout
from geolimit.server.agent import Agent
from geolimit.server.config import load_config
from geolimit.store.embedded import EmbeddedRedis, EmbeddedRedisCluster
from tests.server.helpers import call, check, dump_toml, region_config, write_secret
from tests.support.regions import dead_url, eventually

T = TypeVar("T")
StartAgent = Callable[..., Awaitable[Agent]]
LIMIT = 5
RULES = ({"name": "api", "limit": f"{LIMIT}/10s", "resolution": 1},)
BOUND = 2.0  # seconds: every answer during the hang, against redis_timeout = 0.2


def body(subject: str) -> dict[str, Any]:
    return {"rule": "api", "subject": subject}


@contextlib.contextmanager
def hung(pid: int) -> Iterator[None]:
    """SIGSTOP the redis-server ``pid``; SIGCONT it whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5.0
        while _state(pid) != "T":  # stopped: it answers nothing from now on
            assert time.monotonic() < deadline, f"redis-server {pid} did not stop"
            time.sleep(0.005)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        return f.read().rpartition(")")[2].split()[0]


async def timed(awaitable: Awaitable[T]) -> tuple[float, T]:
    started = time.monotonic()
    result = await awaitable
    return time.monotonic() - started, result


@pytest.fixture
async def toml_agent(tmp_path: Path) -> AsyncIterator[StartAgent]:
    """``await toml_agent(redis_url, **region_keys)``: an agent configured from a TOML file,
    region "a" with one peer ("b") that is down, its gossip loop running."""
    agents: list[Agent] = []

    async def start(redis_url: str, **region_keys: Any) -> Agent:
        write_secret(tmp_path / "gossip.key")
        data = region_config(redis_url, peers=[{"name": "b", "url": dead_url()}], rules=RULES)
        data["region"] |= region_keys
        path = tmp_path / f"region-{len(agents)}.toml"
        path.write_text(dump_toml(data))
        agent = Agent(load_config(path))
        agents.append(agent)
        await agent.start()
        return agent

    try:
        yield start
    finally:
        for agent in agents:
            await agent.abort()


async def expect_policy(session: aiohttp.ClientSession, agent: Agent, policy: str, path: str, subject: str) -> None:
    took, (status, answer) = await timed(check(session, agent, body(subject), path=path))
    assert took < BOUND, f"{path} took {took:.2f}s against a hung Redis (redis_timeout = 0.2)"
    expect_answer(policy, status, answer, path)


def redis_ok(agent: Agent) -> bool:
    """The agent's last gossip round reached Redis (readiness waits for nothing Redis)."""
    return not any(reason.startswith("redis") for reason in agent.readiness()[1])


def expect_answer(policy: str, status: int, answer: Any, where: str) -> None:
    if policy == "raise":
        assert status == 503, (where, status, answer)
        assert "Redis" in answer["error"], answer
    else:
        assert status == 200, (where, status, answer)
        assert answer["degraded"] is True, answer
        assert answer["allowed"] is (policy == "allow"), answer
        if policy == "deny":
            assert answer["retry_after"] > 0, answer


@pytest.mark.parametrize("policy", ["allow", "deny", "raise"])
async def test_a_hung_redis_gets_the_on_error_answer_within_the_timeout_and_decisions_recover(
    toml_agent: StartAgent, region_redis: EmbeddedRedis, session: aiohttp.ClientSession, policy: str,
) -> None:
    agent = await toml_agent(region_redis.url, redis_timeout=0.2, on_error=policy)
    assert agent.config.redis_timeout == 0.2
    assert agent.config.on_error == policy
    status, answer = await check(session, agent, body("before"))
    assert (status, answer["allowed"], answer["degraded"]) == (200, True, False)
    await eventually(lambda: redis_ok(agent), what="a first gossip round")

    with hung(region_redis.pid):
        probe = redis.Redis.from_url(region_redis.url, socket_timeout=0.2, socket_connect_timeout=0.2,
                                     retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.TimeoutError):  # the hang is real
            probe.ping()
        probe.close()

        for path in ("/v1/check", "/v1/peek", "/v1/check"):
            await expect_policy(session, agent, policy, path, "during")

        # a batch, and concurrent callers: every one of them is answered within the bound
        took, (status, answer) = await timed(check(session, agent, {"checks": [body(f"b{i}") for i in range(5)]}))
        assert took < BOUND, f"a batch took {took:.2f}s"
        if policy == "raise":
            expect_answer(policy, status, answer, "batch")
        else:
            assert status == 200, answer
            for result in answer["results"]:
                expect_answer(policy, 200, result, "batch")
        replies = await asyncio.gather(*(timed(check(session, agent, body(f"c{i}"))) for i in range(10)))
        assert max(took for took, _ in replies) < BOUND, [round(took, 2) for took, _ in replies]
        for _, (status, answer) in replies:
            expect_answer(policy, status, answer, "concurrent")

        # what needs Redis but is not a decision fails fast with a 503, whatever the policy
        for method, path, payload in (("POST", "/v1/reset", body("during")), ("GET", "/v1/usage?rule=api&subject=x", None)):
            took, (status, answer) = await timed(call(session, method, agent.api_url + path, payload))
            assert took < BOUND, f"{path} took {took:.2f}s"
            assert status == 503, (path, answer)
            assert "Redis" in answer["error"], answer

        # what does not need Redis keeps answering at once; readiness says what is wrong
        took, (status, health) = await timed(call(session, "GET", agent.api_url + "/healthz"))
        assert (status, health) == (200, {"alive": True})
        took, (status, state) = await timed(call(session, "GET", agent.api_url + "/v1/status"))
        assert status == 200
        assert took < BOUND
        assert state["region"] == "a"

        async def not_ready() -> bool:
            status, ready = await call(session, "GET", agent.api_url + "/readyz")
            return status == 503 and any("redis" in reason for reason in ready["waiting_for"])

        await eventually(not_ready, timeout=10.0, what="/readyz reporting Redis")

    # resumed: decisions come from Redis again, exactly
    async def decided_by_redis() -> bool:
        status, answer = await check(session, agent, body("probe"))
        return status == 200 and answer["degraded"] is False

    await eventually(decided_by_redis, timeout=10.0, what="decisions from Redis again")
    for n in range(1, LIMIT + 1):
        status, answer = await check(session, agent, body("after"))
        assert (status, answer["allowed"], answer["degraded"], answer["remaining"]) == (200, True, False, LIMIT - n)
    status, answer = await check(session, agent, body("after"))
    assert (status, answer["allowed"], answer["degraded"]) == (200, False, False)
    await eventually(lambda: redis_ok(agent), timeout=10.0, what="Redis reported reachable again")
    assert agent.failure() is None


async def test_the_default_timeout_also_bounds_decisions(
    toml_agent: StartAgent, region_redis: EmbeddedRedis, session: aiohttp.ClientSession,
) -> None:
    """No redis_timeout in the file: the 1 s default, not the socket's (unbounded) wait."""
    agent = await toml_agent(region_redis.url, on_error="allow")
    assert agent.config.redis_timeout == 1.0
    assert (await check(session, agent, body("before")))[0] == 200
    with hung(region_redis.pid):
        took, (status, answer) = await timed(check(session, agent, body("during")))
    assert took < 3.0, f"{took:.2f}s with the 1 s default"
    expect_answer("allow", status, answer, "default timeout")


# -- a Redis Cluster with one hung master ---------------------------------------------


@pytest.fixture
def own_cluster() -> Iterator[EmbeddedRedisCluster]:
    """A 3-master cluster of this test's own (the session's is never hung). Its nodes
    declare a peer failed only after 30 s, so the hang below does not fail the cluster."""
    cluster = EmbeddedRedisCluster(3, extra_args=["--cluster-node-timeout", "30000"]).start()
    try:
        yield cluster
    finally:
        for node in cluster.nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, signal.SIGCONT)
        cluster.stop()


def subject_on(cluster: EmbeddedRedisCluster, layout: KeyLayout, port: int, on: bool) -> str:
    """A subject whose keys live on the master at ``port`` (or, with on=False, elsewhere)."""
    client = redis.cluster.RedisCluster(host=cluster.nodes[0].host, port=cluster.nodes[0].port)
    try:
        for i in range(10_000):
            subject = f"user:{i}"
            node = client.get_node_from_key(layout.data_key("api", subject.encode()))  # type: ignore[no-untyped-call]
            if (node.port == port) == on:
                return subject
    finally:
        client.close()
    raise AssertionError("no such subject")


@pytest.mark.cluster
async def test_a_hung_cluster_master_is_bounded_by_the_timeout_and_spares_the_other_masters(
    toml_agent: StartAgent, own_cluster: EmbeddedRedisCluster, session: aiohttp.ClientSession,
) -> None:
    timeout = 0.5
    agent = await toml_agent(own_cluster.url, redis_timeout=timeout, on_error="allow", shards=16)
    layout = KeyLayout("gl", 16)
    victim = own_cluster.nodes[1]
    stuck = subject_on(own_cluster, layout, victim.port, on=True)
    healthy = subject_on(own_cluster, layout, victim.port, on=False)

    async def decided(subject: str) -> bool:
        status, answer = await check(session, agent, body(subject))
        return status == 200 and answer["degraded"] is False

    # (a check racing the agent's first round can fail at start-up: see
    # tests/replication/test_cluster_replication.py::test_a_fresh_agent_on_the_cluster_starts_without_errors)
    for subject in (stuck, healthy):
        await eventually(lambda subject=subject: decided(subject), what=f"a decision for {subject}")  # type: ignore[misc]

    with hung(victim.pid):
        for _ in range(2):
            took, (status, answer) = await timed(check(session, agent, body(stuck)))
            assert status == 200, answer  # never a 500, whatever the cluster client raises
            assert took < 3 * timeout, f"a check on the hung master took {took:.2f}s (redis_timeout = {timeout})"
            expect_answer("allow", status, answer, "hung master")
            took, (status, answer) = await timed(check(session, agent, body(healthy)))
            assert took < 3 * timeout, f"a check on a healthy master took {took:.2f}s"
            assert (status, answer["allowed"], answer["degraded"]) == (200, True, False), answer

    await eventually(lambda: decided(stuck), timeout=15.0, what="decisions on the resumed master")
