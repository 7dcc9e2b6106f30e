"""FaultyLink over real loopback sockets: latency, byte order, partitions, black holes, shutdown."""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from collections.abc import Callable

import aiohttp
import pytest

from geolimit.errors import ConfigError, RequestError
from geolimit.netsim import FaultyLink, Latency, NetsimError
from tests.netsim.conftest import HttpEcho, TcpServer

DEADLINE = 10.0


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for: {what}")
        await asyncio.sleep(0.005)


async def read_to_end(reader: asyncio.StreamReader) -> bytes:
    """Everything until EOF; a reset counts as EOF (returns what was read before it)."""
    chunks = []
    try:
        while data := await asyncio.wait_for(reader.read(65536), DEADLINE):
            chunks.append(data)
    except ConnectionError:
        pass
    return b"".join(chunks)


async def connect_and_read(link: FaultyLink) -> bytes:
    """Connect and read to EOF; a reset (even during connect) counts as EOF."""
    try:
        reader, writer = await asyncio.open_connection(*link.address)
    except ConnectionResetError:
        return b""
    try:
        return await read_to_end(reader)
    finally:
        writer.close()


async def echo_once(link: FaultyLink, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(*link.address)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(payload)), DEADLINE)
    finally:
        writer.close()


async def rtts(session: aiohttp.ClientSession, url: str, samples: int) -> list[float]:
    """Round-trip times of sequential POSTs on one keep-alive connection (after one warm-up)."""
    out = []
    for i in range(samples + 1):
        body = b"%d" % i
        started = time.perf_counter()
        async with session.post(url + "/echo", data=body) as resp:
            assert await resp.read() == body
        if i:
            out.append(time.perf_counter() - started)
    return out


