"""Gossip signatures: destination binding, time window, replay guards (memory and real Redis)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
import redis

from geolimit.errors import AuthenticationError, ClockSkewError, ConfigError, StorageError
from geolimit.replication.auth import (
    MIN_SECRET_BYTES,
    REGION,
    SEQ,
    SIGNATURE,
    THREAD_HASH_BYTES,
    TIME,
    Signer,
    Verifier,
    sign,
)
from geolimit.replication.replay import MemoryReplayGuard, RedisReplayGuard, ReplayGuard
from geolimit.store.async_store import AsyncStore
from geolimit.store.connect import open_async_store

SECRET = b"s3cr3t-gossip-key-0123456789abcdef"
BODY = b"\x93\xa1a\x01\x02"
WINDOW = 30.0
T0 = 1_700_000_000.0


class Clock:
    """A settable clock shared by signers and verifiers."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def store(redis_client: redis.Redis, redis_url: str) -> AsyncIterator[AsyncStore]:
    """An async store on the (flushed) test Redis."""
    opened = open_async_store(redis_url)
    try:
        yield opened
    finally:
        await opened.close()


def _verifier(region: str, clock: Clock, peers: tuple[str, ...] = ("a", "b", "c"), guard: ReplayGuard | None = None) -> Verifier:
    return Verifier(SECRET, [p for p in peers if p != region], region, WINDOW, clock, guard)


# -- signatures -------------------------------------------------------------------------


def test_the_signature_covers_sender_destination_time_seq_and_body() -> None:
    base = sign(SECRET, "a", "b", "1.000000", "7", BODY)
    assert len(base) == 64
    assert base == sign(SECRET, "a", "b", "1.000000", "7", BODY)
    variants = [
        sign(SECRET, "c", "b", "1.000000", "7", BODY),
        sign(SECRET, "a", "c", "1.000000", "7", BODY),
        sign(SECRET, "b", "a", "1.000000", "7", BODY),
        sign(SECRET, "a", "b", "2.000000", "7", BODY),
        sign(SECRET, "a", "b", "1.000000", "8", BODY),
        sign(SECRET, "a", "b", "1.000000", "7", BODY + b"x"),
        sign(SECRET[::-1], "a", "b", "1.000000", "7", BODY),
    ]
    assert base not in variants
    assert len(set(variants)) == len(variants)


async def test_a_message_signed_for_b_is_refused_by_c(clock: Clock) -> None:
    headers = Signer(SECRET, "a", clock).headers(BODY, "b")
    with pytest.raises(AuthenticationError, match=r"bad signature on a message naming region '\w+' \(or addressed to another region\): every region's secret_file must hold the same secret"):
        await _verifier("c", clock).verify_request(headers, BODY)
    assert await _verifier("b", clock).verify_request(headers, BODY) == "a"


async def test_requests_verify_and_replays_are_refused(clock: Clock) -> None:
    signer, verifier = Signer(SECRET, "a", clock), _verifier("b", clock)
    headers = signer.headers(BODY, "b")
    assert await verifier.verify_request(headers, BODY) == "a"
    with pytest.raises(AuthenticationError, match=r"replayed message \(seq \d+ from 'a'"):
        await verifier.verify_request(headers, BODY)
    fresh = signer.headers(BODY, "b")
    assert int(fresh[SEQ]) > int(headers[SEQ])
    assert await verifier.verify_request(fresh, BODY) == "a"
    # The same seq from another sender is a different message.
    assert await verifier.verify_request(Signer(SECRET, "c", clock).headers(BODY, "b", seq=int(headers[SEQ])), BODY) == "c"


def test_sequence_numbers_strictly_increase_even_if_the_clock_stalls_or_steps_back(clock: Clock) -> None:
    signer = Signer(SECRET, "a", clock)
    seqs = [signer.next_seq() for _ in range(3)]
    clock.now -= 10
    seqs.append(signer.next_seq())
    assert seqs == sorted(set(seqs))
    assert seqs[0] == int(T0 * 1_000_000)
    # Across a restart, a new signer continues above (microsecond time has moved on).
    clock.now += 11
    assert Signer(SECRET, "a", clock).next_seq() > seqs[-1]


