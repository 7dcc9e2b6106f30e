"""Anti-entropy: this region's side of the passes (bounded Lua pages over one store).

The digest, listing and read passes of an exchange; the SCAN they run on is
:class:`~geolimit.replication.antientropy.scan._Scanner`'s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from geolimit.core.keys import KeyLayout
from geolimit.errors import ProtocolError, StorageError
from geolimit.replication.antientropy.checks import _check_suffix
from geolimit.replication.antientropy.common import (
    BIG_FIELDS,
    MASK,
    MAX_BLOB_CELLS,
    MAX_REPLY_BYTES,
    PENDING_NUMBERS,
    READ_CALL_KEYS,
    READ_FIELDS,
    SHARDS_FIRST_KEYS,
    Blob,
    _Digests,
    _Plan,
    _script,
)
from geolimit.replication.antientropy.scan import _Progress, _Scanner
from geolimit.store.async_store import AsyncStore


class _Listing:
    """``(shard, rule:subject, digest)`` of the keys of some leaves, in scan order (capped).

    Keys this region holds but may not exchange (:class:`_Unexchangeable`: an older agent
    merged them) are left out and counted in ``skipped``, the latest with its reason in
    ``skipped_why``: a peer refuses to read or take them, so listing one would fail every
    exchange for as long as it lives.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.entries: list[tuple[int, bytes, int]] = []
        self.truncated = False
        self.skipped = 0
        self.skipped_why = ""

    def skip(self, suffix: bytes, why: str) -> None:
        self.skipped += 1
        self.skipped_why = f"{suffix[:40]!r}{'...' if len(suffix) > 40 else ''} ({len(suffix)} bytes): {why}"

    def add(self, shard: int, suffix: bytes, digest: int) -> None:
        if len(self.entries) >= self.cap:
            self.truncated = True
        else:
            self.entries.append((shard, suffix, digest))


class _Local(_Scanner):
    """This region's side of the passes: Lua pages over one store, awaited one by one."""

    def __init__(
        self, store: AsyncStore, layout: KeyLayout, page_keys: int, streams: int = 1, duty: float = 1.0,
        page_us: int = 1000, shards_first_keys: int | None = SHARDS_FIRST_KEYS,
    ) -> None:
        super().__init__(store, layout, page_keys, streams, duty, page_us)
        self.shards_first_keys: int | None = shards_first_keys

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
        layout, rules = self.layout, plan.rules

        def add(shard: int, suffix: bytes, digest: int) -> None:
            try:
                _check_suffix(layout, rules, shard, suffix)
            except ProtocolError as exc:  # _Unexchangeable (ae_scan.lua lists only the plan's rules and shards)
                listing.skip(suffix, str(exc))
            else:
                listing.add(shard, suffix, digest)

        def on_entry(reply: list[Any]) -> None:
            flat = reply[2]
            for i in range(0, len(flat), 3):
                add(int(flat[i]), flat[i + 1], int(flat[i + 2]))

        def on_big(g: int, key: bytes, shard: int, digest: int, cells: int) -> None:
            add(shard, key[len(self.layout.tag(shard)) + 1 :], digest)

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
