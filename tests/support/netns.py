"""Network namespaces as hosts: a full mesh of veth links, partitions by link state.

``Mesh(["a", "b", "c"]).create()`` makes one namespace per host (``glXXXX-a`` ...,
with a random tag), lo up, and one veth pair per pair of hosts, each pair on a
subnet of its own (``10.213.K.0/24``, K = 1, 2, ... in pair order; the host named
first gets ``.1``, the other ``.2``). :meth:`Mesh.down` sets one end of a pair down,
which takes the other end's carrier away: nothing crosses in either direction, and
:meth:`Mesh.up` brings it back. Processes run in a host with :meth:`Mesh.popen`
(``ip netns exec``); :class:`Probe` is a long-lived stdlib-only helper process in a
host for HTTP and TCP calls, since the test process itself sits in the root namespace.

Everything is removed by :meth:`Mesh.close` (also registered with :mod:`atexit`):
processes started in the namespaces are killed (and anything else still running in
them, per ``ip netns pids``), then the namespaces are deleted, which deletes their
veth ends. Children also get ``PR_SET_PDEATHSIG`` so they die with this process,
and SIGTERM (when unhandled) is turned into ``KeyboardInterrupt`` so the cleanup runs then too.
Only SIGKILL of the test process leaves (empty) namespaces: ``ip netns list | grep '^gl'``.

Needs root and iproute2; otherwise :class:`NetnsUnavailable` says why.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from geolimit.store.embedded import lifetime

__all__ = ["Link", "Mesh", "NetnsUnavailable", "Probe", "Reply", "clean_env"]

_LIVE: set[Mesh] = set()
_SUBNET = "10.213"
_PR_SET_PDEATHSIG = 1


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be used here (not root, no ``ip``, or the kernel refuses)."""


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without proxy settings (a namespace cannot reach a proxy)."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    return env | dict(extra or {})


def _pdeathsig() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return preexec


@dataclass(frozen=True)
class Link:
    """One veth pair: ``left_dev`` (address ``left_addr``) lives in host ``left``."""

    left: str
    right: str
    left_dev: str
    right_dev: str
    left_addr: str
    right_addr: str
    prefix: int = 24


