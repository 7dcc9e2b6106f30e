"""A path with an encoded newline (``%0A``) is limited like any other under a trailing-``*`` route.

The route's ``*`` compiled to ``.*``, which does not match a newline: ``/limited/a%0Ab`` matched
no route and went through unlimited, on the fast path and on aiohttp's alike (a tester's find).
Real upstream, real Redis, both request paths.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.proxy.helpers import StartProxy, Upstream, proxy_config


@pytest.mark.parametrize("fast_path", [True, False])
async def test_an_encoded_newline_in_the_path_does_not_skip_the_limit(
    upstream: Upstream, redis_url: str, start_proxy: StartProxy, fast_path: bool,
) -> None:
    proxy = await start_proxy(proxy_config([upstream.url], redis_url=redis_url, rules=[{"name": "api", "limit": "2/10s"}],
                                           routes=[{"path": "/limited/*", "limits": [{"rule": "api", "key": "ip"}]}],
                                           key_prefix=f"nl{int(fast_path)}", fast_path=fast_path))
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    statuses = []
    for _ in range(4):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /limited/a%0Ab HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        statuses.append(int(head.split(b" ", 2)[1]))
    assert statuses[2:] == [429, 429], statuses
