"""A connection goes back to the fast path's upstream pool reading.

A relay pauses the upstream's reading while the client's buffer is full. When the
body's last bytes arrived in the same read that paused it, the relay ended, the
connection went back to the pool still paused, and the client's resume found no
relay to pass it on: the next request on that connection never read its answer (a
100 MB download test hung for its whole 120 s; with the default upstream timeout, a
504 after 30 s). Real sockets on loopback.
"""

from __future__ import annotations

import asyncio

from geolimit.proxy.fast_upstream import UpstreamPool
from geolimit.proxy.state import Upstream


async def test_a_connection_released_while_paused_reads_again() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = UpstreamPool()
    try:
        up = Upstream(f"http://127.0.0.1:{port}", f"127.0.0.1:{port}")
        conn = await pool.acquire(up, 5.0)
        assert conn.transport is not None
        conn.pause()  # what a relay does when its client stops reading
        assert not conn.transport.is_reading()
        pool.release(conn)
        again = await pool.acquire(up, 5.0)
        assert again is conn
        assert conn.transport.is_reading(), "a pooled connection must read its next answer"
    finally:
        pool.close()
        server.close()
        await server.wait_closed()
