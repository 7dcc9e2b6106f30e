"""Signed escrow messages that are well-formed but would leave a region unable to
replicate: a key grown past what a message may carry, values at the top of the range.
Three real regions (a Redis and an aiohttp agent each) in manual time; messages are
posted to b as its configured peer a."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgpack
import pytest

from geolimit import ManualClock, Rule
from geolimit.core.escrow import rights
from geolimit.replication import escrow_wire
from geolimit.replication.auth import Signer
from geolimit.replication.escrow_wire import EscrowMessage
from geolimit.store.embedded import EmbeddedRedis
from geolimit.store.escrow_fields import MAX_FIELDS_PER_KEY, MAX_VALUE, state_of
from tests.support.regions import Regions, dump_all

Factory = Callable[..., EmbeddedRedis]
LOGIN = Rule("login", 100, 60, escrow=True)
NAMES = ["a", "b", "c"]


@pytest.fixture
async def rs(redis_server_factory: Factory) -> AsyncIterator[Regions]:
    async with Regions(redis_server_factory, NAMES, [LOGIN], run_loops=False) as regions:
        await regions.step(2)
        regions.clock.advance(LOGIN.window)  # the new Redises' escrow hold ends
        await regions.step(3)
        assert all(regions[n].agent.escrow.held == 0 for n in NAMES)  # type: ignore[union-attr]
        regions["b"].app().hit("login", "victim", cost=3)
        await regions.step(2)
        yield regions


def _push(keys: list[tuple[bytes, list[Any]]]) -> bytes:
    return escrow_wire.encode(EscrowMessage(
        "push", "a", "b", 64, {"login": (LOGIN.window_us, LOGIN.resolution_us)}, keys=keys))


async def _post(rs: Regions, body: bytes) -> tuple[int, Any]:
    clock = rs.clock
    assert isinstance(clock, ManualClock)
    clock.advance(0.001)  # a new sequence number
    headers = Signer(rs.secret, "a", clock).headers(body, "b")
    async with aiohttp.ClientSession() as http, http.post(rs.urls["b"] + "/v1/escrow", data=body,
                                                          headers=headers) as resp:
        return resp.status, await resp.read()


def _key(rs: Regions, region: str, subject: bytes) -> bytes:
    found = [k for k in rs[region].client().scan_iter(match=b"gl:{*}:login:" + subject)]
    assert len(found) == 1, found
    return found[0]


def _failures(rs: Regions, region: str) -> dict[str, Any]:
    status = rs[region].agent.escrow.status()  # type: ignore[union-attr]
    return {p: (s["failures"], s["last_error"]) for p, s in status["peers"].items()}


def _raise_history(rs: Regions, subject: bytes, pairs: list[tuple[bytes, bytes]], top: int) -> None:
    """As if each pair of regions had traded rights back and forth for a long time: in
    every region, both transfers of each pair rise by the same amount, the larger to ``top``."""
    fields = rs["b"].client().hgetall(_key(rs, "b", subject))
    for there, back in pairs:
        extra = top - max(int(fields.get(there, 0)), int(fields.get(back, 0)))
        for region in NAMES:
            client, key = rs[region].client(), _key(rs, region, subject)
            assert client.hget(key, there) == fields.get(there)
            assert client.hget(key, back) == fields.get(back)
            client.hincrby(key, there, extra)
            client.hincrby(key, back, extra)


async def test_rights_are_exact_when_transfers_are_near_2_53(rs: Regions) -> None:
    # b's transfers in sum past 2**53 while its net is small: added up one by one in
    # Lua's doubles, the sum rounded (b admitted one more than its rights, or one less).
    _raise_history(rs, b"victim", [(b"t:a:b:100", b"t:b:a:100"), (b"t:c:b:100", b"t:b:c:100")], MAX_VALUE - 2)
    fields = rs["b"].client().hgetall(_key(rs, "b", b"victim"))
    held = rights(state_of(fields), "b", NAMES, LOGIN.limit)
    assert 3 < held <= LOGIN.limit
    b = rs["b"].app()
    assert sum(b.hit("login", "victim").allowed for _ in range(LOGIN.limit)) == held - 3  # 3 admitted before


async def test_an_advert_version_ahead_of_the_clock_is_refused_and_one_within_it_is_passed(rs: Regions) -> None:
    # A version is at least its region's clock in ms. a once said b's advert of victim
    # was at version 2**53 - 1 (a valid number): b could never advertise that key again.
    key = _key(rs, "b", b"victim")
    before = dump_all(rs["b"].client())
    status, body = await _post(rs, _push([(b"login:victim", [b"a:b", b"%d:0:0:0" % MAX_VALUE])]))
    assert status == 400
    assert b"ahead of this region's clock" in body
    assert dump_all(rs["b"].client()) == before
    # Up to the auth window ahead is a clock a peer may have: accepted, and passed by b's next advert.
    now_ms = round(rs.clock() * 1000)
    forged = now_ms + 30_000
    status, _ = await _post(rs, _push([(b"login:victim", [b"a:b", b"%d:0:0:0" % forged])]))
    assert status == 200
    assert int(rs["b"].client().hget(key, "a:b").split(b":")[0]) == forged
    b = rs["b"].app()
    for _ in range(3):
        b.hit("login", "victim")
        b.hit("login", "other")
        await rs.step()
    assert _failures(rs, "b") == {"a": (0, None), "c": (0, None)}
    for region in NAMES:
        version, used = (int(x) for x in rs[region].client().hget(_key(rs, region, b"victim"), "a:b").split(b":")[:2])
        assert version > forged  # b's own advert again, everywhere
        assert used == 6  # 3 before, 3 now
    for peer in ("a", "c"):
        assert rs[peer].client().hget(_key(rs, peer, b"other"), "a:b") is not None


async def test_gifts_stop_at_the_largest_exact_integer_and_pushes_go_on(rs: Regions) -> None:
    # a and b traded nearly 2**53 units of victim back and forth (a long-lived key with a
    # large limit gets there): every region holds both transfers raised by the same amount.
    # b's next gift to a would take t:b:a past what its peers accept.
    _raise_history(rs, b"victim", [(b"t:a:b:100", b"t:b:a:100")], MAX_VALUE - 5)
    apps = {n: rs[n].app() for n in NAMES}
    admitted = 3
    for _ in range(4):
        admitted += sum(apps["a"].hit("login", "victim").allowed for _ in range(40))
        apps["b"].hit("login", "other")
        await rs.step()
    admitted += sum(apps[n].hit("login", "victim").allowed for n in NAMES for _ in range(100))
    assert admitted <= LOGIN.limit
    assert _failures(rs, "b") == {"a": (0, None), "c": (0, None)}
    for region in NAMES:
        values = rs[region].client().hgetall(_key(rs, region, b"victim"))
        assert int(values[b"t:b:a:100"]) <= MAX_VALUE
    for peer in ("a", "c"):
        assert rs[peer].client().hget(_key(rs, peer, b"other"), "a:b") is not None


async def test_huge_requested_costs_do_not_stop_the_regions_pushes(rs: Regions) -> None:
    # Units asked for count denied requests too; a client sending the largest cost a
    # request may have (2**46, e.g. through a proxy route whose cost is a header) a few
    # times in one bucket must not give b an advert whose demand its peers refuse.
    b = rs["b"].app()
    for _ in range(200):
        assert not b.hit("login", "victim", cost=2**46).allowed
    b.hit("login", "other")
    await rs.step(2)
    assert _failures(rs, "b") == {"a": (0, None), "c": (0, None)}
    for peer in ("a", "c"):
        advert = rs[peer].client().hget(_key(rs, peer, b"victim"), "a:b")
        assert advert is not None
        assert all(0 <= int(x) <= MAX_VALUE for x in advert.split(b":"))


async def test_a_key_may_not_grow_past_the_fields_one_message_can_carry(rs: Regions) -> None:
    client = rs["b"].client()
    key = _key(rs, "b", b"victim")
    held = sum(1 for f in client.hkeys(key) if f[:2] in (b"t:", b"a:"))
    room = MAX_FIELDS_PER_KEY - held
    # Gifts both ways under ever other limits: plausible (every region's gifts are funded),
    # and a and c made them (only a region writes its own transfers: see the tests below).
    first = [x for i in range(room) for x in (b"t:%s:%d" % ((b"a:c", b"c:a")[i % 2], i // 2 + 1), b"1")]
    for writer in ("a", "c"):
        rs[writer].client().hset(_key(rs, writer, b"victim"), mapping=dict(zip(first[::2], first[1::2], strict=True)))
    status, _ = await _post(rs, _push([(b"login:victim", first)]))
    assert status == 200  # exactly full
    # A second message, itself within every per-message bound, would take the key past
    # what one message may carry: b could then never push the key again. Nothing is
    # written, not the other shard's key either, nor the replay guard.
    def state() -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
        # A DUMP of a hash this large follows its table's order, which a mere read may
        # change while Redis rehashes it: compare its fields, and every other key's DUMP.
        dumps = dump_all(client)
        del dumps[key]
        return dumps, client.hgetall(key)

    before = state()
    more = [b"t:a:c:%d" % (room + 5), b"1"]
    other = [b"t:a:b:100", b"1"]
    status, body = await _post(rs, _push([(b"login:elsewhere", other), (b"login:victim", more)]))
    assert status == 400, body
    assert b"more than 1024" in body
    assert state() == before
    # b's own pushes of the full key are still accepted by its peers.
    rs["b"].app().hit("login", "victim")
    await rs.step(2)
    assert _failures(rs, "b") == {"a": (0, None), "c": (0, None)}
    assert rs["c"].client().hlen(_key(rs, "c", b"victim")) >= MAX_FIELDS_PER_KEY


def _pull(holds: dict[int, int]) -> bytes:
    return escrow_wire.encode(EscrowMessage(
        "pull", "a", "b", 64, {"login": (LOGIN.window_us, LOGIN.resolution_us)}, cursor=(0, 0, 0), holds=holds))


@pytest.mark.parametrize(("holds", "reason"), [
    ([[64, 1]], b"out of range"),
    ([[3, 1], [3, 2]], b"twice"),
    ([[3, -1]], b"hold start"),
    ([[3]], b"hold entry"),
    ("x", b"holds must be a list"),
    ([[i, 1] for i in range(65)], b"holds must be a list"),
])
async def test_a_pull_with_bad_holds_is_refused_and_nothing_is_recorded(
    rs: Regions, holds: Any, reason: bytes,
) -> None:
    body = msgpack.unpackb(_pull({1: 5}), raw=False)
    body["holds"] = holds
    before = dump_all(rs["b"].client())
    status, answer = await _post(rs, msgpack.packb(body, use_bin_type=True))
    assert status == 400, answer
    assert reason in answer
    assert dump_all(rs["b"].client()) == before


async def test_a_peer_remembers_the_first_hold_of_a_region_and_names_a_later_one(rs: Regions) -> None:
    def known(answer: bytes) -> list[int]:
        return escrow_wire.decode(answer).known

    # b recorded a's holds when a's new Redis pulled it (the fixture's deployment).
    client = rs["b"].client()
    layout = rs["b"].agent.escrow.layout  # type: ignore[union-attr]
    first = {s: int(client.hget(layout.registry_key(s), "xk:a")) for s in (5, 9)}
    status, answer = await _post(rs, _pull(first))
    assert status == 200
    assert known(answer) == []
    status, answer = await _post(rs, _pull({5: first[5] + 1, 9: first[9]}))
    assert status == 200
    assert known(answer) == [5]
    assert int(client.hget(layout.registry_key(5), "xk:a")) == first[5]  # the first one is kept


def test_a_forged_gift_from_a_region_that_never_held_it_is_refused() -> None:
    """What b receives from a may carry c's transfers (a relays c's state), but never more
    than c could have given: its share plus what it was given, as fractions of the limit."""
    from geolimit.errors import ProtocolError
    from geolimit.store.escrow_fields import vet_fields

    def vet(pairs: list[tuple[bytes, bytes]], regions: list[str]) -> None:
        vet_fields([x for pair in pairs for x in pair], regions)

    regions = ["a", "b", "c"]
    vet([(b"t:c:b:10", b"3")], regions)  # c's share of 10 is 3
    vet([(b"t:a:c:10", b"4"), (b"t:c:b:10", b"7")], regions)  # c passes on what a gave it
    vet([(b"t:c:b:10", b"3"), (b"t:c:a:20", b"0")], regions)
    vet([(b"t:c:b:10", b"3"), (b"a:c", b"1:0:0:0")], regions)
    for forged in ([(b"t:c:b:10", b"1000")], [(b"t:c:b:10", b"3"), (b"t:c:a:10", b"1")],
                   [(b"t:a:c:10", b"4"), (b"t:c:b:10", b"8")]):
        with pytest.raises(ProtocolError, match="gave away more of this key's limit than it held"):
            vet(forged, regions)
