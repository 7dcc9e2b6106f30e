"""The proxy's malformed requests are logged in one line per 10 s, whatever its listeners.

The summary filter (geolimit/http/bad_requests.py) was installed by ``listen()`` only:
a proxy with the fast path (the default) and no ``admin_listen`` (the default) never
called it, so each malformed request the fast path handed to aiohttp was logged as an
ERROR with its traceback: 1000 of them wrote 11,000 lines. Real proxy, real upstream,
raw sockets.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.proxy.helpers import StartProxy, Upstream, proxy_config
from tests.support.malformed import fresh_malformed_filter, send_raw

MALFORMED = [
    b"GET /x HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
    b"GET /x HTTP/9.9\r\nHost: x\r\n\r\n",
    b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
]


@pytest.fixture
def no_filter() -> Iterator[None]:
    with fresh_malformed_filter():
        yield


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "aiohttp_only"])
async def test_malformed_requests_to_a_proxy_without_admin_listener_get_400_and_one_log_line(
    upstream: Upstream, redis_url: str, start_proxy: StartProxy, no_filter: None, caplog: pytest.LogCaptureFixture,
    fast_path: bool,
) -> None:
    config = proxy_config([upstream.url], redis_url=redis_url, rules=[{"name": "r", "limit": "1000/1h"}],
                          key_prefix="badreq", fast_path=fast_path)
    del config["proxy"]["admin_listen"]  # the default: no admin listener
    proxy = await start_proxy(config)
    assert proxy.admin_url is None
    assert (proxy._fast is not None) == fast_path
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    for i in range(60):
        answer = await send_raw(proxy.url, MALFORMED[i % len(MALFORMED)])
        assert answer.split(b" ", 2)[1] == b"400", answer[:100]
    ok = await send_raw(proxy.url, b"GET /fine HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200 "), ok[:100]
    records = [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= logging.WARNING]
    assert len(records) == 1, [f"{r.levelname} {r.getMessage()}" for r in records[:3]]
    assert records[0].levelname == "WARNING"
    assert records[0].exc_info is None
    assert records[0].getMessage().startswith("malformed request answered 400: from 127.0.0.1: ")
    assert not [seen for seen in upstream.seen if seen.target == "/x"]
