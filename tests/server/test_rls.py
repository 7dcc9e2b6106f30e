"""The agent's Envoy rate limit service (RLS v3) over real gRPC, on a real agent and a real Redis.

The client is Envoy's own API (``envoy.service.ratelimit.v3`` as compiled by the
gRPC project, package xds-protos): nothing here re-declares a message. The
descriptor files are envoyproxy/ratelimit's YAML, loaded as the agent loads them.
"""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import aiohttp
import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from http_sfv.list import List as SfvList

from geolimit.errors import GeolimitError
from geolimit.server.agent import Agent
from geolimit.server.rls.loading import load_rls
from tests.server.conftest import RULES, StartAgent

OK, OVER = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT
UNIT = rls_pb2.RateLimitResponse.RateLimit

MESSAGING = """
domain: messaging
descriptors:
  # 5 marketing messages a day to each number
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit: {unit: day, requests_per_unit: 5}
  # 100 messages a day to each number
  - key: to_number
    rate_limit: {unit: day, requests_per_unit: 100}
"""
EDGE = """
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: remote_address
    value: 50.0.0.5          # blocked outright
    rate_limit: {unit: minute, requests_per_unit: 0}
  - key: burst
    rate_limit: {unit: second, requests_per_unit: 1000}
  - key: generic_key
    value: global
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: user
    shadow_mode: true
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: internal
    rate_limit: {unlimited: true}
  - key: tier
    value: base
    descriptors:
      - key: user
        rate_limit: {name: base_user, unit: hour, requests_per_unit: 4}
  - key: tier
    value: gold
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 50, replaces: [{name: base_user}]}
"""

Entries = Sequence[tuple[str, str]]


def rls_options(tmp_path: Path, *docs: str, fast: bool = True) -> dict[str, Any]:
    """AgentConfig overrides serving ``docs`` (YAML text) on a loopback port of its own
    (``fast``: with the HTTP/2 fast path, else grpcio's core)."""
    files = []
    for i, doc in enumerate(docs):
        path = tmp_path / f"ratelimit-{i}.yaml"
        path.write_text(textwrap.dedent(doc))
        files.append(path)
    rls = load_rls(files, [r.name for r in RULES])
    return {"rules": RULES + rls.rules, "rls": rls, "rls_listen": ("127.0.0.1", 0), "rls_fast_path": fast}


def request(domain: str, *descriptors: Entries | tuple[Entries, int], hits: int = 0) -> Any:
    """A RateLimitRequest; a descriptor given as ``(entries, n)`` carries its own hits_addend n."""
    req = rls_pb2.RateLimitRequest(domain=domain, hits_addend=hits)
    for item in descriptors:
        own: int | None
        if len(item) == 2 and isinstance(item[1], int):
            entries, own = cast("tuple[Entries, int]", item)
        else:
            entries, own = cast(Entries, item), None
        d = req.descriptors.add()
        for key, value in entries:
            d.entries.add(key=key, value=value)
        if own is not None:
            d.hits_addend.value = own
    return req


class Client:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = rls_pb2_grpc.RateLimitServiceStub(channel)

    async def ask(self, domain: str, *descriptors: Entries | tuple[Entries, int], hits: int = 0) -> Any:
        return await self.stub.ShouldRateLimit(request(domain, *descriptors, hits=hits), timeout=10)

    async def codes(self, domain: str, *descriptors: Entries | tuple[Entries, int], hits: int = 0) -> tuple[int, list[int]]:
        r = await self.ask(domain, *descriptors, hits=hits)
        return r.overall_code, [s.code for s in r.statuses]


@pytest.fixture
async def edge(start_agent: StartAgent, tmp_path: Path, rls_fast_path: bool) -> Agent:
    return await start_agent(**rls_options(tmp_path, MESSAGING, EDGE, fast=rls_fast_path))


@pytest.fixture
async def client(edge: Agent) -> AsyncIterator[Client]:
    host, port = edge.rls_address
    async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
        yield Client(channel)


def headers(response: Any) -> dict[str, str]:
    return {h.key: h.value for h in response.response_headers_to_add}


