"""The scripts as a Redis function library (FCALL) and as EVALSHA scripts decide alike.

Runs against whatever server the session uses: on Redis >= 7 the stores call the
library with FCALL, on 6.2 (no FUNCTION) they fall back to EVALSHA. .ci/run runs
the store tests once per server, so both paths are covered there.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from importlib import resources

import pytest
import redis
import redis.cluster

from geolimit import AsyncLimiter, Limiter, ManualClock, Rule
from geolimit.store import scripts
from geolimit.store.protocol import build_request, encode_hit
from geolimit.store.redis_store import RedisStore
from geolimit.store.scripts import LIBRARY_SCRIPTS, function_library, load_script
from tests.support.redis_provider import plain_url

RULES = [Rule("api", 5, 10), Rule("burst", 3, 1)]


@pytest.fixture(autouse=True)
def leave_the_db_empty(redis_client: redis.Redis) -> Iterator[None]:
    """The session's server is shared: leave no region claim ('us') for later tests."""
    yield
    redis_client.flushdb()


def has_functions(client: redis.Redis) -> bool:
    return int(str(client.info("server")["redis_version"]).split(".")[0]) >= 7


def calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def play(limiter: Limiter, clock: ManualClock) -> list[tuple[bool, int, float]]:
    """A fixed sequence of hits, peeks, advances and a reset; what each call answered."""
    seen = []
    for step in range(40):
        subject = f"user{step % 3}"
        if step % 7 == 6:
            decision = limiter.peek(["api", "burst"], subject)
        else:
            decision = limiter.hit(["api", "burst"], subject, cost=1 + step % 2)
        seen.append((decision.allowed, decision.remaining, decision.retry_after))
        if step == 25:
            limiter.reset("api", "user1")
        clock.advance(0.3)
    return seen


def stored(client: redis.Redis) -> dict[bytes, dict[bytes, bytes]]:
    """Every hash in the DB, without what depends on Redis TIME: the expiry marks
    (field 'e') and the registries' incarnation ids (field '@', named in other fields)."""
    hashes: dict[bytes, dict[bytes, bytes]] = {
        key: client.hgetall(key) for key in client.scan_iter() if client.type(key) == b"hash"  # type: ignore[misc]
    }
    ids = [fields[b"@"] for fields in hashes.values() if b"@" in fields]
    out: dict[bytes, dict[bytes, bytes]] = {}
    for key, fields in hashes.items():
        kept = {}
        for field, value in fields.items():
            for incarnation in ids:
                field, value = field.replace(incarnation, b"<id>"), value.replace(incarnation, b"<id>")
            if field != b"e":
                kept[field] = value
        out[key] = kept
    return out


def library_names(node: redis.Redis) -> list[bytes]:
    names = []
    for library in node.function_list():
        pairs = dict(zip(library[::2], library[1::2], strict=True)) if isinstance(library, list) else library
        names.append(pairs[b"library_name"])
    return names


def test_the_library_holds_every_script_that_runs_by_name() -> None:
    folder = resources.files("geolimit.store") / "lua"
    names = {p.name.removesuffix(".lua") for p in folder.iterdir() if p.name.endswith(".lua")}
    parts = {part for name, more in scripts._PARTS.items() for part in more if part != name}  # later parts of a script
    runnable = {n for n in names if n not in {"common", "policy", "escrow", "outbox"} | parts and not n.startswith("ae_")}
    assert runnable == set(LIBRARY_SCRIPTS)
    for name in LIBRARY_SCRIPTS:
        function = load_script(name).function
        assert function == function_library().name + b"_" + name.encode()


def test_a_prelude_variable_of_unknown_lifetime_is_refused_when_the_library_is_built() -> None:
    with pytest.raises(RuntimeError, match="'seen'"):
        scripts._check_prelude_locals(b"local call = redis.call\nlocal seen = {}\n")
    scripts._check_prelude_locals(b"local function f() end\nlocal now_ms_cache = nil\nlocal strnum_count = 0\n")


def test_decisions_stay_right_when_the_kept_number_cache_fills_and_starts_afresh(redis_url: str) -> None:
    """common.lua's strnum outlives a library call and starts afresh after 4,096 conversions: 10,000
    distinct costs on fresh subjects (each cost string new to it) cross that bound several times."""
    limit = 10**6
    with Limiter.from_url(redis_url, region="us", rules=[Rule("big", limit, 10)], clock=ManualClock()) as limiter:
        for half in range(2):
            costs = range(1 + half * 5000, 5001 + half * 5000)
            decided = limiter.hit_many([("big", f"s{cost}", cost) for cost in costs])
            assert [d.remaining for d in decided] == [limit - cost for cost in costs]
            again = limiter.hit_many([("big", f"s{cost}", 1) for cost in costs])  # the same subjects, read back
            assert [d.remaining for d in again] == [limit - cost - 1 for cost in costs]


