"""FaultyTransport over a recording in-process Transport: every fault, counters, determinism."""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from collections.abc import Callable

import pytest

from geolimit.errors import ConfigError
from geolimit.netsim import FaultCounters, FaultyTransport, PeerFaults
from geolimit.replication import wire
from geolimit.replication.transport import Transport, TransportError


class RecordingTransport:
    """Delivers in-process: records (peer, message) and answers an ack numbered by delivery."""

    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        self.deliveries: list[tuple[str, wire.Message]] = []
        self.failing = failing
        self.closed = False

    async def send(self, peer: str, message: wire.Message) -> wire.Message:
        if peer in self.failing:
            raise TransportError(f"{peer} is down")
        self.deliveries.append((peer, message))
        return wire.Message(kind="ack", sender=peer, now_us=len(self.deliveries))

    async def close(self) -> None:
        self.closed = True

    def order(self, peer: str | None = None) -> list[int]:
        """``now_us`` of each delivered message (used as a message id)."""
        return [m.now_us for p, m in self.deliveries if peer is None or p == peer]


class ManualTimer:
    """An injectable ``sleep``: sleepers wake only when the test calls :meth:`fire`."""

    def __init__(self) -> None:
        self.sleeping: list[tuple[float, asyncio.Future[None]]] = []

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sleeping.append((seconds, future))
        await future

    def fire(self) -> None:
        for _, future in self.sleeping:
            if not future.done():
                future.set_result(None)


def msg(n: int) -> wire.Message:
    return wire.Message(kind="delta", sender="eu", now_us=n)


