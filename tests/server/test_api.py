"""The agent's JSON decision API over real HTTP, on a real agent and a real Redis.

check / peek / reset / usage, all-or-nothing rules, batches, and how bad requests are
refused (400 naming the field, 404 for an unknown rule, 413 for an oversized body).
Operations endpoints (status, health, metrics, tokens, Redis outages) are in
test_api_operations.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from geolimit.server.agent import Agent
from tests.server.conftest import StartAgent
from tests.server.helpers import call, check

U = {"rule": "api", "subject": "user:42"}


@pytest.fixture
async def agent(start_agent: StartAgent) -> Agent:
    return await start_agent()


async def usage(session: aiohttp.ClientSession, agent: Agent, **params: str) -> tuple[int, Any]:
    return await call(session, "GET", agent.api_url + "/v1/usage", params=params)


async def test_check_counts_down_then_denies_with_a_retry_time(agent: Agent, session: aiohttp.ClientSession) -> None:
    seen = []
    for _ in range(5):
        status, d = await check(session, agent, U)
        assert status == 200
        assert set(d) >= {"allowed", "limit", "remaining", "retry_after", "reset_after"}
        seen.append((d["allowed"], d["limit"], d["remaining"], d["retry_after"]))
    assert seen == [(True, 5, r, 0) for r in (4, 3, 2, 1, 0)]
    status, d = await check(session, agent, U)
    assert status == 200
    assert (d["allowed"], d["remaining"]) == (False, 0)
    assert 0 < d["retry_after"] <= 11
    assert 0 < d["reset_after"] <= 12
    status, d = await check(session, agent, {"rule": "api", "subject": "user:43", "cost": 6})
    assert (d["allowed"], d["retry_after"]) == (False, None), "a cost above the limit can never pass"


async def test_peek_consumes_nothing_and_reset_forgets(agent: Agent, session: aiohttp.ClientSession) -> None:
    await check(session, agent, U | {"cost": 3})
    for _ in range(3):
        status, d = await check(session, agent, U | {"cost": 2}, path="/v1/peek")
        assert (status, d["allowed"], d["remaining"]) == (200, True, 2)  # what is left now
    status, d = await check(session, agent, U | {"cost": 3}, path="/v1/peek")
    assert (status, d["allowed"]) == (200, False)
    assert (await usage(session, agent, rule="api", subject="user:42"))[1]["total"] == 3

    status, body = await check(session, agent, U, path="/v1/reset")
    assert (status, body) == (200, {"reset": 1})
    assert (await usage(session, agent, rule="api", subject="user:42"))[1]["total"] == 0
    status, d = await check(session, agent, U | {"cost": 5})
    assert (status, d["allowed"], d["remaining"]) == (200, True, 0)


async def test_zero_cost_checks_without_consuming(agent: Agent, session: aiohttp.ClientSession) -> None:
    for _ in range(3):
        status, d = await check(session, agent, U | {"cost": 0})
        assert (status, d["allowed"], d["remaining"]) == (200, True, 5)


async def test_usage_reports_regions_and_the_global_total(agent: Agent, session: aiohttp.ClientSession) -> None:
    await check(session, agent, U | {"cost": 2})
    await check(session, agent, U)
    status, u = await usage(session, agent, rule="api", subject="user:42")
    assert status == 200
    assert (u["rule"], u["subject"], u["limit"], u["total"], u["remaining"]) == ("api", "user:42", 5, 3, 2)
    assert u["regions"] == {"a": 3}
    assert sum(u["slots"].values()) == 3
    assert all(slot.startswith("a/") for slot in u["slots"])


async def test_several_rules_are_all_or_nothing(agent: Agent, session: aiohttp.ClientSession) -> None:
    both = {"rules": ["api", "tiny"], "subject": "ip:1.2.3.4"}
    for expected in (True, True, False, False):
        status, d = await check(session, agent, both)
        assert (status, d["allowed"]) == (200, expected)
    assert d["rule"] == "tiny", "the denying rule is the binding one"
    assert {r["rule"]: r["allowed"] for r in d["rules"]} == {"api": True, "tiny": False}
    for rule in ("api", "tiny"):
        status, u = await usage(session, agent, rule=rule, subject="ip:1.2.3.4")
        assert u["total"] == 2, f"{rule}: denied requests consume from no rule"


async def test_batches_decide_each_check_independently(agent: Agent, session: aiohttp.ClientSession) -> None:
    batch = [{"rule": "tiny", "subject": "s1"}, {"rule": "tiny", "subject": "s1"}, {"rule": "tiny", "subject": "s1"},
             {"rule": "api", "subject": "s2", "cost": 5}, {"rules": ["api", "hourly"], "subject": "s3"}]
    status, body = await check(session, agent, batch)
    assert status == 200
    assert [d["allowed"] for d in body["results"]] == [True, True, False, True, True]
    status, body = await check(session, agent, {"checks": batch[:2]})
    assert (status, [d["allowed"] for d in body["results"]]) == (200, [False, False])
    status, body = await check(session, agent, {"checks": batch[3:4]}, path="/v1/peek")
    assert (status, [d["remaining"] for d in body["results"]]) == (200, [0])
    status, body = await check(session, agent, batch, path="/v1/reset")
    assert (status, body) == (200, {"reset": 5})
    assert (await usage(session, agent, rule="tiny", subject="s1"))[1]["total"] == 0


async def test_a_full_batch_sent_in_small_chunks(agent: Agent, session: aiohttp.ClientSession) -> None:
    """1000 checks (~50 KB) streamed in 1 KB pieces: the whole body is read, not the first piece."""
    raw = json.dumps([{"rule": "hourly", "subject": f"user:{i % 10}"} for i in range(1000)]).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(raw), 1024):
            yield raw[start : start + 1024]
            await asyncio.sleep(0.001)  # separate TCP segments: the server sees a partial body first

    status, body = await call(session, "POST", agent.api_url + "/v1/check", data=pieces())
    assert status == 200, body
    assert len(body["results"]) == 1000
    assert sum(d["allowed"] for d in body["results"]) == 1000
    assert (await usage(session, agent, rule="hourly", subject="user:7"))[1]["total"] == 100


async def test_binary_subjects_travel_as_base64(agent: Agent, session: aiohttp.ClientSession) -> None:
    blob = b"\x00\xff{shard}:\n"
    encoded = base64.b64encode(blob).decode()
    status, d = await check(session, agent, {"rule": "api", "subject_b64": encoded, "cost": 2})
    assert (status, d["remaining"]) == (200, 3)
    status, u = await usage(session, agent, rule="api", subject_b64=encoded)
    assert (status, u["total"]) == (200, 2)
    same = base64.b64encode(b"user:42").decode()
    await check(session, agent, {"rule": "api", "subject_b64": same})
    assert (await usage(session, agent, rule="api", subject="user:42"))[1]["total"] == 1, "b64 and text agree"


BAD_BODIES = [
    pytest.param(b"allow me", "body", id="not-json"),
    pytest.param(b"\xff\xfe\x00", "body", id="not-utf8"),
    pytest.param(b"[" * 100_000, "body", id="nested-too-deep"),
    pytest.param(b'"user:42"', "body", id="not-an-object"),
    pytest.param({"rule": 5, "subject": "u"}, "rule", id="rule-not-a-string"),
    pytest.param({"rule": "", "subject": "u"}, "rule", id="rule-empty"),
    pytest.param({"subject": "u"}, "rule", id="missing-rule"),
    pytest.param({"rule": "api", "rules": ["api"], "subject": "u"}, "rules", id="rule-and-rules"),
    pytest.param({"rules": "api", "subject": "u"}, "rules", id="rules-not-a-list"),
    pytest.param({"rules": [], "subject": "u"}, "rules", id="rules-empty"),
    pytest.param({"rules": ["api", "api"], "subject": "u"}, "rules", id="rules-twice"),
    pytest.param({"rule": "api"}, "subject", id="missing-subject"),
    pytest.param({"rule": "api", "subject": 42}, "subject", id="subject-not-a-string"),
    pytest.param({"rule": "api", "subject": "x" * 4097}, "subject", id="subject-too-long"),
    pytest.param({"rule": "api", "subject_b64": "not base64!"}, "subject_b64", id="b64-invalid"),
    pytest.param({"rule": "api", "subject_b64": 1234}, "subject_b64", id="b64-not-a-string"),
    pytest.param({"rule": "api", "subject": "u", "subject_b64": "dQ=="}, "subject_b64", id="subject-twice"),
    pytest.param(U | {"cost": -1}, "cost", id="negative-cost"),
    pytest.param(U | {"cost": True}, "cost", id="bool-cost"),
    pytest.param(U | {"cost": 1.5}, "cost", id="float-cost"),
    pytest.param(U | {"cost": "1"}, "cost", id="string-cost"),
    pytest.param(U | {"cost": 2**60}, "cost", id="huge-cost"),
    pytest.param(U | {"colour": "red"}, "colour", id="unknown-field"),
    pytest.param([], "checks", id="empty-batch"),
    pytest.param([U] * 1001, "checks", id="huge-batch"),
    pytest.param({"checks": U}, "checks", id="checks-not-a-list"),
    pytest.param({"checks": [U], "cost": 1}, "cost", id="batch-with-extra-field"),
    pytest.param([U, {"rule": "api"}], "checks[1].subject", id="batch-item-missing-subject"),
    pytest.param([U, "user:42"], "checks[1]", id="batch-item-not-an-object"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
@pytest.mark.parametrize("path", ["/v1/check", "/v1/peek", "/v1/reset"])
async def test_bad_bodies_get_400_naming_the_field(
    agent: Agent, session: aiohttp.ClientSession, path: str, body: object, field: str
) -> None:
    await check(session, agent, U)
    status, error = await check(session, agent, body, path=path)
    assert status == 400, error
    assert error["field"] == field
    assert error["error"]
    status, u = await usage(session, agent, rule="api", subject="user:42")
    assert u["total"] == 1, "a refused request changes nothing"


@pytest.mark.parametrize("path", ["/v1/check", "/v1/peek", "/v1/reset"])
async def test_unknown_rules_get_404_and_nothing_is_consumed(
    agent: Agent, session: aiohttp.ClientSession, path: str
) -> None:
    await check(session, agent, U)
    cases: list[tuple[object, str]] = [
        ({"rule": "apii", "subject": "user:42"}, "rule"),
        ({"rules": ["api", "nope"], "subject": "user:42"}, "rules"),
        ([U, {"rule": "nope", "subject": "user:42"}], "checks[1].rule"),
    ]
    for body, field in cases:
        status, error = await check(session, agent, body, path=path)
        assert (status, error["field"]) == (404, field), error
        assert "unknown rule" in error["error"]
    assert (await usage(session, agent, rule="api", subject="user:42"))[1]["total"] == 1


async def test_usage_query_errors(agent: Agent, session: aiohttp.ClientSession) -> None:
    cases: list[tuple[dict[str, str], int, str]] = [
        ({"subject": "u"}, 400, "rule"),
        ({"rule": "api"}, 400, "subject"),
        ({"rule": "api", "subject": "u", "cost": "1"}, 400, "cost"),
        ({"rule": "api", "subject_b64": "%%%"}, 400, "subject_b64"),
        ({"rule": "nope", "subject": "u"}, 404, "rule"),
    ]
    for params, expected, field in cases:
        status, error = await usage(session, agent, **params)
        assert (status, error["field"]) == (expected, field), (params, error)


async def test_a_body_over_one_mib_gets_413(agent: Agent, session: aiohttp.ClientSession) -> None:
    big = json.dumps({"rule": "api", "subject": "u", "pad": "x" * (1 << 20)}).encode()
    status, error = await check(session, agent, big)
    assert (status, error["field"]) == (413, "body")

    async def streamed() -> AsyncIterator[bytes]:  # no Content-Length: chunked transfer
        for start in range(0, len(big), 64 * 1024):
            yield big[start : start + 64 * 1024]

    status, error = await call(session, "POST", agent.api_url + "/v1/check", data=streamed())
    assert (status, error["field"]) == (413, "body")
    status, d = await check(session, agent, U)
    assert (status, d["allowed"]) == (200, True), "the agent still serves after refusing big bodies"


async def test_error_answers_never_echo_a_clients_megabytes(agent: Agent, session: aiohttp.ClientSession) -> None:
    """A 900 KB rule name came back whole in the 404 (and an unknown field's name in the 400)."""
    huge = "r" * 900_000
    status, error = await check(session, agent, {"rule": huge, "subject": "u"})
    assert status == 404
    assert len(json.dumps(error)) < 2000
    assert "(900000 characters)" in error["error"]
    status, error = await check(session, agent, {"rule": "api", "subject": "u", huge: 1})
    assert status == 400
    assert len(json.dumps(error)) < 2000
