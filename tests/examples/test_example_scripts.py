"""Every example under examples/ runs as documented: a subprocess, a real Redis, real requests."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import redis
import websockets.sync.client

from tests.middleware.servers import (
    check_allowed,
    check_denied,
    free_port,
    sf_list,
    wait_until_ready,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@contextmanager
def serving(script: str, tmp_path: Path, *args: str) -> Iterator[httpx.Client]:
    """Run ``examples/<script>`` on a free port; stop it with SIGTERM, which must shut it down cleanly."""
    port = free_port()
    log = tmp_path / f"{script}.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, str(EXAMPLES / script), "--port", str(port), *args],
            stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(process, url + "/health", log.read_text)
        with httpx.Client(base_url=url, trust_env=False, timeout=10) as client:
            yield client
    finally:
        process.terminate()
        try:
            code = process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    output = log.read_text()
    # uvicorn re-raises the SIGTERM once its graceful shutdown (lifespan included) is complete.
    graceful_uvicorn = code == -signal.SIGTERM and "Application shutdown complete." in output
    assert code == 0 or graceful_uvicorn, output


def denied_after_three(http: httpx.Client, path: str, **headers: str) -> httpx.Response:
    for remaining in (2, 1, 0):
        response = http.get(path, headers=headers)
        assert response.status_code == 200, response.text
        check_allowed(response.headers, "api", 3, 10, remaining)
    denied = http.get(path, headers=headers)
    check_denied(denied.status_code, denied.headers, denied.json(), "api", 3, 10, path)
    return denied


def test_fastapi_app(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    with serving("fastapi_app.py", tmp_path, "--redis-url", redis_url, "--trusted-proxy", "127.0.0.1") as http:
        denied_after_three(http, "/api/hello")
        forwarded = http.get("/api/hello", headers={"X-Forwarded-For": "203.0.113.8"})
        assert forwarded.json() == {"hello": "world", "remaining": 2}, "a trusted proxy's client has its own bucket"
        assert [http.get("/partner/data", headers={"X-API-Key": "p1"}).status_code for _ in range(6)] == [200] * 5 + [429]
        assert http.get("/partner/data", headers={"X-API-Key": "p2"}).status_code == 200
        assert "RateLimit" not in http.get("/health").headers


def test_starlette_app(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    with serving("starlette_app.py", tmp_path, "--redis-url", redis_url) as http:
        denied = denied_after_three(http, "/api/hello")
        assert denied.headers["X-RateLimit-Remaining"] == "0"
        ws_url = str(http.base_url).replace("http://", "ws://").rstrip("/") + "/ws"
        with websockets.sync.client.connect(ws_url, open_timeout=5) as ws:
            for text in ("a", "b"):
                ws.send(text)
                assert ws.recv(timeout=5) == text


def test_aiohttp_app(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    with serving("aiohttp_app.py", tmp_path, "--redis-url", redis_url) as http:
        stream = http.get("/api/stream")
        assert stream.text == "chunk 0\nchunk 1\nchunk 2\n"
        check_allowed(stream.headers, "api", 3, 10, 2)
        http.get("/api/hello")
        http.get("/api/hello")
        denied = http.get("/api/hello")
        check_denied(denied.status_code, denied.headers, denied.json(), "api", 3, 10, "/api/hello")
        body = b"x" * 700_000
        first = http.post("/upload", content=body, headers={"X-API-Key": "k"})
        assert first.json() == {"received": 700_000}
        [(rule, params)] = sf_list(first.headers["RateLimit"])
        assert (rule, params["r"]) == ("upload-bytes", (1 << 20) - 700_000), "cost = Content-Length"
        assert http.post("/upload", content=body, headers={"X-API-Key": "k"}).status_code == 429


def test_decorated_script(redis_url: str, redis_client: redis.Redis) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "decorated.py"), "--redis-url", redis_url],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[:3] == [f"sync call {i}: profile of ada" for i in (1, 2, 3)]
    assert lines[3].startswith("sync call 4: denied, retry in")
    assert lines[4:] == [
        "another user: profile of bob",
        "spent 60 tokens, 40 left",
        "60 more tokens: denied by tokens",
        "async calls: ['report sent', 'report sent', 'report sent', None]",
        "async spent 30 tokens, 70 left",
    ]


def test_examples_start_their_own_redis_without_a_url(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "decorated.py")], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    assert "async spent 30 tokens, 70 left" in run.stdout
    with serving("fastapi_app.py", tmp_path) as http:
        assert [http.get("/api/hello").status_code for _ in range(4)] == [200, 200, 200, 429]