async def settle(condition: Callable[[], bool]) -> None:
    """Let the event loop run (no real time) until ``condition`` holds."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    pytest.fail("the event loop settled without reaching the expected state")


async def test_it_stands_in_for_the_transport_it_wraps() -> None:
    for method in ("send", "close"):  # the engine calls these two, with these signatures
        assert inspect.signature(getattr(FaultyTransport, method)) == inspect.signature(getattr(Transport, method))
    inner = RecordingTransport()
    middle = FaultyTransport(inner, random.Random(0))
    outer: Transport = FaultyTransport(middle, random.Random(1))  # a FaultyTransport wraps any Transport
    reply = await outer.send("us", msg(9))
    assert (reply.kind, reply.sender, reply.now_us) == ("ack", "us", 1)
    assert inner.order("us") == [9]
    assert middle.counters("us") == FaultCounters(sends=1, delivered=1)
    await outer.close()
    assert inner.closed, "closing the outer transport closes the whole chain"


async def test_no_faults_by_default() -> None:
    inner = RecordingTransport()
    async with FaultyTransport(inner, random.Random(0)) as ft:
        replies = [await ft.send("us", msg(i)) for i in range(1, 6)]
    assert [r.now_us for r in replies] == [1, 2, 3, 4, 5]
    assert inner.order() == [1, 2, 3, 4, 5]
    assert ft.counters("us") == FaultCounters(sends=5, delivered=5)
    assert inner.closed


async def test_dropped_request_is_never_delivered() -> None:
    inner = RecordingTransport()
    ft = FaultyTransport(inner, random.Random(0))
    ft.configure("us", drop_request=1.0)
    with pytest.raises(TransportError, match="request dropped"):
        await ft.send("us", msg(1))
    assert inner.deliveries == []
    assert (await ft.send("ap", msg(2))).kind == "ack"  # other peers are unaffected
    assert inner.order("ap") == [2]
    assert ft.counters("us") == FaultCounters(sends=1, dropped_requests=1)


async def test_dropped_response_is_delivered_but_reported_lost() -> None:
    inner = RecordingTransport()
    ft = FaultyTransport(inner, random.Random(0))
    ft.configure("us", drop_response=1.0)
    with pytest.raises(TransportError, match="response dropped"):
        await ft.send("us", msg(1))
    assert inner.order() == [1]
    assert ft.counters("us") == FaultCounters(sends=1, delivered=1, dropped_responses=1)


async def test_duplicate_is_delivered_twice_and_returns_the_second_reply() -> None:
    inner = RecordingTransport()
    ft = FaultyTransport(inner, random.Random(0), default=PeerFaults(duplicate=1.0))
    reply = await ft.send("us", msg(7))
    assert inner.order() == [7, 7]
    first, second = (m for _, m in inner.deliveries)
    assert first == second
    assert first is not second  # a fresh copy, like a second decode
    assert reply.now_us == 2
    assert ft.counters("us") == FaultCounters(sends=1, delivered=2, duplicated=1)


async def test_reorder_swaps_a_held_message_with_the_next_one() -> None:
    inner = RecordingTransport()
    ft = FaultyTransport(inner, random.Random(0), default=PeerFaults(reorder=1.0, max_hold=None))
    first = asyncio.create_task(ft.send("us", msg(1)))
    await settle(lambda: ft.holding("us"))
    assert inner.deliveries == []
    second = await ft.send("us", msg(2))  # overtakes; never held itself
    assert (await first).now_us == 2  # each caller gets its own reply
    assert second.now_us == 1
    third = asyncio.create_task(ft.send("us", msg(3)))
    await settle(lambda: ft.holding("us"))
    await ft.send("us", msg(4))
    await third
    assert inner.order() == [2, 1, 4, 3]
    assert ft.counters("us") == FaultCounters(sends=4, delivered=4, held=2, reordered=2)


async def test_held_message_goes_alone_after_max_hold() -> None:
    inner = RecordingTransport()
    timer = ManualTimer()
    ft = FaultyTransport(inner, random.Random(0), sleep=timer.sleep)
    ft.configure("us", reorder=1.0, max_hold=0.25)
    held = asyncio.create_task(ft.send("us", msg(1)))
    await settle(lambda: len(timer.sleeping) == 1)
    assert timer.sleeping[0][0] == 0.25
    assert ft.holding("us")
    assert inner.deliveries == []
    timer.fire()
    assert (await held).now_us == 1
    assert inner.order() == [1]
    assert ft.counters("us") == FaultCounters(sends=1, delivered=1, held=1, hold_expired=1)


async def test_max_hold_in_real_time() -> None:
    inner = RecordingTransport()
    ft = FaultyTransport(inner, random.Random(0), default=PeerFaults(reorder=1.0, max_hold=0.05))
    started = time.perf_counter()
    await ft.send("us", msg(1))
    elapsed = time.perf_counter() - started
    assert 0.05 <= elapsed < 2.0
    assert ft.counters("us").hold_expired == 1


async def test_flush_releases_held_messages() -> None:
    inner = RecordingTransport()
    ft = FaultyTransport(inner, random.Random(0), default=PeerFaults(reorder=1.0, max_hold=None))
    tasks = [asyncio.create_task(ft.send(peer, msg(i))) for i, peer in enumerate(("us", "ap"), 1)]
    await settle(lambda: ft.holding("us") and ft.holding("ap"))
    assert ft.flush("us") == 1
    assert (await tasks[0]).sender == "us"
    assert ft.flush() == 1
    await tasks[1]
    assert inner.order() == [1, 2]
    assert ft.flush() == 0
    assert ft.totals() == FaultCounters(sends=2, delivered=2, held=2, hold_expired=2)


async def test_partition_refuses_without_delivery_and_heal_restores() -> None:
    inner = RecordingTransport()
    ft = FaultyTransport(inner, random.Random(0))
    ft.partition("us")
    assert ft.faults("us").partitioned
    with pytest.raises(TransportError, match="partitioned"):
        await ft.send("us", msg(1))
    await ft.send("ap", msg(2))
    ft.heal("us")
    await ft.send("us", msg(3))
    assert inner.deliveries == [("ap", msg(2)), ("us", msg(3))]
    assert ft.counters("us") == FaultCounters(sends=2, delivered=1, partitioned=1)


async def test_a_message_held_when_the_partition_starts_is_lost() -> None:
    inner = RecordingTransport()
    ft = FaultyTransport(inner, random.Random(0), default=PeerFaults(reorder=1.0, max_hold=None))
    held = asyncio.create_task(ft.send("us", msg(1)))
    await settle(lambda: ft.holding("us"))
    ft.partition("us")
    with pytest.raises(TransportError):
        await ft.send("us", msg(2))  # refused, and it releases the held message...
    with pytest.raises(TransportError, match="while held"):
        await held  # ...which finds the partition
    assert inner.deliveries == []
    assert ft.counters("us") == FaultCounters(sends=2, partitioned=2, held=1, reordered=1)


async def test_close_fails_held_messages_and_closes_the_inner_transport() -> None:
    inner = RecordingTransport()
    ft = FaultyTransport(inner, random.Random(0), default=PeerFaults(reorder=1.0, max_hold=None))
    held = asyncio.create_task(ft.send("us", msg(1)))
    await settle(lambda: ft.holding("us"))
    await ft.close()
    with pytest.raises(TransportError, match="closed"):
        await held
    with pytest.raises(TransportError, match="closed"):
        await ft.send("us", msg(2))
    assert inner.closed
    assert inner.deliveries == []


async def test_inner_errors_propagate_and_are_counted() -> None:
    ft = FaultyTransport(RecordingTransport(failing=frozenset({"us"})), random.Random(0))
    with pytest.raises(TransportError, match="us is down"):
        await ft.send("us", msg(1))
    assert ft.counters("us") == FaultCounters(sends=1, inner_errors=1)


async def test_settings_are_validated_and_updated_per_peer() -> None:
    with pytest.raises(ConfigError, match="drop_request"):
        PeerFaults(drop_request=1.5)
    with pytest.raises(ConfigError, match="max_hold"):
        PeerFaults(max_hold=-1.0)
    ft = FaultyTransport(RecordingTransport(), random.Random(0), default=PeerFaults(duplicate=0.5))
    updated = ft.configure("us", drop_request=0.25, max_hold=None)
    assert updated == PeerFaults(drop_request=0.25, duplicate=0.5, max_hold=None)
    assert ft.configure("us", reorder=0.1).max_hold is None  # unspecified fields are kept
    assert ft.faults("ap") == PeerFaults(duplicate=0.5)
    ft.reset("us")
    assert ft.faults("us") == PeerFaults(duplicate=0.5)


async def scenario(seed: int) -> tuple[list[tuple[str, int]], list[str], FaultCounters]:
    """400 concurrent sends to two peers with every fault at 20%; everything observable."""
    inner = RecordingTransport()
    faults = PeerFaults(drop_request=0.2, drop_response=0.2, duplicate=0.2, reorder=0.2, max_hold=None)
    ft = FaultyTransport(inner, random.Random(seed), default=faults)

    async def one(peer: str, n: int) -> str:
        try:
            return f"ok:{(await ft.send(peer, msg(n))).now_us}"
        except TransportError as exc:
            return f"error:{exc}"

    tasks = [asyncio.create_task(one(("us", "ap")[n % 2], n)) for n in range(400)]
    await settle(lambda: sum(not t.done() for t in tasks) == ft.holding("us") + ft.holding("ap"))
    ft.flush()
    outcomes = await asyncio.gather(*tasks)
    return [(p, m.now_us) for p, m in inner.deliveries], outcomes, ft.totals()


async def test_a_seeded_run_is_reproducible() -> None:
    deliveries, outcomes, totals = await scenario(42)
    assert await scenario(42) == (deliveries, outcomes, totals)
    assert (await scenario(43))[0] != deliveries
    # Each fault fired at roughly its rate (deterministic for this seed).
    assert totals.sends == 400
    assert 50 <= totals.dropped_requests <= 110
    for count in (totals.duplicated, totals.held, totals.dropped_responses):
        assert 30 <= count <= 110, totals
    assert totals.held == totals.reordered + totals.hold_expired
    ids = [n for _, n in deliveries]
    assert ids != sorted(ids)  # some messages were reordered...
    assert len(ids) - len(set(ids)) == totals.duplicated  # ...and some duplicated
    assert totals.delivered == len(deliveries)