async def test_nested_descriptors_count_each_value_on_its_own(client: Client) -> None:
    marketing = [("message_type", "marketing"), ("to_number", "2061111111")]
    plain = [("to_number", "2061111111")]
    for n in range(5):
        r = await client.ask("messaging", marketing, plain)
        assert r.overall_code == OK
        nested, overall = r.statuses
        assert (nested.code, nested.limit_remaining, overall.code, overall.limit_remaining) == (OK, 4 - n, OK, 99 - n)
    assert nested.current_limit.name == "messaging.message_type_marketing.to_number-per-day"
    assert (nested.current_limit.requests_per_unit, nested.current_limit.unit) == (5, UNIT.DAY)
    assert (overall.current_limit.requests_per_unit, overall.current_limit.unit) == (100, UNIT.DAY)
    assert 86_400 <= nested.duration_until_reset.seconds <= 86_400 + 8_640, "a day's window, one bucket of slack"
    assert await client.codes("messaging", marketing, plain) == (OVER, [OVER, OK])
    other = [("message_type", "marketing"), ("to_number", "2062222222")]
    assert await client.codes("messaging", other) == (OK, [OK]), "another number has its own 5 a day"
    r = await client.ask("messaging", plain)
    assert (r.overall_code, r.statuses[0].limit_remaining) == (OK, 94), "the denied request counted nowhere"


async def test_the_most_specific_match_wins_and_depth_must_match(client: Client) -> None:
    assert await client.codes("edge", [("remote_address", "50.0.0.5")]) == (OVER, [OVER])
    r = await client.ask("edge", [("remote_address", "50.0.0.1")])
    assert (r.overall_code, r.statuses[0].limit_remaining, r.statuses[0].current_limit.unit) == (OK, 9, UNIT.MINUTE)
    r = await client.ask("edge", [("burst", "b")])
    assert (r.statuses[0].limit_remaining, r.statuses[0].current_limit.unit) == (999, UNIT.SECOND)
    for entries in ([("remote_address", "50.0.0.5"), ("path", "/x")], [("message_type", "marketing")],
                    [("unknown", "x")]):
        r = await client.ask("edge", entries)
        assert r.overall_code == OK
        assert not r.statuses[0].HasField("current_limit"), f"{entries}: no limit at that depth"
    r = await client.ask("no-such-domain", [("remote_address", "50.0.0.5")])
    assert (r.overall_code, len(r.statuses), r.statuses[0].HasField("current_limit")) == (OK, 1, False)


async def test_hits_addend_is_the_cost_per_request_or_per_descriptor(client: Client) -> None:
    ip = [("remote_address", "10.0.0.7")]
    r = await client.ask("edge", ip, hits=4)
    assert r.statuses[0].limit_remaining == 6
    r = await client.ask("edge", (ip, 5), hits=4)
    assert r.statuses[0].limit_remaining == 1, "the descriptor's own hits_addend wins"
    r = await client.ask("edge", (ip, 0))
    assert (r.overall_code, r.statuses[0].limit_remaining) == (OK, 1), "hits_addend 0 counts nothing"
    assert await client.codes("edge", ip, hits=2) == (OVER, [OVER])
    assert await client.codes("edge", ip) == (OK, [OK]), "the refused 2 were not counted"


async def test_descriptors_of_one_request_are_all_or_nothing(client: Client, edge: Agent) -> None:
    limiter = edge.require_limiter()
    layout = limiter.layout
    ips = [f"10.1.0.{i}" for i in range(40)]
    ip = next(a for a in ips if layout.shard_of(f"remote_address={a}".encode())
              != layout.shard_of(b"generic_key=global"))  # the two counters sit in different shards
    glob = [("generic_key", "global")]
    for _ in range(3):
        assert await client.codes("edge", glob, [("remote_address", ip)]) == (OK, [OK, OK])
    r = await client.ask("edge", [("remote_address", ip)], glob)
    assert (r.overall_code, [s.code for s in r.statuses]) == (OVER, [OK, OVER])
    assert r.statuses[0].limit_remaining == 7, "the address had room: shown, but not counted"
    usage = await limiter.usage("edge.remote_address-per-minute", f"remote_address={ip}".encode())
    assert usage.total == 3
    assert (await limiter.usage("edge.generic_key_global-per-minute", b"generic_key=global")).total == 3


