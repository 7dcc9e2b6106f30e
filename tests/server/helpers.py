"""Helpers for the agent server tests: TOML files, certificates, HTTP calls, processes."""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from geolimit.server.agent import Agent
from tests.support.cli_process import CliProcess

JSON = dict[str, Any]


# -- TOML ---------------------------------------------------------------------


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, Sequence):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _table(lines: list[str], name: str, table: Mapping[str, Any], header: str) -> None:
    lines.append(header)
    subtables = {k: v for k, v in table.items() if isinstance(v, Mapping)}
    lines.extend(f"{k} = {_value(v)}" for k, v in table.items() if k not in subtables)
    for key, sub in subtables.items():
        _table(lines, f"{name}.{key}", sub, f"[{name}.{key}]")


def dump_toml(data: Mapping[str, Any]) -> str:
    """TOML text for ``data``: scalars, lists, inline tables in lists, [tables], [[rule]]."""

    def is_array_of_tables(value: object) -> bool:
        return isinstance(value, list) and bool(value) and all(isinstance(v, Mapping) for v in value)

    tables = {k: v for k, v in data.items() if isinstance(v, Mapping) or is_array_of_tables(v)}
    lines = [f"{k} = {_value(v)}" for k, v in data.items() if k not in tables]
    for key, value in tables.items():
        if isinstance(value, Mapping):
            _table(lines, key, value, f"[{key}]")
        else:
            for item in value:
                _table(lines, key, item, f"[[{key}]]")
    return "\n".join(lines) + "\n"


def write_secret(path: Path, secret: bytes | None = None) -> bytes:
    secret = secret or secrets.token_hex(32).encode()
    path.write_bytes(secret + b"\n")
    return secret


def region_config(
    redis_url: str,
    *,
    name: str = "a",
    listen: str = "127.0.0.1:0",
    secret_file: str = "gossip.key",
    peers: Sequence[Mapping[str, str]] = (),
    rules: Sequence[Mapping[str, Any]] = ({"name": "api", "limit": "2/10s", "resolution": 1},),
    interval: float | str = 0.05,
) -> dict[str, Any]:
    """A valid config as a dict (mutate it, then ``dump_toml``)."""
    return {
        "region": {"name": name, "redis_url": redis_url, "listen": listen, "secret_file": secret_file},
        "gossip": {"interval": interval, "peers": [dict(p) for p in peers]},
        "rule": [dict(r) for r in rules],
    }


# -- TLS ------------------------------------------------------------------------


@dataclass(frozen=True)
class Cert:
    cert: Path
    key: Path

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cert))


def make_cert(directory: Path) -> Cert:
    """A self-signed certificate for IP 127.0.0.1, made with the ``openssl`` command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the TLS tests need the `openssl` command: install it (apt-get install openssl)", pytrace=False)
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    return Cert(cert, key)


# -- HTTP -----------------------------------------------------------------------


async def call(
    session: aiohttp.ClientSession, method: str, url: str, body: object = None, **kwargs: Any
) -> tuple[int, Any]:
    """``(status, parsed JSON body)``; ``body`` bytes are sent as is, anything else as JSON."""
    if isinstance(body, (bytes, bytearray)):
        kwargs["data"] = bytes(body)
    elif body is not None:
        kwargs["json"] = body
    async with session.request(method, url, **kwargs) as resp:
        text = await resp.text()
        assert resp.content_type == "application/json", (resp.status, resp.content_type, text[:300])
        return resp.status, json.loads(text)


async def check(session: aiohttp.ClientSession, agent: Agent, body: object, path: str = "/v1/check",
                **kwargs: Any) -> tuple[int, Any]:
    return await call(session, "POST", agent.api_url + path, body, **kwargs)


# -- processes ------------------------------------------------------------------


class AgentProcess(CliProcess):
    """``python -m geolimit.cli agent --config ...`` with its stderr collected line by line."""

    command = "agent"

    async def url(self, timeout: float = 20.0) -> str:
        """The agent's URL, from its 'listening on' log line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(r"listening on (https?://[0-9.]+:\d+)", self.log)
            if found:
                return found.group(1)
            if self.proc.returncode is not None:
                break
            await asyncio.sleep(0.02)
        raise AssertionError(f"the agent did not report its URL; exit code {self.proc.returncode}; log:\n{self.log}")


@dataclass(frozen=True)
class Ran:
    code: int
    stdout: str
    stderr: str


async def cli(*args: str, timeout: float = 30.0) -> Ran:
    """Run ``python -m geolimit.cli ARGS`` to completion."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "geolimit.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except (TimeoutError, asyncio.TimeoutError):
        proc.kill()
        await proc.wait()
        raise AssertionError(f"geolimit {' '.join(args)} did not finish within {timeout}s") from None
    assert proc.returncode is not None
    return Ran(proc.returncode, out.decode(), err.decode())
