"""Anti-entropy: the SCAN of one store in bounded Lua pages (``ae_scan.lua``), node by node.

:class:`_Scanner` walks every node's keys, in parallel streams on a large
keyspace and paced to a share of Redis's time, and digests the keys too big for
one page (``ae_key.lua``); the passes of :class:`~.local._Local` are built on it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from geolimit.core.keys import KeyLayout
from geolimit.core.rule import Rule
from geolimit.errors import GeolimitError, StorageError
from geolimit.replication.antientropy.common import (
    BIG_FIELDS,
    MAX_VALUE,
    P1,
    P2,
    PAGE_FIELDS,
    STREAM_MIN_KEYS,
    _Plan,
    _script,
    key_digest,
    slot_code,
)
from geolimit.store.async_store import AsyncStore
from geolimit.store.scripts import LuaScript


@dataclass(slots=True)
class _Progress:
    visited: int = 0


class _Pacer:
    """Keeps the time a node spends running our scripts at most ``duty`` of the wall time."""

    def __init__(self, duty: float) -> None:
        self.duty = duty
        self.start = time.monotonic()
        self.busy = 0.0

    def spent(self, seconds: float) -> None:
        self.busy += seconds

    def _ahead(self) -> float:
        return self.busy / self.duty - (time.monotonic() - self.start)

    def ready(self) -> bool:
        return self.duty >= 1.0 or self._ahead() <= 0

    async def wait(self) -> None:
        if self.duty < 1.0:
            ahead = self._ahead()
            if ahead > 0:
                await asyncio.sleep(ahead)


class _Scanner:
    """One store's SCAN in Lua pages, awaited one by one (what :class:`~.local._Local`'s passes run on)."""

    def __init__(
        self, store: AsyncStore, layout: KeyLayout, page_keys: int, streams: int = 1, duty: float = 1.0,
        page_us: int = 1000,
    ) -> None:
        self.store = store
        self.layout = layout
        self.page_keys = page_keys
        self.page_us = page_us
        self.streams = streams
        self.duty = duty
        self.pattern = layout.data_pattern()
        self.plen = b"%d" % len(layout.prefix.encode())

    async def _groups(self) -> list[tuple[int, list[int]]]:
        """``(routing shard, shards)`` per node: a cluster is scanned node by node."""
        shards = list(range(self.layout.shards))
        if not self.store.clustered:
            return [(0, shards)]
        client: Any = self.store.client()
        try:
            await client.initialize()
            by_node: dict[str, list[int]] = {}
            for s in shards:
                node = client.get_node_from_key(self.layout.registry_key(s))
                by_node.setdefault(node.name, []).append(s)
        except GeolimitError:
            raise
        except Exception as exc:
            raise StorageError(f"cannot map shards to cluster nodes: {exc}") from exc
        return [(group[0], group) for group in by_node.values()]

    async def _codes(self, shards: Sequence[int]) -> dict[int, list[bytes]]:
        """Per shard, its registry as ``ae_common.lua``'s codes arguments."""
        registries = await self.store.read([self.layout.registry_key(s) for s in shards])
        out: dict[int, list[bytes]] = {}
        for shard, registry in zip(shards, registries, strict=True):
            args: list[bytes] = []
            seen: set[int] = set()
            for name, raw in registry.items():
                if b"/" not in name:
                    continue
                try:
                    index = int(raw)
                except ValueError:
                    continue
                if index in seen or not 0 <= index < MAX_VALUE:
                    continue
                seen.add(index)
                c1, c2 = slot_code(name)
                args += (b"%d" % index, b"%d" % c1, b"%d" % c2)
            out[shard] = [b"%d" % (len(args) // 3), *args]
        return out

    def _pager(self, script: LuaScript, args: list[bytes]) -> Callable[[bytes], Awaitable[Any]]:
        """Calls of ``script`` with ``args`` plus one last argument (the cursor).

        The constant arguments (registries, a leaf bitmap) are RESP-encoded once
        where the store takes pre-encoded calls.
        """
        run_resp = getattr(self.store, "run_resp", None)
        if run_resp is None:
            return lambda cursor: self._run(script, [*args, cursor])
        packed = b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)
        nargs = len(args) + 1

        async def page(cursor: bytes) -> Any:
            return await run_resp(script, nargs, packed + b"$%d\r\n%b\r\n" % (len(cursor), cursor))

        return page

    async def _run(self, script: LuaScript, args: list[bytes]) -> Any:
        reply = await self.store.run(script, args)
        if isinstance(reply, Exception):  # pragma: no cover - stores raise
            raise StorageError(str(reply))
        return reply

    async def scan(
        self,
        plan: _Plan,
        mode: bytes,
        bitmap: bytes | None,
        on_entry: Callable[[list[Any]], None],
        on_big: Callable[[int, bytes, int, int, int], None],
        progress: _Progress,
        after: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """One pass over every node: ``mode`` b"s" (shard digests), b"d" (digests; ``bitmap``:
        of the shards, None for all) or b"l" (the listing of the leaves in ``bitmap``).

        Nodes are scanned concurrently, and a large keyspace in ``streams``
        parts, each with one call in flight: Redis works on one part while we
        read the reply of another.
        """
        jobs: list[Coroutine[Any, Any, None]] = []
        try:
            await self._plan_scans(plan, mode, bitmap, on_entry, on_big, progress, after, jobs)
        except BaseException:
            for job in jobs:  # never started: closed, or Python warns each was never awaited
                job.close()
            raise
        await _all(jobs)

    async def _plan_scans(
        self, plan: _Plan, mode: bytes, bitmap: bytes | None, on_entry: Callable[[list[Any]], None],
        on_big: Callable[[int, bytes, int, int, int], None], progress: _Progress,
        after: Callable[[], Awaitable[None]] | None, jobs: list[Coroutine[Any, Any, None]],
    ) -> None:
        """Append to ``jobs`` the scans of :meth:`scan`, node by node (reading each node's registries)."""
        for rep, shards in await self._groups():
            codes = await self._codes(shards)
            # The registries, as the usual one and the shards whose registry differs.
            usual = Counter(tuple(c) for c in codes.values()).most_common(1)[0][0]
            other = [s for s in shards if tuple(codes[s]) != usual]
            reg_args: list[bytes] = [*usual, b"%d" % len(other)]
            for s in other:
                reg_args += (b"%d" % s, *codes[s])
            args = [
                b"1", self.layout.registry_key(rep), mode, b"%d" % plan.now_us, self.pattern, self.plen,
                b"%d" % plan.leaves, b"%d" % plan.shards, b"%d" % self.page_keys, b"%d" % PAGE_FIELDS,
                b"%d" % BIG_FIELDS, bitmap or b"", b"%d" % self.page_us, *plan.rule_args, *reg_args,
            ]
            parts = 1
            if self.streams > 1 and not self.store.clustered and await self._dbsize() >= STREAM_MIN_KEYS:
                parts = self.streams
            pacer = _Pacer(self.duty)
            for part in range(parts):
                page = self._pager(_script("ae_scan"), [*args, b"%d" % part, b"%d" % parts])
                jobs.append(self._stream(plan, page, pacer, part, parts, codes, on_entry, on_big, progress, after))

    async def _stream(
        self,
        plan: _Plan,
        page: Callable[[bytes], Awaitable[Any]],
        pacer: _Pacer,
        part: int,
        parts: int,
        codes: dict[int, list[bytes]],
        on_entry: Callable[[list[Any]], None],
        on_big: Callable[[int, bytes, int, int, int], None],
        progress: _Progress,
        after: Callable[[], Awaitable[None]] | None,
    ) -> None:
        """Part ``part`` of ``parts`` (a power of two) of one node's SCAN (see ae_scan.lua).

        The next page is requested as soon as a reply brings its cursor, before
        the reply is processed, so Redis does not wait for Python; ``pacer``
        spaces pages out to keep this node's share of time for anti-entropy.
        """
        cursor = b"%d" % _reverse(part, parts.bit_length() - 1)
        await pacer.wait()
        pending: asyncio.Future[Any] | None = asyncio.ensure_future(page(cursor))
        try:
            while True:
                assert pending is not None
                reply = await pending
                pending = None
                cursor = reply[0]
                pacer.spent(int(reply[4]) / 1e6)
                if cursor != b"0" and pacer.ready():
                    pending = asyncio.ensure_future(page(cursor))
                progress.visited += int(reply[1])
                on_entry(reply)
                big = reply[3]
                for i in range(0, len(big), 2):
                    key, g = big[i], int(big[i + 1])
                    shard, rule, _ = self.layout.parse_data_key(key)
                    digest, cells = await self.key_digest(plan, key, shard, plan.rules[rule], codes[shard])
                    if cells:
                        on_big(g, key, shard, digest, cells)
                if after is not None:
                    await after()
                if cursor == b"0":
                    return
                if pending is None:
                    await pacer.wait()
                    pending = asyncio.ensure_future(page(cursor))
        finally:
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)

    async def _dbsize(self) -> int:
        try:
            return int(await self.store.client().dbsize())
        except RedisError as exc:
            raise StorageError(f"Redis unreachable: {exc}") from exc

    async def key_digest(
        self, plan: _Plan, key: bytes, shard: int, rule: Rule, codes: list[bytes]
    ) -> tuple[int, int]:
        """A big key's ``(digest, cells)``, reading a chunk of ring positions per call."""
        nslots = max(1, int(codes[0]))
        chunk = max(1, BIG_FIELDS // (2 * nslots))
        head = [b"2", self.layout.registry_key(shard), key, b"%d" % plan.now_us,
                b"%d" % rule.resolution_us, b"%d" % rule.buckets, b"%d" % rule.ring, b"%d" % plan.future(rule)]
        s1 = s2 = cells = 0
        for p0 in range(0, rule.ring, chunk):
            p1 = min(rule.ring, p0 + chunk)
            reply = await self._run(_script("ae_key"), [*head, b"%d" % p0, b"%d" % p1, *codes])
            s1, s2, cells = s1 + int(reply[0]), s2 + int(reply[1]), cells + int(reply[2])
        return key_digest(key[len(self.layout.tag(shard)) + 1 :], s1 % P1, s2 % P2), cells


def _reverse(value: int, bits: int) -> int:
    """``value``'s lowest ``bits`` bits in reverse order."""
    out = 0
    for _ in range(bits):
        out = (out << 1) | (value & 1)
        value >>= 1
    return out


async def _all(jobs: Sequence[Awaitable[None]]) -> None:
    """Run ``jobs`` concurrently; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(j) for j in jobs]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