@pytest.mark.parametrize("skew", [-WINDOW - 0.5, WINDOW + 0.5, -3600.0])
async def test_a_stale_or_future_time_is_refused(clock: Clock, skew: float) -> None:
    headers = Signer(SECRET, "a", Clock(T0 + skew)).headers(BODY, "b")
    with pytest.raises(ClockSkewError, match=r"message time is [+-]\d+\.\ds off: a's clock is [+-]\d+\.\ds off ours "
                       r"\(allowed ±30s; fix the clocks") as refused:
        await _verifier("b", clock).verify_request(headers, BODY)
    assert refused.value.peer == "a"
    assert refused.value.offset == pytest.approx(skew)


async def test_a_forged_message_with_a_skewed_time_is_refused_as_forged_not_skewed(clock: Clock) -> None:
    headers = Signer(b"another secret of 32 bytes......", "a", Clock(T0 + 3600)).headers(BODY, "b")
    with pytest.raises(AuthenticationError, match="bad signature") as refused:
        await _verifier("b", clock).verify_request(headers, BODY)
    assert not isinstance(refused.value, ClockSkewError)


async def test_times_at_the_edge_of_the_window_are_accepted(clock: Clock) -> None:
    verifier = _verifier("b", clock)
    for skew in (-WINDOW, WINDOW):
        assert await verifier.verify_request(Signer(SECRET, "a", Clock(T0 + skew)).headers(BODY, "b"), BODY) == "a"


async def test_refusal_reasons_in_order(clock: Clock) -> None:
    signer, verifier = Signer(SECRET, "a", clock), _verifier("b", clock)
    good = signer.headers(BODY, "b")
    for missing in (REGION, TIME, SEQ, SIGNATURE):
        with pytest.raises(AuthenticationError, match="unsigned message"):
            await verifier.verify_request({k: v for k, v in good.items() if k != missing}, BODY)
    with pytest.raises(AuthenticationError, match="unknown region 'z'"):
        await verifier.verify_request(Signer(SECRET, "z", clock).headers(BODY, "b"), BODY)
    # Unknown sender is reported before a bad signature; a bad signature before a bad time
    # (only a signed message can report its sender's clock as skewed).
    with pytest.raises(AuthenticationError, match="unknown region"):
        await verifier.verify_request({**good, REGION: "z", TIME: "1.0"}, BODY)
    with pytest.raises(AuthenticationError, match="bad signature"):
        await verifier.verify_request({**good, TIME: "1.0", SIGNATURE: "00"}, BODY)
    with pytest.raises(AuthenticationError, match="bad signature"):
        await verifier.verify_request({**good, SIGNATURE: "00"}, BODY)
    with pytest.raises(AuthenticationError, match="bad signature"):
        await verifier.verify_request(good, BODY + b"tampered")
    with pytest.raises(AuthenticationError, match="bad signature"):
        await verifier.verify_request(Signer(b"another-secret-of-32-bytes......", "a", clock).headers(BODY, "b"), BODY)
    for stamp, seq in (("nan", "1"), ("inf", "1"), (f"{T0} ", "1"), (good[TIME], "1\n"), (good[TIME], "-1"), (good[TIME], "1_0")):
        with pytest.raises(AuthenticationError, match="malformed"):
            await verifier.verify_request({**good, TIME: stamp, SEQ: seq}, BODY)
    # None of the refused messages reached the guard: the good one is still new.
    assert await verifier.verify_request(good, BODY) == "a"


