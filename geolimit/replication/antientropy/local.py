"""Anti-entropy: this region's side of the passes (bounded Lua pages over one store)."""

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
    MASK,
    MAX_BLOB_CELLS,
    MAX_REPLY_BYTES,
    MAX_VALUE,
    P1,
    P2,
    PAGE_FIELDS,
    PENDING_NUMBERS,
    READ_CALL_KEYS,
    READ_FIELDS,
    SHARDS_FIRST_KEYS,
    STREAM_MIN_KEYS,
    Blob,
    _Digests,
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


class _Listing:
    """``(shard, rule:subject, digest)`` of the keys of some leaves, in scan order (capped)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.entries: list[tuple[int, bytes, int]] = []
        self.truncated = False

    def add(self, shard: int, suffix: bytes, digest: int) -> None:
        if len(self.entries) >= self.cap:
            self.truncated = True
        else:
            self.entries.append((shard, suffix, digest))


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


class _Local:
    """This region's side of the passes: Lua pages over one store, awaited one by one."""

    def __init__(
        self, store: AsyncStore, layout: KeyLayout, page_keys: int, streams: int = 1, duty: float = 1.0,
        page_us: int = 1000, shards_first_keys: int | None = SHARDS_FIRST_KEYS,
    ) -> None:
        self.store = store
        self.layout = layout
        self.page_keys = page_keys
        self.page_us = page_us
        self.streams = streams
        self.duty = duty
        self.shards_first_keys: int | None = shards_first_keys
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

    async def first_digests(self, plan: _Plan, progress: _Progress, keys: int | None = None) -> _Digests:
        """The first digest pass of an exchange: with the leaves below ``shards_first_keys`` keys
        (``keys``: the keyspace's size, if the caller has just read it)."""
        if keys is None and self.shards_first_keys is not None:
            keys = await self._dbsize()
        big = self.shards_first_keys is not None and keys is not None and keys >= self.shards_first_keys
        return await self.digests(plan, progress, leaves=not big)

    async def leaf_digests(self, plan: _Plan, into: _Digests, scope: bytes | None, progress: _Progress) -> None:
        """Add the leaves of the shards in ``scope`` (None: all) to a shards-only first pass."""
        await self.digests(plan, progress, into=into, scope=scope)

    async def digests(
        self, plan: _Plan, progress: _Progress, *, leaves: bool = True, into: _Digests | None = None,
        scope: bytes | None = None,
    ) -> _Digests:
        """A digest pass: shard sums and (``leaves``) leaves; ``into`` a first pass: its leaves only."""
        started = time.monotonic()
        shards = into is None
        out = _Digests(plan.shards, plan.leaves) if into is None else into
        overflow: list[bool] = []

        def on_entry(reply: list[Any]) -> None:
            if shards:
                out.add_shards(reply[5])
            if leaves:
                out.pending.extend(reply[2])
                if len(out.pending) > PENDING_NUMBERS and not overflow:
                    overflow.append(True)

        def on_big(g: int, key: bytes, shard: int, digest: int, cells: int) -> None:
            if shards:
                out.shard_digests[shard] = (out.shard_digests[shard] + digest) & MASK
                out.shard_counts[shard] += 1
                out.keys += 1
            if leaves:
                out.add_leaf(g, digest)

        async def drain() -> None:
            if overflow:
                overflow.clear()
                await out.reduce()

        try:
            await self.scan(plan, b"d" if leaves else b"s", scope, on_entry, on_big, progress, drain)
        except (IndexError, TypeError, ValueError, KeyError, OverflowError) as exc:
            raise StorageError(f"unexpected reply from ae_scan: {exc!r}") from exc
        out.leaves, out.scope = leaves, scope
        out.seconds += time.monotonic() - started
        return out

    async def listing(self, plan: _Plan, bitmap: bytes, listing: _Listing, progress: _Progress) -> None:
        def on_entry(reply: list[Any]) -> None:
            flat = reply[2]
            for i in range(0, len(flat), 3):
                listing.add(int(flat[i]), flat[i + 1], int(flat[i + 2]))

        def on_big(g: int, key: bytes, shard: int, digest: int, cells: int) -> None:
            listing.add(shard, key[len(self.layout.tag(shard)) + 1 :], digest)

        try:
            await self.scan(plan, b"l", bitmap, on_entry, on_big, progress)
        except (IndexError, TypeError, ValueError, KeyError) as exc:
            raise StorageError(f"unexpected reply from ae_scan: {exc!r}") from exc

    async def read(
        self, plan: _Plan, keys: Sequence[tuple[int, bytes]], pos: int, max_bytes: int = MAX_REPLY_BYTES
    ) -> tuple[list[Blob], int, int]:
        """Blobs of the live cells of ``keys`` (the first from ring position ``pos``).

        Returns ``(blobs, done, pos)``: the first ``done`` keys are complete, the
        next one up to ``pos``. Stops after about ``max_bytes`` of blobs.
        """
        blobs: list[Blob] = []
        size = done = 0
        while done < len(keys) and size < max_bytes:
            shard = keys[done][0]
            end = done + 1
            while end < len(keys) and end - done < READ_CALL_KEYS and keys[end][0] == shard:
                end += 1
            tag = self.layout.tag(shard) + b":"
            data_keys: list[bytes] = []
            params: list[bytes] = []
            for _, suffix in keys[done:end]:
                rule = plan.rules[suffix.partition(b":")[0].decode()]
                data_keys.append(tag + suffix)
                params += (b"%d" % rule.resolution_us, b"%d" % rule.buckets, b"%d" % rule.ring,
                           b"%d" % rule.future)
            reply = await self._run(_script("ae_read"), [
                b"%d" % (1 + len(data_keys)), self.layout.registry_key(shard), *data_keys,
                b"%d" % plan.now_us, b"%d" % pos, b"%d" % READ_FIELDS, b"%d" % BIG_FIELDS,
                b"%d" % MAX_BLOB_CELLS, *params,
            ])
            try:
                got, at, out = int(reply[0]), int(reply[1]), reply[2]
            except (IndexError, TypeError, ValueError) as exc:
                raise StorageError(f"unexpected reply from ae_read: {reply!r:.200}") from exc
            if got == 0 and at <= pos:
                raise StorageError("ae_read made no progress")
            for blob in out:
                blobs.append((shard, blob))
                size += len(blob)
            done += got
            pos = at
        return blobs, done, pos


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