class Mesh:
    """N hosts (network namespaces), fully meshed by veth pairs. See the module docstring."""

    def __init__(self, names: Sequence[str], *, tag: str | None = None) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be distinct and non-empty, got {list(names)!r}")
        self.tag = tag or "gl" + secrets.token_hex(2)
        for name in names:
            if not name.isalnum() or len(self.tag) + len(name) > 15:
                raise ValueError(f"host name {name!r}: alphanumeric, at most {15 - len(self.tag)} characters")
        self.names = list(names)
        self.links: dict[frozenset[str], Link] = {}
        for k, (left, right) in enumerate(itertools.combinations(self.names, 2), start=1):
            if k > 254:
                raise ValueError("too many hosts for one /24 per pair under 10.213.0.0/16")
            self.links[frozenset((left, right))] = Link(
                left, right, self.tag + right, self.tag + left, f"{_SUBNET}.{k}.1", f"{_SUBNET}.{k}.2"
            )
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._ip = shutil.which("ip") or ""

    # -- names and addresses ---------------------------------------------------

    def ns(self, host: str) -> str:
        """The namespace name of ``host``."""
        if host not in self.names:
            raise KeyError(f"unknown host {host!r}; hosts: {self.names}")
        return f"{self.tag}-{host}"

    def link(self, a: str, b: str) -> Link:
        try:
            return self.links[frozenset((a, b))]
        except KeyError:
            raise KeyError(f"no link between {a!r} and {b!r}") from None

    def address(self, host: str, towards: str) -> str:
        """``host``'s address on its link to ``towards`` (what ``towards`` dials to reach ``host``)."""
        link = self.link(host, towards)
        return link.left_addr if link.left == host else link.right_addr

    def device(self, host: str, towards: str) -> str:
        link = self.link(host, towards)
        return link.left_dev if link.left == host else link.right_dev

    # -- life cycle ------------------------------------------------------------

    def create(self) -> Mesh:
        """Make the namespaces and links; raises :class:`NetnsUnavailable` with the reason."""
        if os.name != "posix" or not sys.platform.startswith("linux"):
            raise NetnsUnavailable(f"network namespaces need Linux (this is {sys.platform})")
        if os.geteuid() != 0:
            raise NetnsUnavailable(
                f"network namespaces need root (running as uid {os.geteuid()})"
            )
        if not self._ip:
            raise NetnsUnavailable("the `ip` command (iproute2) is not on PATH: apt-get install iproute2")
        _LIVE.add(self)
        _exit_on_sigterm()
        try:
            for host in self.names:
                self._ip_run("netns", "add", self.ns(host), what=f"`ip netns add {self.ns(host)}`")
                self._created.append(self.ns(host))
                self._ip_run("-n", self.ns(host), "link", "set", "dev", "lo", "up")
            for link in self.links.values():
                self._ip_run(
                    "link", "add", "name", link.left_dev, "netns", self.ns(link.left), "type", "veth",
                    "peer", "name", link.right_dev, "netns", self.ns(link.right),
                    what=f"creating the veth pair {link.left}<->{link.right}",
                )
                for host, dev, addr in ((link.left, link.left_dev, link.left_addr),
                                        (link.right, link.right_dev, link.right_addr)):
                    self._ip_run("-n", self.ns(host), "addr", "add", f"{addr}/{link.prefix}", "dev", dev)
                    self._ip_run("-n", self.ns(host), "link", "set", "dev", dev, "up")
            for link in self.links.values():
                self._await_state(link, up=True)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill every process in the namespaces, delete the namespaces. Idempotent, never raises."""
        procs, self._procs = self._procs, []
        for proc in procs:
            _kill(proc)
        created, self._created = self._created, []
        for ns in created:
            self._kill_remaining(ns)
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run([self._ip, "netns", "del", ns], capture_output=True, timeout=10, check=False)
        _LIVE.discard(self)

    def __enter__(self) -> Mesh:
        return self.create()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- partitions ------------------------------------------------------------

    def down(self, a: str, b: str) -> None:
        """Cut the a-b link: ``a``'s end goes down, ``b``'s end loses its carrier (checked)."""
        self._ip_run("-n", self.ns(a), "link", "set", "dev", self.device(a, b), "down")
        self._await_state(self.link(a, b), up=False)

    def up(self, a: str, b: str) -> None:
        """Heal the a-b link: both ends up, with carrier (checked)."""
        for host, other in ((a, b), (b, a)):
            self._ip_run("-n", self.ns(host), "link", "set", "dev", self.device(host, other), "up")
        self._await_state(self.link(a, b), up=True)

    def heal_all(self) -> None:
        for link in self.links.values():
            self.up(link.left, link.right)

    def is_up(self, a: str, b: str) -> bool:
        link = self.link(a, b)
        return all(self._oper_up(h, d) for h, d in ((link.left, link.left_dev), (link.right, link.right_dev)))

    def _oper_up(self, host: str, dev: str) -> bool:
        out = self._ip_run("-n", self.ns(host), "-o", "link", "show", "dev", dev)
        return "state UP" in out and "NO-CARRIER" not in out

    def _await_state(self, link: Link, *, up: bool, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        ends = ((link.left, link.left_dev), (link.right, link.right_dev))
        while True:
            states = [self._oper_up(h, d) for h, d in ends]
            if (all(states) if up else not any(states)):
                return
            if time.monotonic() > deadline:
                shown = [self._ip_run("-n", self.ns(h), "-o", "link", "show", "dev", d) for h, d in ends]
                raise NetnsUnavailable(
                    f"link {link.left}<->{link.right} did not go {'up' if up else 'down'} on both ends "
                    f"within {timeout}s:\n" + "\n".join(shown)
                )
            time.sleep(0.01)

    # -- processes -------------------------------------------------------------

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``host`` (``ip netns exec``; the Popen pid is the command's own).

        The process gets its own process group, no proxy variables, and is killed by
        :meth:`close`. Keyword arguments go to :class:`subprocess.Popen`.
        """
        if self.ns(host) not in self._created:
            raise NetnsUnavailable(f"host {host!r} does not exist (create() not called, or closed)")
        kwargs.setdefault("env", clean_env())
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc: subprocess.Popen[bytes] = subprocess.Popen(
            [self._ip, "netns", "exec", self.ns(host), *argv],
            start_new_session=True, preexec_fn=_pdeathsig(), **kwargs,
        )
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], *, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``host`` to completion (killed after ``timeout``); output as text."""
        proc = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise AssertionError(f"{argv} in {host} did not finish within {timeout}s") from None
        finally:
            with contextlib.suppress(ValueError):
                self._procs.remove(proc)
        return subprocess.CompletedProcess(argv, proc.returncode, out.decode(), err.decode())

    def _kill_remaining(self, ns: str) -> None:
        """SIGKILL whatever still runs in our namespace ``ns`` (children of our children)."""
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([self._ip, "netns", "pids", ns], capture_output=True, text=True,
                                 timeout=10, check=False).stdout
            for pid in (int(p) for p in out.split() if p.isdigit()):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def _ip_run(self, *args: str, what: str | None = None) -> str:
        try:
            done = subprocess.run([self._ip, *args], capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            raise NetnsUnavailable(f"{what or 'ip ' + ' '.join(args)} failed: {exc}") from exc
        if done.returncode != 0:
            raise NetnsUnavailable(
                f"{what or '`ip ' + ' '.join(args) + '`'} failed (exit {done.returncode}): "
                f"{done.stderr.strip() or done.stdout.strip()}"
            )
        return done.stdout


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


@atexit.register
def _close_all() -> None:
    for mesh in list(_LIVE):
        mesh.close()


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # pytest stops, runs finalizers; then atexit


def _exit_on_sigterm() -> None:
    """Make SIGTERM act as Ctrl-C (finalizers, atexit) instead of leaving namespaces behind.

    Only when nobody else handles SIGTERM (EmbeddedRedis's stop-then-die handler is replaced:
    finalizers and atexit stop its servers too) and we are in the main thread.
    """
    with contextlib.suppress(ValueError):  # not the main thread
        if lifetime.unclaimed(signal.SIGTERM):
            signal.signal(signal.SIGTERM, _on_sigterm)


# -- a client inside a namespace ----------------------------------------------

_PROBE = r"""
import json, socket, sys, urllib.error, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
for line in sys.stdin:
    req = json.loads(line)
    try:
        if req["op"] == "http":
            data = None if req["body"] is None else json.dumps(req["body"]).encode()
            r = urllib.request.Request(req["url"], data=data, method=req["method"],
                                       headers={"Content-Type": "application/json"})
            try:
                with opener.open(r, timeout=req["timeout"]) as resp:
                    status, raw = resp.status, resp.read()
            except urllib.error.HTTPError as e:
                status, raw = e.code, e.read()
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode("utf-8", "replace")
            out = {"status": status, "body": body}
        else:
            with socket.create_connection((req["host"], req["port"]), timeout=req["timeout"]) as s:
                s.sendall(req["send"].encode())
                got = s.recv(4096).decode("latin-1") if req["send"] else ""
            out = {"status": 0, "body": got}
    except Exception as e:
        out = {"error": type(e).__name__ + ": " + str(e)}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