async def test_a_forged_message_does_not_burn_the_sequence_number(clock: Clock) -> None:
    """The guard is asked only after the signature checks out."""
    signer, verifier = Signer(SECRET, "a", clock), _verifier("b", clock)
    good = signer.headers(BODY, "b")
    with pytest.raises(AuthenticationError, match="bad signature"):
        await verifier.verify_request({**good, SIGNATURE: "f" * 64}, BODY)
    assert await verifier.verify_request(good, BODY) == "a"


# -- responses --------------------------------------------------------------------------


def test_responses_must_come_from_the_peer_asked_and_be_signed_for_us(clock: Clock) -> None:
    a, b, c = (Signer(SECRET, r, clock) for r in "abc")
    at_a = _verifier("a", clock)
    seq = int(a.headers(BODY, "b")[SEQ])  # a's request to b
    reply = b.headers(b"reply", "a", seq=seq, response=True)
    assert at_a.verify_response(reply, b"reply", seq, "b") == "b"
    assert at_a.verify_response(reply, b"reply", seq, "b") == "b"  # responses do not use the guard
    with pytest.raises(AuthenticationError, match="bad signature"):
        at_a.verify_response(b.headers(b"reply", "c", seq=seq, response=True), b"reply", seq, "b")  # b's answer to c
    with pytest.raises(AuthenticationError, match=r"response from 'c', but the request went to 'b'"):
        at_a.verify_response(c.headers(b"reply", "a", seq=seq, response=True), b"reply", seq, "b")
    with pytest.raises(AuthenticationError, match="another request"):
        at_a.verify_response(b.headers(b"reply", "a", seq=seq - 1, response=True), b"reply", seq, "b")
    with pytest.raises(AuthenticationError, match="message time"):
        at_a.verify_response(Signer(SECRET, "b", Clock(T0 - 60)).headers(b"reply", "a", seq=seq, response=True), b"reply", seq, "b")
    with pytest.raises(AuthenticationError, match="unsigned"):
        at_a.verify_response({}, b"reply", seq, "b")
    with pytest.raises(AuthenticationError, match="bad signature"):
        at_a.verify_response(reply, b"forged reply", seq, "b")