async def test_same_counter_twice_in_one_request_counts_both_costs(client: Client) -> None:
    ip = [("remote_address", "10.9.9.9")]
    r = await client.ask("edge", ip, ip, hits=3)
    assert [s.limit_remaining for s in r.statuses] == [4, 4]
    assert await client.codes("edge", ip, (ip, 4)) == (OVER, [OVER, OVER])


async def test_shadow_mode_counts_but_never_answers_over_limit(client: Client, edge: Agent) -> None:
    user = [("user", "ann")]
    for remaining in (1, 0):
        r = await client.ask("edge", user)
        assert (r.overall_code, r.statuses[0].limit_remaining) == (OK, remaining)
    r = await client.ask("edge", user, [("remote_address", "10.2.0.1")])
    assert (r.overall_code, [s.code for s in r.statuses]) == (OK, [OK, OK])
    assert r.statuses[0].limit_remaining == 0, "over its limit, but only in the shadow"
    policy = headers(r)["RateLimit-Policy"]
    assert "edge.user" not in policy, "shadow limits stay out of the headers"
    assert "remote_address" in policy
    blocked = await client.ask("edge", user, [("remote_address", "50.0.0.5")])
    assert (blocked.overall_code, [s.code for s in blocked.statuses]) == (OVER, [OK, OVER])
    async with aiohttp.ClientSession() as http, http.get(edge.url + "/metrics") as resp:
        text = await resp.text()
    assert 'geolimit_rls_decisions_total{domain="edge",key="edge.user_ann",result="shadow_over_limit"} 2.0' in text
    assert 'key="edge.remote_address",result="ok"' in text, "no detailed_metric: the key alone"


async def test_unlimited_and_replaced_limits(client: Client, edge: Agent) -> None:
    r = await client.ask("edge", [("internal", "x")])
    assert (r.overall_code, r.statuses[0].limit_remaining, r.statuses[0].HasField("current_limit")) == (OK, 2**32 - 1, False)
    base = [("tier", "base"), ("user", "bob")]
    gold = [("tier", "gold"), ("user", "bob")]
    r = await client.ask("edge", base)
    assert r.statuses[0].limit_remaining == 3
    r = await client.ask("edge", base, gold)
    assert [s.HasField("current_limit") for s in r.statuses] == [False, True], "gold replaces base_user"
    assert r.statuses[1].limit_remaining == 49
    r = await client.ask("edge", base)
    assert r.statuses[0].limit_remaining == 2, "the replaced limit was not counted"


async def test_headers_are_ietf_structured_fields_with_retry_after_when_over(client: Client) -> None:
    glob = [("generic_key", "global")]
    ip = [("remote_address", "10.3.0.1")]
    r = await client.ask("edge", glob, ip)
    got = headers(r)
    policy, current = SfvList(), SfvList()
    policy.parse(got["RateLimit-Policy"].encode())
    current.parse(got["RateLimit"].encode())
    assert [(i.value, i.params["q"], i.params["w"]) for i in policy] == [
        ("edge.generic_key_global-per-minute", 3, 60), ("edge.remote_address-per-minute", 10, 60)]
    assert [(i.value, i.params["r"]) for i in current] == [
        ("edge.generic_key_global-per-minute", 2), ("edge.remote_address-per-minute", 9)]
    assert "Retry-After" not in got
    for _ in range(2):
        await client.ask("edge", glob)
    over = headers(await client.ask("edge", glob, ip))
    assert 1 <= int(over["Retry-After"]) <= 66
    current = SfvList()
    current.parse(over["RateLimit"].encode())
    assert current[0].params["r"] == 0
    assert current[0].params["t"] <= int(over["Retry-After"])


