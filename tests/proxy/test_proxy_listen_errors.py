"""A single proxy process whose port another process holds names the setting and the address.

Once it said only `proxy failed to start: proxy: cannot listen: [Errno 98] Address already in use`,
leaving the operator to guess which of `listen` and `admin_listen` it was (the supervisor of several
workers already named it).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis

from tests.proxy.helpers import dump_toml, proxy_config
from tests.support.cli_usage import run_cli


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("held", ["proxy.listen", "proxy.admin_listen"])
def test_a_port_held_by_another_process_is_named(tmp_path: Path, redis_url: str, redis_client: redis.Redis,
                                                 held: str) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = int(squatter.getsockname()[1])
        data = proxy_config(["http://127.0.0.1:9"], redis_url=redis_url, rules=[{"name": "api", "limit": "5/10s"}],
                            routes=[{"path": "/x", "limits": [{"rule": "api"}]}],
                            listen=f"127.0.0.1:{_free_port()}", admin_listen=f"127.0.0.1:{_free_port()}")
        data["proxy"][held.partition(".")[2]] = f"127.0.0.1:{port}"
        (tmp_path / "proxy.toml").write_text(dump_toml(data))
        ran = run_cli("proxy", "--config", str(tmp_path / "proxy.toml"))
    assert (ran.returncode, ran.stdout) == (1, ""), ran
    assert ran.stderr.endswith(f"geolimit: error: proxy failed to start: proxy: cannot listen on {held} "
                               f"127.0.0.1:{port}: [Errno 98] Address already in use\n"), ran.stderr