async def test_a_large_body_is_checked_off_the_event_loop_with_the_same_verdicts(clock: Clock) -> None:
    body = bytes(range(256)) * (THREAD_HASH_BYTES // 256 * 32)  # 32 MiB: tens of ms of hashing
    signer, at_b = Signer(SECRET, "a", clock), _verifier("b", clock)
    headers = signer.headers(body, "b")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    ticks = 0
    try:
        assert (await at_b.authenticate_async(headers, body)).sender == "a"
        assert ticks >= 3  # the loop went on serving while the body was hashed
    finally:
        task.cancel()
    with pytest.raises(AuthenticationError, match="bad signature"):
        await at_b.authenticate_async(headers, body[:-1] + b"x")
    with pytest.raises(AuthenticationError, match="bad signature"):
        await _verifier("c", clock).authenticate_async(headers, body)  # addressed to b
    seq = int(Signer(SECRET, "b", clock).headers(BODY, "a")[SEQ])
    reply = signer.headers(body, "b", seq=seq, response=True)
    assert await at_b.verify_response_async(reply, body, seq, "a") == "a"
    with pytest.raises(AuthenticationError, match="bad signature"):
        await at_b.verify_response_async(reply, body[1:] + b"x", seq, "a")


# -- secrets and construction -----------------------------------------------------------


async def test_the_secret_never_appears_in_reprs(store: AsyncStore, clock: Clock) -> None:
    guard = RedisReplayGuard(store, "gl", "b", WINDOW)
    objects = [Signer(SECRET, "a", clock), _verifier("b", clock, guard=guard), guard, MemoryReplayGuard(WINDOW)]
    text = " ".join(repr(o) + str(o) for o in objects)
    for form in (SECRET.decode(), repr(SECRET), SECRET.hex()):
        assert form not in text
    assert "secret=<redacted>" in repr(objects[0])
    assert "secret=<redacted>" in repr(objects[1])


def test_short_secrets_and_bad_arguments_are_refused(clock: Clock) -> None:
    short = b"x" * (MIN_SECRET_BYTES - 1)
    with pytest.raises(ConfigError, match=f"at least {MIN_SECRET_BYTES} bytes"):
        Signer(short, "a")
    with pytest.raises(ConfigError, match=f"at least {MIN_SECRET_BYTES} bytes"):
        Verifier(short, ["a"], "b")
    with pytest.raises(ConfigError, match="dest"):
        Signer(SECRET, "a").headers(BODY, "b\nc")
    with pytest.raises(ConfigError, match="own_region"):
        Verifier(SECRET, ["a"], "")
    with pytest.raises(ConfigError, match="window"):
        MemoryReplayGuard(0)


def test_the_default_guard_is_in_memory(clock: Clock) -> None:
    assert isinstance(_verifier("b", clock).guard, MemoryReplayGuard)


# -- the in-memory guard ----------------------------------------------------------------


async def test_memory_guard_forgets_entries_older_than_the_window() -> None:
    guard = MemoryReplayGuard(WINDOW)
    for seq in range(10):
        assert await guard.check_and_record("a", seq, T0, T0)
    assert not await guard.check_and_record("a", 3, T0, T0)
    assert len(guard) == 10
    later = T0 + WINDOW + 1.5
    assert await guard.check_and_record("a", 100, later, later)
    assert len(guard) == 1  # everything stamped T0 is now beyond the horizon


async def test_memory_guard_is_bounded_per_sender() -> None:
    guard = MemoryReplayGuard(WINDOW, max_entries=5)
    for seq in range(20):
        assert await guard.check_and_record("a", seq, T0 + seq / 100, T0)
        assert await guard.check_and_record("c", seq, T0 + seq / 100, T0)
    assert len(guard) == 10
    for seq in range(15, 20):  # the newest are kept
        assert not await guard.check_and_record("a", seq, T0 + seq / 100, T0)


# -- the Redis guard --------------------------------------------------------------------


def _seen(client: redis.Redis, guard: RedisReplayGuard, sender: str) -> list[tuple[bytes, float]]:
    pairs: list[tuple[bytes, float]] = client.zrange(guard.key(sender), 0, -1, withscores=True)  # type: ignore[assignment]
    return [(m, float(s)) for m, s in pairs]


async def test_redis_guard_refuses_a_replay_after_an_agent_restart(
    redis_url: str, store: AsyncStore, redis_client: redis.Redis, clock: Clock
) -> None:
    signer = Signer(SECRET, "a", clock)
    captured = signer.headers(BODY, "b")
    before = _verifier("b", clock, guard=RedisReplayGuard(store, "gl", "b", WINDOW))
    assert await before.verify_request(captured, BODY) == "a"
    with pytest.raises(AuthenticationError, match="replayed"):
        await before.verify_request(captured, BODY)

    # "Restart": a new connection, guard and verifier; nothing shared but Redis.
    clock.now += 5
    restarted_store = open_async_store(redis_url)
    try:
        after = _verifier("b", clock, guard=RedisReplayGuard(restarted_store, "gl", "b", WINDOW))
        with pytest.raises(AuthenticationError, match="replayed"):
            await after.verify_request(captured, BODY)
        assert await after.verify_request(signer.headers(BODY, "b"), BODY) == "a"
    finally:
        await restarted_store.close()
    key = RedisReplayGuard(store, "gl", "b", WINDOW).key("a")
    assert key == b"gl#seen:{b}:a"
    assert redis_client.zcard(key) == 2


async def test_redis_guards_are_separate_per_region_prefix_and_sender(store: AsyncStore) -> None:
    b, c, other = (RedisReplayGuard(store, "gl", "b", WINDOW), RedisReplayGuard(store, "gl", "c", WINDOW),
                   RedisReplayGuard(store, "app2", "b", WINDOW))
    assert await b.check_and_record("a", 1, T0, T0)
    assert not await b.check_and_record("a", 1, T0, T0)
    assert await b.check_and_record("c", 1, T0, T0)
    assert await c.check_and_record("a", 1, T0, T0)
    assert await other.check_and_record("a", 1, T0, T0)


async def test_redis_guard_trims_entries_older_than_the_window_and_expires_idle_sets(
    store: AsyncStore, redis_client: redis.Redis, clock: Clock
) -> None:
    guard = RedisReplayGuard(store, "gl", "b", WINDOW)
    verifier = _verifier("b", clock, guard=guard)
    signer = Signer(SECRET, "a", clock)
    old = [signer.headers(BODY, "b") for _ in range(5)]
    for headers in old:
        await verifier.verify_request(headers, BODY)
    assert len(_seen(redis_client, guard, "a")) == 5
    ttl = redis_client.pttl(guard.key("a"))
    assert 2 * WINDOW * 1000 <= ttl <= 2 * WINDOW * 1000 + 2000

    clock.now += WINDOW + 0.5  # the old messages are not yet past now - window - 1: kept
    middle = signer.headers(BODY, "b")
    await verifier.verify_request(middle, BODY)
    assert len(_seen(redis_client, guard, "a")) == 6

    clock.now += 1.5  # now they are: dropped by the next call
    newest = signer.headers(BODY, "b")
    await verifier.verify_request(newest, BODY)
    assert _seen(redis_client, guard, "a") == [
        (middle[SEQ].encode(), T0 + WINDOW + 0.5),
        (newest[SEQ].encode(), T0 + WINDOW + 2.0),
    ]
    # Those messages are still refused: by the time check, which the guard relies on.
    with pytest.raises(AuthenticationError, match="message time"):
        await verifier.verify_request(old[0], BODY)


async def test_redis_guard_is_bounded_in_size(store: AsyncStore, redis_client: redis.Redis) -> None:
    guard = RedisReplayGuard(store, "gl", "b", WINDOW, max_entries=50)
    for seq in range(200):
        assert await guard.check_and_record("a", seq, T0 + seq / 1000, T0)
    seen = _seen(redis_client, guard, "a")
    assert len(seen) == 50
    assert [m for m, _ in seen] == [b"%d" % s for s in range(150, 200)]  # the newest
    assert not await guard.check_and_record("a", 199, T0 + 0.199, T0)


async def test_redis_guard_reports_storage_errors() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = open_async_store(f"redis://127.0.0.1:{port}", timeout=0.5)
    try:
        clock = Clock()
        verifier = _verifier("b", clock, guard=RedisReplayGuard(dead, "gl", "b", WINDOW))
        with pytest.raises(StorageError, match="Redis unreachable"):
            await verifier.verify_request(Signer(SECRET, "a", clock).headers(BODY, "b"), BODY)
    finally:
        await dead.close()


@pytest.mark.cluster
async def test_redis_guard_works_on_a_cluster(redis_cluster_url: str, cluster_client: object) -> None:
    cluster = open_async_store(redis_cluster_url)
    try:
        guard = RedisReplayGuard(cluster, "gl", "b", WINDOW)
        assert await guard.check_and_record("a", 1, T0, T0)
        assert not await guard.check_and_record("a", 1, T0, T0)
        assert await guard.check_and_record("c", 1, T0, T0)
    finally:
        await cluster.close()


async def test_a_captured_response_does_not_pass_as_a_request(clock: Clock) -> None:
    """Responses are signed under another label: b's answer to a is not a request from b to a."""
    response = Signer(SECRET, "b", clock).headers(BODY, "a", seq=12345, response=True)
    with pytest.raises(AuthenticationError, match="bad signature"):
        await _verifier("a", clock).verify_request(response, BODY)
    request = Signer(SECRET, "b", clock).headers(BODY, "a", seq=12345)
    with pytest.raises(AuthenticationError, match="bad signature"):
        _verifier("a", clock).verify_response(request, BODY, 12345, "b")
