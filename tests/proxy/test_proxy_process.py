"""`geolimit proxy` as a real process: flat memory while streaming 100 MB, SIGTERM, SIGHUP, bad files."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from tests.proxy.helpers import (
    ProxyProcess,
    Upstream,
    body_chunks,
    dump_toml,
    expected_sha256,
    peak_rss_during,
    proxy_config,
    rss_bytes,
)
from tests.server.helpers import cli
from tests.support.cli_fixtures import running
from tests.support.regions import eventually

__all__ = ["running"]  # fixtures

MIB = 1024 * 1024


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(dump_toml(data))
    return path


async def launch(running: list[ProxyProcess], path: Path, data: dict[str, Any]) -> tuple[ProxyProcess, str, str]:
    write_config(path, data)
    proc = await ProxyProcess.start(path)
    running.append(proc)
    url, admin = await proc.urls()
    return proc, url, admin


async def test_streaming_100_mb_both_ways_keeps_the_proxy_memory_flat(
    tmp_path: Path, upstream: Upstream, redis_url: str, redis_client: redis.Redis, running: list[ProxyProcess],
) -> None:
    data = proxy_config([upstream.url], redis_url=redis_url, rules=[{"name": "bytes", "limit": "10000000000/10s"}],
                        routes=[{"path": "/echo", "limits": [{"rule": "bytes", "cost": "body"}]}],
                        timeout=120)  # the upstream exchange's cap (30 s by default), not what this test measures
    data["log"] = {"level": "INFO"}
    proc, url, _ = await launch(running, tmp_path / "proxy.toml", data)
    total = 100 * MIB
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:

        async def echo(size: int) -> tuple[int, str, int]:
            digest = hashlib.sha256()
            received = 0
            async with session.post(url + "/echo", data=body_chunks(size),
                                    headers={"Content-Length": str(size)}) as resp:
                async for chunk in resp.content.iter_chunked(256 * 1024):
                    received += len(chunk)
                    digest.update(chunk)
                return resp.status, digest.hexdigest(), received

        assert (await echo(8 * MIB))[0] == 200  # warm up: pools, buffers, imports
        baseline = rss_bytes(proc.pid)
        started = time.monotonic()
        (status, digest, received), peak = await peak_rss_during(proc.pid, echo(total))
        elapsed = time.monotonic() - started
    assert status == 200
    assert received == total
    assert digest == expected_sha256(total), "every byte arrived, in order"
    growth = peak - baseline
    print(f"\n100 MiB up + 100 MiB down in {elapsed:.2f}s; proxy RSS {baseline / MIB:.1f} MiB -> peak "
          f"{peak / MIB:.1f} MiB (+{growth / MIB:.1f} MiB)")
    assert growth < 30 * MIB, f"proxy RSS grew by {growth / MIB:.1f} MiB while streaming"
    seen = upstream.seen[-1]
    assert seen.header("Content-Length") == str(total), "the length is passed on, not re-chunked"


async def test_a_100_mb_download_on_the_fast_path_keeps_the_proxy_memory_flat(
    tmp_path: Path, upstream: Upstream, redis_url: str, redis_client: redis.Redis, running: list[ProxyProcess],
) -> None:
    data = proxy_config([upstream.url], redis_url=redis_url, rules=[{"name": "api", "limit": "1000/10s"}],
                        routes=[{"path": "/download/*", "limits": [{"rule": "api", "key": "ip"}]}],
                        timeout=120)  # a slow reader on a busy CI took 30 s, the default cap: 504
    data["log"] = {"level": "INFO"}
    proc, url, _ = await launch(running, tmp_path / "proxy.toml", data)
    total = 100 * MIB
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120), auto_decompress=False) as session:

        async def download(size: int) -> tuple[int, str, int]:
            digest = hashlib.sha256()
            received = 0
            async with session.get(url + f"/download/{size}") as resp:
                async for chunk in resp.content.iter_chunked(256 * 1024):
                    received += len(chunk)
                    digest.update(chunk)
                    await asyncio.sleep(0)  # a reader a little slower than the proxy
                return resp.status, digest.hexdigest(), received

        assert (await download(8 * MIB))[0] == 200
        baseline = rss_bytes(proc.pid)
        (status, digest, received), peak = await peak_rss_during(proc.pid, download(total))
    assert (status, received) == (200, total)
    assert digest == expected_sha256(total)
    growth = peak - baseline
    assert growth < 30 * MIB, f"proxy RSS grew by {growth / MIB:.1f} MiB while streaming"


async def test_sigterm_lets_in_flight_requests_finish_then_exits_0(
    tmp_path: Path, upstream: Upstream, redis_url: str, redis_client: redis.Redis, running: list[ProxyProcess],
) -> None:
    data = proxy_config([upstream.url], redis_url=redis_url, rules=[{"name": "api", "limit": "5/10s"}],
                        routes=[], shutdown_timeout=10)
    proc, url, admin = await launch(running, tmp_path / "proxy.toml", data)
    async with aiohttp.ClientSession() as session:
        async with session.get(admin + "/readyz") as resp:
            assert resp.status == 200
        in_flight = asyncio.ensure_future(session.get(url + "/slow"))
        await asyncio.wait_for(upstream.entered.wait(), 10)
        proc.proc.send_signal(signal.SIGTERM)
        await proc.wait_for_log("stopping")

        async def refused() -> bool:
            try:
                _, writer = await asyncio.open_connection(*url.removeprefix("http://").rsplit(":", 1))
            except OSError:
                return True
            writer.close()
            return False

        await eventually(refused, timeout=10, what="the listener to close")
        assert not in_flight.done()
        upstream.release.set()
        resp = await asyncio.wait_for(in_flight, 10)
        assert resp.status == 200
        assert await resp.text() == "finally"
        resp.release()
    assert await proc.wait() == 0
    assert "stopped" in proc.log


async def test_sigterm_cuts_requests_that_outlive_the_shutdown_timeout(
    tmp_path: Path, upstream: Upstream, redis_url: str, redis_client: redis.Redis, running: list[ProxyProcess],
) -> None:
    data = proxy_config([upstream.url], redis_url=redis_url, rules=[{"name": "api", "limit": "5/10s"}],
                        routes=[], shutdown_timeout=1)
    proc, url, _ = await launch(running, tmp_path / "proxy.toml", data)
    async with aiohttp.ClientSession() as session:
        in_flight = asyncio.ensure_future(session.get(url + "/hang"))
        await eventually(lambda: any(s.target == "/hang" for s in upstream.seen), what="the request upstream")
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0, "exits although /hang never answers: the shutdown timeout cut it"
        assert "stopped" in proc.log

        async def read() -> bytes:
            resp = await asyncio.wait_for(in_flight, 10)
            return await resp.read()

        with pytest.raises(aiohttp.ClientError):
            await read()


async def test_sighup_reloads_valid_files_and_keeps_the_running_config_on_bad_ones(
    tmp_path: Path, upstream: Upstream, redis_url: str, redis_client: redis.Redis, running: list[ProxyProcess],
) -> None:
    path = tmp_path / "proxy.toml"
    data = proxy_config([upstream.url], redis_url=redis_url, rules=[{"name": "api", "limit": "5/10s"}],
                        routes=[{"path": "/api/*", "limits": [{"rule": "api"}]}])
    proc, url, admin = await launch(running, path, data)

    async def policy(session: aiohttp.ClientSession, target: str) -> str | None:
        async with session.get(url + target) as resp:
            assert resp.status == 200
            return resp.headers.get("RateLimit-Policy")

    async with aiohttp.ClientSession() as session:
        assert await policy(session, "/api/a") == '"api";q=5;w=10'
        assert await policy(session, "/other") is None

        data["rule"] = [{"name": "api", "limit": "7/10s"}, {"name": "new", "limit": "3/1m"}]
        data["route"].append({"path": "/other", "limits": [{"rule": "new", "key": "const:all"}]})
        path.write_text(dump_toml(data))
        mark = len(proc.lines)
        proc.proc.send_signal(signal.SIGHUP)
        line = await proc.wait_for_log("reloaded", after=mark)
        assert "+new ~api 2 routes" in line.string
        assert await policy(session, "/api/a") == '"api";q=7;w=10'
        assert await policy(session, "/other") == '"new";q=3;w=60'

        bad_files = {
            "[proxy\nnot toml": "invalid TOML",
            dump_toml(data).replace("[proxy]", "[proxy]\nlisten_port = 1"): "unknown key 'proxy.listen_port'",
            dump_toml({**data, "rule": [{"name": "api", "limit": "7/20s"}, {"name": "new", "limit": "3/1m"}]}):
                "rule 'api' has window 20s",
        }
        for text, why in bad_files.items():
            path.write_text(text)
            mark = len(proc.lines)
            proc.proc.send_signal(signal.SIGHUP)
            line = await proc.wait_for_log("reload of .* refused", after=mark)
            assert why in line.string
            assert str(path) in line.string or "window" in why
            assert await policy(session, "/api/a") == '"api";q=7;w=10', "the running config stays"
        async with session.get(admin + "/metrics") as resp:
            text = await resp.text()
        assert 'geolimit_proxy_reloads_total{result="ok"} 1.0' in text
        assert 'geolimit_proxy_reloads_total{result="refused"} 3.0' in text
    proc.proc.send_signal(signal.SIGTERM)
    assert await proc.wait() == 0


async def test_bad_config_files_exit_1_naming_the_key_and_the_file(tmp_path: Path) -> None:
    missing = await cli("proxy", "--config", str(tmp_path / "nope.toml"))
    assert missing.code == 1
    assert "nope.toml" in missing.stderr
    path = tmp_path / "proxy.toml"
    path.write_text(dump_toml(proxy_config(["http://127.0.0.1:9"], redis_url="redis://127.0.0.1:9/0",
                                           rules=[{"name": "api", "limit": "5/10s"}],
                                           routes=[{"path": "/x", "limits": [{"rule": "api", "cots": 1}]}])))
    bad = await cli("proxy", "--config", str(path))
    assert bad.code == 1
    assert str(path) in bad.stderr
    assert "unknown key 'route[0].limits[0].cots'" in bad.stderr