class RecordingRandom(random.Random):
    """A seeded Random that records every jitter the link draws."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.jitters: list[float] = []

    def uniform(self, a: float, b: float) -> float:
        value = super().uniform(a, b)
        self.jitters.append(value)
        return value


async def test_latency_is_added_per_direction(http_echo: HttpEcho) -> None:
    """Every chunk waits its direction's latency plus a jitter drawn from [-jitter, +jitter].

    Wall-clock times give only lower bounds (a loaded machine makes round trips
    slower, never faster); the delays themselves are checked through the draws.
    """
    rng = RecordingRandom(1)
    async with (
        FaultyLink("127.0.0.1", http_echo.port, rng=rng) as link,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE)) as session,
    ):
        through = await rtts(session, link.url, 10)
        link.set_latency("up", 0.05)
        up50 = await rtts(session, link.url, 20)
        assert rng.jitters == [], "no jitter configured: nothing drawn"
        link.set_latency("up", 0.0)
        link.set_latency("down", 0.03, jitter=0.01)
        chunks_before = link.stats.chunks["down"]
        down30 = await rtts(session, link.url, 20)
        assert link.latency("down") == Latency(0.03, 0.01)
        await wait_until(lambda: link.stats.chunks["down"] - chunks_before == len(rng.jitters),
                         "one downstream write per drawn delay")

    print("median RTT (ms):", {k: round(statistics.median(v) * 1000, 2)
                               for k, v in {"through": through, "up50": up50, "down30": down30}.items()})
    assert len(through) == 10, "a link without latency passes every request"
    # 50 ms up, 0 down: no round trip is faster than 50 ms.
    assert min(up50) >= 0.0499
    # 30 +- 10 ms down only: one draw per downstream chunk, each within the jitter, so every
    # chunk waits 20 to 40 ms, and no round trip is faster than 20 ms.
    assert len(rng.jitters) >= 21
    assert all(-0.01 <= j <= 0.01 for j in rng.jitters)
    assert min(rng.jitters) < 0 < max(rng.jitters), "the jitter goes both ways"
    assert min(down30) >= 0.0199


async def test_byte_order_is_preserved_with_jitter(tcp_echo: TcpServer) -> None:
    # Delays of 0-10 ms per chunk, chunks 1 ms apart: per-chunk sleeps would reorder heavily.
    link = FaultyLink("127.0.0.1", tcp_echo.port, rng=random.Random(7),
                      up=Latency(0.005, 0.005), down=Latency(0.005, 0.005))
    async with link:
        reader, writer = await asyncio.open_connection(*link.address)
        rng = random.Random(3)
        sent = []
        for seq in range(300):
            chunk = seq.to_bytes(4, "big") * rng.randint(1, 64)
            sent.append(chunk)
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0.001)  # pacing, so the proxy reads many separate chunks
        expected = b"".join(sent)
        received = await asyncio.wait_for(reader.readexactly(len(expected)), DEADLINE)
        assert received == expected
        writer.write_eof()
        assert await read_to_end(reader) == b""  # the echo server's EOF comes back through
        writer.close()
        await wait_until(lambda: link.stats.active == 0, "the connection to close cleanly")
        stats = link.stats
    assert stats.chunks["up"] >= 100, stats
    assert stats.forwarded == {"up": len(expected), "down": len(expected)}
    assert stats.dropped == {"up": 0, "down": 0}
    assert (stats.accepted, stats.cut, stats.refused) == (1, 0, 0)


async def test_partition_cuts_refuses_and_heal_restores(tcp_echo: TcpServer) -> None:
    async with FaultyLink("127.0.0.1", tcp_echo.port) as link:
        reader, writer = await asyncio.open_connection(*link.address)
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.readexactly(5), DEADLINE) == b"hello"
        assert link.stats.active == 1

        link.partition()
        assert link.partitioned
        assert await read_to_end(reader) == b""  # the established connection is cut
        writer.close()
        await wait_until(lambda: link.stats.active == 0, "the cut connection to be released")

        assert await connect_and_read(link) == b""  # accepted by the kernel, aborted at once
        await wait_until(lambda: link.stats.refused == 1, "the refused connection to be counted")

        link.heal()
        assert await echo_once(link, b"back again") == b"back again"
        stats = link.stats
    assert (stats.accepted, stats.cut, stats.refused) == (2, 1, 1)
    assert stats.forwarded["up"] == len(b"hello") + len(b"back again")


async def test_partition_and_heal_seen_by_an_http_client(http_echo: HttpEcho) -> None:
    connector = aiohttp.TCPConnector(force_close=True)  # a new connection per request
    async with (
        FaultyLink("127.0.0.1", http_echo.port) as link,
        aiohttp.ClientSession(connector=connector) as session,
    ):
        async with session.post(link.url + "/echo", data=b"one") as resp:
            assert await resp.read() == b"one"
        link.partition()
        with pytest.raises(aiohttp.ClientError):
            async with session.post(link.url + "/echo", data=b"two") as resp:
                await resp.read()
        link.heal()
        async with session.post(link.url + "/echo", data=b"three") as resp:
            assert await resp.read() == b"three"
    assert http_echo.received == [b"one", b"three"]
    assert link.stats.refused == 1


async def test_one_way_block_black_holes_one_direction(tcp_sink: TcpServer) -> None:
    async with FaultyLink("127.0.0.1", tcp_sink.port) as link:
        reader, writer = await asyncio.open_connection(*link.address)
        server_reader, server_writer = await asyncio.wait_for(tcp_sink.accepted.get(), DEADLINE)

        link.block("up")
        assert link.blocked == {"up"}
        writer.write(b"ping")
        await writer.drain()
        server_writer.write(b"tick")  # the server speaks spontaneously: down still flows
        await server_writer.drain()
        assert await asyncio.wait_for(reader.readexactly(4), DEADLINE) == b"tick"
        await wait_until(lambda: link.stats.dropped["up"] == 4, "the ping to be black-holed")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(server_reader.read(1), 0.2)

        link.unblock("up")
        writer.write(b"pong")
        assert await asyncio.wait_for(server_reader.readexactly(4), DEADLINE) == b"pong"

        link.block("down")
        server_writer.write(b"lost")
        await wait_until(lambda: link.stats.dropped["down"] == 4, "the reply to be black-holed")
        writer.write(b"more")  # up flows while down is blocked
        assert await asyncio.wait_for(server_reader.readexactly(4), DEADLINE) == b"more"
        stats = link.stats
        writer.close()
    assert stats.forwarded == {"up": 8, "down": 4}
    assert stats.dropped == {"up": 4, "down": 4}
    assert (stats.accepted, stats.active) == (1, 1)


async def test_blocked_http_requests_time_out(http_echo: HttpEcho) -> None:
    timeout = aiohttp.ClientTimeout(total=0.3)
    async with (
        FaultyLink("127.0.0.1", http_echo.port) as link,
        aiohttp.ClientSession(timeout=timeout) as session,
    ):
        link.block("down")  # the request arrives, the response is lost
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(link.url + "/echo", data=b"answer lost") as resp:
                await resp.read()
        await wait_until(lambda: http_echo.received == [b"answer lost"], "the request to arrive")

        link.unblock()
        link.block("up")  # the request is lost
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(link.url + "/echo", data=b"request lost") as resp:
                await resp.read()
        assert http_echo.received == [b"answer lost"]

        link.unblock("up")
        async with session.post(link.url + "/echo", data=b"ok") as resp:
            assert await resp.read() == b"ok"
    assert http_echo.received == [b"answer lost", b"ok"]


async def test_stop_closes_everything(tcp_echo: TcpServer) -> None:
    loop_errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: loop_errors.append(context))
    link = FaultyLink("127.0.0.1", tcp_echo.port, down=Latency(5.0), name="stoptest")
    with pytest.raises(NetsimError, match="not been started"):
        _ = link.port
    await link.start()
    address = link.address
    clients = [await asyncio.open_connection(*address) for _ in range(3)]
    clients[0][1].write(b"in flight")  # echoed, then held 5 s in the down queue
    await wait_until(lambda: link.stats.active == 3 and tcp_echo.received == 9, "3 connections")

    await link.stop()
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("stoptest")] == []
    assert link.stats.active == 0
    assert link.stats.cut == 0  # a stop is not a partition
    for reader, writer in clients:
        assert await read_to_end(reader) == b""
        writer.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(*address)
    await link.stop()  # idempotent

    me = asyncio.current_task()
    await wait_until(lambda: set(asyncio.all_tasks()) == {me}, "every other task to finish")
    assert loop_errors == []  # no "Exception in callback" tracebacks from cancelled connections


class ExplodingRandom(random.Random):
    def random(self) -> float:
        raise ZeroDivisionError("rng exploded")


async def test_a_crashed_task_fails_loudly(tcp_echo: TcpServer, caplog: pytest.LogCaptureFixture) -> None:
    link = FaultyLink("127.0.0.1", tcp_echo.port, rng=ExplodingRandom(), name="crashtest")
    await link.start()
    link.set_latency("up", 0.01, jitter=0.005)
    with caplog.at_level(logging.ERROR, logger="geolimit.netsim"):
        reader, writer = await asyncio.open_connection(*link.address)
        writer.write(b"boom")
        assert await read_to_end(reader) == b""  # the broken connection is torn down
        writer.close()
        await wait_until(lambda: link.failure is not None, "the crash to be recorded")
    assert any("crashed" in r.getMessage() and r.exc_info for r in caplog.records)
    with pytest.raises(NetsimError):
        link.partition()  # the next call surfaces it
    with pytest.raises(NetsimError) as info:
        await link.stop()  # and so does stop(), after cleaning up
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("crashtest")] == []


async def test_bad_controls_are_rejected(tcp_echo: TcpServer) -> None:
    async with FaultyLink("127.0.0.1", tcp_echo.port) as link:
        with pytest.raises(ConfigError, match="latency"):
            link.set_latency("up", -0.1)
        with pytest.raises(RequestError, match="direction"):
            link.block("sideways")  # type: ignore[arg-type]
        link.set_latency("both", 0.0, 0.0)
        assert link.url == f"http://127.0.0.1:{link.port}"
        with pytest.raises(NetsimError, match="already started"):
            await link.start()
