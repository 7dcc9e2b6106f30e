"""The middlewares with an agent-backed decider and a rule the agent does not know (a real agent
on loopback and its own redis-server): the aiohttp app refuses to start, as the proxy does in agent
mode; a request never answers 500 (it raised UnknownRuleError before): the limit fails by its on_error."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from geolimit import ConfigError, Rule
from geolimit.http.agent_client import AgentClient
from geolimit.middleware import GeolimitMiddleware, policy, setup_geolimit
from geolimit.middleware.asgi import Message, Receive, Scope, Send
from geolimit.middleware.rules import check_agent_routes
from geolimit.store.embedded import EmbeddedRedis
from tests.support.agent_fixtures import agent_client
from tests.support.regions import dead_url

RULES = (Rule("api", 5, 10, 1), *Rule.parse_many("multi", "4/hour;2/minute"))


@pytest.fixture
async def client(redis_server_factory: Callable[..., EmbeddedRedis]) -> AsyncIterator[AgentClient]:
    async with agent_client(redis_server_factory(), RULES, {"multi": ("multi.1h", "multi.1m")}) as made:
        yield made


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def status(middleware: GeolimitMiddleware) -> int:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await middleware({"type": "http", "method": "GET", "path": "/api/x", "headers": [],
                      "client": ("203.0.113.9", 5000)}, receive, send)
    return int(sent[0]["status"])


async def test_aiohttp_refuses_to_start_with_a_rule_the_agent_does_not_know(client: AgentClient) -> None:
    web_app = web.Application()
    setup_geolimit(web_app, client, [policy("/a/*", "multi"), policy("/api/*", "apx")])
    runner = web.AppRunner(web_app)
    with pytest.raises(ConfigError) as caught:
        await runner.setup()
    await runner.cleanup()
    assert str(caught.value) == ("route[1] (path '/api/*'): rule 'apx' is not one of the agent's rules (it has "
                                 "api, multi.1h, multi.1m; multi-rate tables multi (multi.1h + multi.1m))")
    fine = web.Application()
    setup_geolimit(fine, client, [policy("/a/*", "multi"), policy("/api/*", ["api", "multi.1m"])])
    runner = web.AppRunner(fine)
    await runner.setup()  # a table's name and the rules' names are all known
    await runner.cleanup()


async def test_a_rule_the_agent_does_not_know_fails_by_on_error_not_500(
        client: AgentClient, caplog: pytest.LogCaptureFixture) -> None:
    assert await status(GeolimitMiddleware(app, client, [policy("/api/*", "apx")])) == 200
    assert await status(GeolimitMiddleware(app, client, [policy("/api/*", "apx", on_error="deny")])) == 503
    assert "middleware: cannot decide rule(s) apx (configuration problem)" in caplog.text
    assert await status(GeolimitMiddleware(app, client, [policy("/api/*", "multi")])) == 200, "the agent expands it"


async def test_an_agent_that_cannot_be_asked_is_not_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    dead = AgentClient(dead_url())
    try:
        assert await check_agent_routes(dead, [policy("/api/*", "apx")]) is False
    finally:
        await dead.close()
    assert "cannot ask the agent for its rules now" in caplog.text