def test_fcall_and_evalsha_decide_and_store_exactly_alike(redis_client: redis.Redis, redis_url: str) -> None:
    runs = []
    for functions in (None, False):
        redis_client.flushdb()
        clock = ManualClock()
        limiter = Limiter.from_url(redis_url, region="us", rules=RULES, clock=clock)
        store = limiter.store
        assert isinstance(store, RedisStore)
        store.functions = functions  # None: try FUNCTION LOAD; False: EVALSHA only
        runs.append((play(limiter, clock), stored(redis_client)))
        assert store.functions is (functions is None and has_functions(redis_client))
        limiter.close()
    assert runs[0] == runs[1]
    assert any(allowed for allowed, _, _ in runs[0][0])
    assert not all(allowed for allowed, _, _ in runs[0][0])


def test_redis_7_runs_the_scripts_as_functions_and_6_2_by_sha(redis_client: redis.Redis, redis_url: str) -> None:
    fcalls, evalshas = calls(redis_client, "fcall"), calls(redis_client, "evalsha")
    with Limiter.from_url(redis_url, region="us", rules=RULES) as limiter:
        for _ in range(5):
            limiter.hit("api", "alice")
    if has_functions(redis_client):
        assert calls(redis_client, "fcall") - fcalls == 5
        assert calls(redis_client, "evalsha") == evalshas
    else:
        assert calls(redis_client, "evalsha") - evalshas == 5


def test_a_flushed_library_is_loaded_again(redis_client: redis.Redis, redis_url: str) -> None:
    with Limiter.from_url(redis_url, region="us", rules=RULES) as limiter:
        assert [limiter.hit("api", "bob").allowed for _ in range(3)] == [True] * 3
        if has_functions(redis_client):
            redis_client.function_flush()
        redis_client.script_flush()
        assert [limiter.hit("api", "bob").allowed for _ in range(3)] == [True, True, False]


async def test_async_store_reloads_a_flushed_library_for_single_and_pipelined_calls(
    redis_client: redis.Redis, redis_url: str
) -> None:
    limiter = AsyncLimiter.from_url(redis_url, region="us", rules=RULES)
    try:
        assert (await limiter.hit("api", "carol")).allowed
        if has_functions(redis_client):
            redis_client.function_flush()
        redis_client.script_flush()
        assert (await limiter.hit("api", "carol")).remaining == 3
        if has_functions(redis_client):
            redis_client.function_flush()
        # Several calls in one pipeline (the replication path): each reply is a decision.
        request = build_request(limiter._layout, [RULES[0]], b"dave", 1, True)
        args = encode_hit([request], None, b"us", b"n1")
        replies = await limiter.store.run_many(load_script("hit"), [args] * 6)
        assert [reply[0] for reply in replies] == [1] * 5 + [0]
    finally:
        await limiter.aclose()


def test_a_server_that_refuses_function_load_is_used_through_evalsha(
    redis_client: redis.Redis, redis_url: str
) -> None:
    url = redis_url
    if has_functions(redis_client):  # an ACL user that may run EVALSHA but not FUNCTION or FCALL
        password = secrets.token_hex(8)
        redis_client.acl_setuser(
            "nofunctions", enabled=True, passwords=[f"+{password}"], keys=["*"],
            commands=["+@all", "-function", "-fcall"], reset=True,
        )
        url = redis_url.replace("redis://", f"redis://nofunctions:{password}@")
    try:
        with Limiter.from_url(url, region="us", rules=RULES) as limiter:
            assert [limiter.hit("api", "erin").allowed for _ in range(6)] == [True] * 5 + [False]
            store = limiter.store
            assert isinstance(store, RedisStore)
            assert store.functions is False
    finally:
        if has_functions(redis_client):
            redis_client.acl_deluser("nofunctions")


@pytest.mark.cluster
def test_the_cluster_loads_the_library_on_every_master(
    cluster_client: redis.cluster.RedisCluster, redis_cluster_url: str
) -> None:
    with Limiter.from_url(redis_cluster_url, region="us", rules=RULES) as limiter:
        subjects = [f"s{i}" for i in range(30)]  # spread over the shards, so over the masters
        assert all(limiter.hit("api", s).allowed for s in subjects)
        masters = cluster_client.get_primaries()  # type: ignore[no-untyped-call]
        for master in masters:
            node = redis.Redis.from_url(plain_url(f"redis://{master.host}:{master.port}"))
            try:
                if has_functions(node):
                    assert function_library().name in library_names(node)
                    node.function_flush()
            finally:
                node.close()
        # Flushed everywhere: the next calls load it again and go on deciding.
        assert all(limiter.hit("api", s).remaining == 3 for s in subjects)
    cluster_client.flushall(target_nodes=redis.cluster.RedisCluster.PRIMARIES)  # no region claim left