"""


@dataclass(frozen=True)
class Reply:
    """A :class:`Probe` answer: HTTP status (0 for TCP) and body, or the error that prevented one."""

    status: int | None  # None: no answer (see error)
    body: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Connected and answered (whatever the HTTP status)."""
        return self.error is None


class Probe:
    """A Python process inside one host, answering HTTP and TCP requests made from outside."""

    def __init__(self, mesh: Mesh, host: str) -> None:
        self.host = host
        self._proc = mesh.popen(host, [sys.executable, "-I", "-u", "-c", _PROBE],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def http(self, method: str, url: str, body: object = None, *, timeout: float = 2.0) -> Reply:
        return self._ask({"op": "http", "method": method, "url": url, "body": body, "timeout": timeout}, timeout)

    def tcp(self, host: str, port: int, send: str = "", *, timeout: float = 1.0) -> Reply:
        """Connect (and send, then read one answer); ``ok`` means the connection worked."""
        return self._ask({"op": "tcp", "host": host, "port": port, "send": send, "timeout": timeout}, timeout)

    def _ask(self, request: dict[str, Any], timeout: float) -> Reply:
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None
        assert stdout is not None
        try:
            stdin.write(json.dumps(request).encode() + b"\n")
            stdin.flush()
        except OSError as exc:
            raise AssertionError(f"the probe in {self.host} is gone (exit {self._proc.poll()}): {exc}") from None
        line = _readline(stdout, timeout + 5.0)
        if not line:
            raise AssertionError(f"the probe in {self.host} did not answer (exit {self._proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            return Reply(None, None, reply["error"])
        return Reply(reply["status"], reply["body"])


def _readline(stream: IO[bytes], timeout: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else b""
