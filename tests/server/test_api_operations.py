"""Operating an agent over HTTP: status, health, readiness, metrics, API tokens, Redis outages.

One real agent (region "a") whose only peer, "b", is down, on a real Redis.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
import yarl
from prometheus_client.parser import text_string_to_metric_families

from geolimit import Rule
from geolimit.replication.auth import Signer
from geolimit.server.agent import Agent
from geolimit.store.embedded import EmbeddedRedis
from tests.server.conftest import StartAgent
from tests.server.helpers import call, check
from tests.support.regions import Regions, eventually

U = {"rule": "api", "subject": "user:42"}


async def get(session: aiohttp.ClientSession, agent: Agent, path: str, **kwargs: Any) -> tuple[int, Any]:
    return await call(session, "GET", agent.api_url + path, **kwargs)


async def test_status_reports_region_incarnation_and_each_peer(start_agent: StartAgent,
                                                               session: aiohttp.ClientSession) -> None:
    agent = await start_agent()  # returns once its first round holds the lease
    assert (await check(session, agent, U))[0] == 200

    async def b_is_behind() -> bool:
        _, status = await get(session, agent, "/v1/status")
        b = status["peers"]["b"]
        return bool(status["incarnation"] and b["errors"] >= 1 and b["outbox"] >= 1 and b["lag"] > 0)

    await eventually(b_is_behind, what="the hit waiting in b's outbox")
    status_code, status = await get(session, agent, "/v1/status")
    assert status_code == 200
    assert status["region"] == "a"
    assert isinstance(status["incarnation"], str)
    b = status["peers"]["b"]
    assert set(b) >= {"last_contact", "lag", "outbox", "errors"}
    assert b["last_contact"] is None, "b was never reached"
    assert "unreachable" in b["last_error"]
    assert set(status["rules"]) == {"api", "tiny", "hourly"}


async def test_healthz_says_alive(start_agent: StartAgent, session: aiohttp.ClientSession) -> None:
    agent = await start_agent()
    assert await get(session, agent, "/healthz") == (200, {"alive": True})


async def test_readyz_waits_for_redis_and_the_first_anti_entropy(start_agent: StartAgent,
                                                                 session: aiohttp.ClientSession) -> None:
    agent = await start_agent(run=False)  # listening, no gossip round yet
    status, body = await get(session, agent, "/readyz")
    assert (status, body["ready"]) == (503, False)
    assert any("redis" in reason for reason in body["waiting_for"])
    assert any("anti-entropy" in reason for reason in body["waiting_for"])

    await agent.start()
    await eventually(lambda: agent.readiness()[0], timeout=30, what="readiness")
    assert await get(session, agent, "/readyz") == (200, {"ready": True, "waiting_for": []})
    # With b down, the first anti-entropy concludes as failed: the agent serves rather than waits for b.
    b = (await get(session, agent, "/v1/status"))[1]["peers"]["b"]
    assert b["anti_entropy_ok"] == 0
    assert b["errors"] >= 1


def families(text: str) -> dict[str, list[Any]]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


async def test_metrics_cover_decisions_gossip_and_rejections(start_agent: StartAgent,
                                                             session: aiohttp.ClientSession) -> None:
    agent = await start_agent()
    for _ in range(3):
        await check(session, agent, {"rule": "tiny", "subject": "u"})
    async with session.post(agent.url + "/v1/gossip", data=b"forged") as resp:
        assert resp.status == 401
    body = b"\x00 not msgpack"
    signed = Signer(agent.config.secret, "b").headers(body, "a")
    async with session.post(agent.url + "/v1/gossip", data=body, headers=signed) as resp:
        assert resp.status == 400

    async def scraped() -> dict[str, list[Any]]:
        async with session.get(agent.api_url + "/metrics") as resp:
            assert resp.status == 200
            assert resp.content_type == "text/plain"
            return families(await resp.text())

    await eventually(lambda: _outbox_of_b(agent) > 0, what="the hits queued for b")

    async def round_timed() -> bool:  # the round that queued them is timed when it ends, a few calls later
        return _sample(await scraped(), "geolimit_gossip_round_seconds_count") >= 1

    await eventually(round_timed, what="a whole gossip round on /metrics")
    found = await scraped()
    decisions = {(s.labels["rule"], s.labels["result"]): s.value for s in found["geolimit_decisions"]
                 if s.name.endswith("_total")}
    assert decisions == {("tiny", "allowed"): 2, ("tiny", "denied"): 1}
    assert _sample(found, "geolimit_decision_seconds_count") == 3
    assert _sample(found, "geolimit_gossip_round_seconds_count") >= 1
    assert _sample(found, "geolimit_gossip_cells_sent_total", peer="b") == 0
    assert _sample(found, "geolimit_gossip_cells_received_total", peer="b") == 0
    assert _sample(found, "geolimit_peer_contact_age_seconds", peer="b") == -1, "never reached"
    assert _sample(found, "geolimit_outbox_cells", peer="b") >= 1
    assert _sample(found, "geolimit_gossip_rejected_total", reason="auth") == 1
    assert _sample(found, "geolimit_gossip_rejected_total", reason="decode") == 1


def _outbox_of_b(agent: Agent) -> int:
    return int(agent.status()["peers"]["b"]["outbox"])


def _sample(found: dict[str, list[Any]], name: str, **labels: str) -> float:
    values = [s.value for samples in found.values() for s in samples if s.name == name and s.labels.items() >= labels.items()]
    assert len(values) == 1, (name, labels, values)
    return float(values[0])


APP_ENDPOINTS = [("POST", "/v1/check"), ("POST", "/v1/peek"), ("POST", "/v1/reset"),
                 ("GET", "/v1/usage?rule=api&subject=user:42"), ("GET", "/v1/status")]


async def test_an_api_token_guards_the_app_endpoints_only(start_agent: StartAgent,
                                                          session: aiohttp.ClientSession) -> None:
    token = secrets.token_urlsafe(24)
    agent = await start_agent(api_token=token)
    wrong = [{}, {"Authorization": f"Bearer {token}x"}, {"Authorization": f"Basic {token}"},
             {"Authorization": "Bearer"}, {"Authorization": f"Bearer {token[:-1]}"},
             {"Authorization": "Bearer \u00e9t\u00e9"}]
    for method, path in APP_ENDPOINTS:
        body = U if method == "POST" else None
        for headers in wrong:
            status, error = await call(session, method, agent.api_url + path, body, headers=headers)
            assert (status, error["field"]) == (401, "Authorization"), (path, headers)
        status, _ = await call(session, method, agent.api_url + path, body,
                               headers={"Authorization": f"Bearer {token}"})
        assert status == 200, path
    status, usage = await get(session, agent, "/v1/usage?rule=api&subject=user:42",
                              headers={"Authorization": f"bearer  {token} "})
    assert (status, usage["total"]) == (200, 0), "check then reset: nothing left"
    for path in ("/healthz", "/readyz", "/metrics"):
        async with session.get(agent.api_url + path) as resp:
            assert resp.status != 401, path
    for headers in ({}, {"Authorization": f"Bearer {token}"}):  # gossip keeps its own HMAC check
        async with session.post(agent.url + "/v1/gossip", data=b"x", headers=headers) as resp:
            assert resp.status == 401
            assert (await resp.json())["reason"] == "auth"


async def test_gossip_between_agents_is_unaffected_by_api_tokens(
    redis_server_factory: Callable[..., EmbeddedRedis], session: aiohttp.ClientSession
) -> None:
    token = secrets.token_urlsafe(24)
    auth = {"Authorization": f"Bearer {token}"}
    async with Regions(redis_server_factory, ["a", "b"], [Rule("api", 5, 10, 1, predict=False)], interval=0.05,
                       api_token=token) as rs:
        a, b = rs["a"].agent, rs["b"].agent
        assert (await check(session, a, U | {"cost": 2}, headers=auth))[0] == 200

        async def b_sees_it() -> bool:
            status, usage = await get(session, b, "/v1/usage?rule=api&subject=user:42", headers=auth)
            return status == 200 and usage["regions"] == {"a": 2}

        await eventually(b_sees_it, what="a's hit replicated to b")
        status, d = await check(session, b, U | {"cost": 4}, headers=auth)
        assert (status, d["allowed"], d["remaining"]) == (200, False, 3)
        async with session.get(a.api_url + "/metrics") as resp:  # /metrics needs no token
            found = families(await resp.text())
        assert _sample(found, "geolimit_peer_rtt_seconds", peer="b") > 0, "a measured its round trips to b"


async def test_redis_down_gives_503_while_status_and_health_keep_answering(
    start_agent: StartAgent, region_redis: EmbeddedRedis, session: aiohttp.ClientSession,
    redis_server_factory: Callable[..., EmbeddedRedis],
) -> None:
    agent = await start_agent(on_error="raise")
    assert (await check(session, agent, U))[0] == 200
    await eventually(lambda: agent.readiness()[0], what="readiness")

    async def redis_unreachable() -> float:
        async with session.get(agent.api_url + "/metrics") as resp:
            return _sample(families(await resp.text()), "geolimit_redis_unreachable")

    assert await redis_unreachable() == 0
    port = region_redis.port
    region_redis.stop()

    for path, body in (("/v1/check", U), ("/v1/peek", U), ("/v1/reset", U)):
        status, error = await check(session, agent, body, path=path)
        assert status == 503, (path, error)
        assert "Redis" in error["error"]
    status, error = await get(session, agent, "/v1/usage?rule=api&subject=user:42")
    assert status == 503
    status, body = await get(session, agent, "/v1/status")
    assert (status, body["region"]) == (200, "a")
    assert await get(session, agent, "/healthz") == (200, {"alive": True})

    async def not_ready() -> bool:
        status, body = await get(session, agent, "/readyz")
        return status == 503 and any("redis" in reason for reason in body["waiting_for"])

    await eventually(not_ready, what="/readyz reporting Redis down")
    # /metrics says so too (once, a Redis outage changed no figure there but the contact ages).
    assert await redis_unreachable() == 1

    redis_server_factory(port=port)  # Redis is back, empty, on the same address
    await eventually(lambda: agent.readiness()[0], what="ready again")
    assert await redis_unreachable() == 0
    status, d = await check(session, agent, U)
    assert (status, d["allowed"], d["remaining"]) == (200, True, 4)


@pytest.mark.parametrize("policy", ["allow", "deny"])
async def test_on_error_policies_answer_degraded_decisions(
    start_agent: StartAgent, region_redis: EmbeddedRedis, session: aiohttp.ClientSession, policy: str
) -> None:
    agent = await start_agent(on_error=policy)
    region_redis.stop()
    status, d = await check(session, agent, U)
    assert status == 200
    assert (d["allowed"], d["degraded"]) == (policy == "allow", True)


async def test_api_listen_serves_the_app_api_apart_from_gossip(start_agent: StartAgent,
                                                               session: aiohttp.ClientSession) -> None:
    agent = await start_agent(api_listen=("127.0.0.1", 0))
    assert agent.api_url != agent.url
    status, d = await check(session, agent, U)
    assert (status, d["allowed"]) == (200, True)
    async with session.post(agent.url + "/v1/check", json=U) as resp:
        assert resp.status == 404, "the gossip port does not answer app requests"
    async with session.post(agent.api_url + "/v1/gossip", data=b"x") as resp:
        assert resp.status in (404, 405), "the API port does not take gossip"
    for base in (agent.url, agent.api_url):
        assert await call(session, "GET", base + "/healthz") == (200, {"alive": True})


async def test_usage_refuses_a_subject_that_is_not_utf8(start_agent: StartAgent,
                                                        session: aiohttp.ClientSession) -> None:
    """``subject=%ff`` was answered for U+FFFD, another subject; it is refused, naming subject_b64."""
    agent = await start_agent()
    async with session.get(yarl.URL(agent.api_url + "/v1/usage?rule=api&subject=%ff", encoded=True)) as resp:
        assert resp.status == 400
        error = await resp.json()
    assert error["field"] == "subject"
    assert "subject_b64" in error["error"]
    status, usage = await get(session, agent, "/v1/usage?rule=api&subject_b64=" + base64.b64encode(b"\xff").decode())
    assert (status, usage["total"]) == (200, 0)
    status, usage = await get(session, agent, "/v1/usage?rule=api&subject=%C3%A9t%C3%A9")  # UTF-8: answered
    assert status == 200