async def test_concurrent_requests_never_pass_the_limit(client: Client) -> None:
    glob = [("generic_key", "global")]
    results = await asyncio.gather(*(client.codes("edge", glob, [("remote_address", f"10.4.0.{i}")])
                                     for i in range(40)))
    assert sorted(code for code, _ in results).count(OK) == 3


async def test_bad_requests_are_invalid_argument(client: Client) -> None:
    for bad, says in ((request("", [("a", "b")]), "domain"), (request("edge"), "descriptors"),
                      (request("edge", []), "entries"), (request("edge", ([("a", "b")], 2**47)), "hits_addend")):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.stub.ShouldRateLimit(bad, timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in (caught.value.details() or "")


@pytest.mark.parametrize(("on_error", "code"), [("raise", None), ("allow", OK), ("deny", OVER)])
async def test_redis_down_follows_on_error(
    start_agent: StartAgent, tmp_path: Path, region_redis: Any, on_error: str, code: int | None, rls_fast_path: bool
) -> None:
    agent = await start_agent(on_error=on_error, **rls_options(tmp_path, EDGE, fast=rls_fast_path))
    host, port = agent.rls_address
    region_redis.stop()
    async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
        stub = Client(channel)
        if code is None:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ask("edge", [("generic_key", "global")])
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        else:
            assert await stub.codes("edge", [("generic_key", "global")], [("internal", "x")]) == (code, [code, OK])


async def test_reload_applies_a_changed_descriptor_file(start_agent: StartAgent, tmp_path: Path,
                                                        rls_fast_path: bool) -> None:
    agent = await start_agent(**rls_options(tmp_path, EDGE, fast=rls_fast_path))
    host, port = agent.rls_address
    async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
        c = Client(channel)
        assert (await c.ask("edge", [("generic_key", "global")])).statuses[0].limit_remaining == 2
        changed = rls_options(tmp_path, EDGE.replace("requests_per_unit: 3", "requests_per_unit: 30"),
                              fast=rls_fast_path)
        summary = await agent.reload(replace(agent.config, **changed))
        assert "~edge.generic_key_global-per-minute" in summary
        r = await c.ask("edge", [("generic_key", "global")])
        assert (r.statuses[0].limit_remaining, r.statuses[0].current_limit.requests_per_unit) == (28, 30)
        assert agent.rls_address == (host, port), "the listener stays"


async def test_a_port_in_use_is_an_error_not_a_shared_port(edge: Agent, start_agent: StartAgent,
                                                           tmp_path: Path, rls_fast_path: bool) -> None:
    taken = edge.rls_address
    options = rls_options(tmp_path, EDGE, fast=rls_fast_path) | {"rls_listen": taken}
    with pytest.raises(GeolimitError, match=r"cannot listen for gRPC on 127\.0\.0\.1:\d+"):
        await start_agent(**options)


async def test_metric_series_stay_bounded_whatever_domains_and_keys_clients_send(
    client: Client, edge: Agent, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every domain a client named (4 MB ones included) became a label of
    geolimit_rls_decisions_total: 20 of them made /metrics 320 MB, and scraping it stalled
    decisions for 1.8 s. Unknown domains now count as one; past MAX_SERIES label sets,
    new descriptor keys count under "_other"."""
    from geolimit.server.rls import server as rls_server

    monkeypatch.setattr(rls_server, "MAX_SERIES", 3)
    for n in range(30):
        assert (await client.codes(f"nobody-configured-{n}-" + "x" * 1000, [("k", "v")]))[0] == OK
    for n in range(10):  # keys of a known domain that no limit matches: one label set each, until the cap
        await client.codes("edge", [(f"key{n}", "v")])
    async with aiohttp.ClientSession() as http, http.get(edge.url + "/metrics") as resp:
        series = [line for line in (await resp.text()).splitlines()
                  if line.startswith("geolimit_rls_decisions_total{")]
    assert 'geolimit_rls_decisions_total{domain="_unknown",key="_unknown",result="no_limit"} 30.0' in series
    assert not [line for line in series if "nobody-configured" in line]
    assert len(series) <= 3 + 1, series  # the cap, and the overflow series
    assert any('key="_other"' in line for line in series)
