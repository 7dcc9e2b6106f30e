"""Anti-entropy: :class:`AntiEntropy`, which initiates exchanges (and serves them, see responder.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

from geolimit.core.keys import KeyLayout
from geolimit.core.rule import Rule
from geolimit.errors import GeolimitError, ProtocolError
from geolimit.log_every import LogEvery
from geolimit.replication.antientropy.checks import (
    _bool,
    _bytes,
    _check_blobs,
    _check_suffix,
    _int,
    _list,
    _show,
    _Unexchangeable,
)
from geolimit.replication.antientropy.common import (
    MASK,
    MAX_BLOB_CELLS,
    MAX_ENTRIES,
    MAX_NODES,
    MAX_PUSH_BLOBS,
    MAX_PUSH_BYTES,
    MAX_READ_BYTES,
    MAX_READ_KEYS,
    MAX_REPLY_BYTES,
    MAX_RULES,
    MAX_SETTLE_US,
    SHARDS_FIRST_KEYS,
    TOTAL_LEAVES,
    XID_BYTES,
    AntiEntropyResult,
    Merge,
    Send,
    _Digests,
    _node_sums,
    _Plan,
    leaves_per_shard,
    log,
    shard_bitmap,
    tree_levels,
)
from geolimit.replication.antientropy.exchange import _Exchange
from geolimit.replication.antientropy.local import _Listing, _Local
from geolimit.replication.antientropy.responder import _Responder
from geolimit.replication.antientropy.scan import _Progress
from geolimit.store.async_store import AsyncStore


class AntiEntropy(_Responder):
    """Anti-entropy of one region with its peers: :meth:`run` initiates, :meth:`handle` serves.

    ``send(peer, payload)`` delivers one request and returns the peer's reply (the
    transport: signing, HTTP); ``merge(peer, blobs)`` applies repair blobs
    ``(shard, blob)`` received from ``peer`` (and raises ProtocolError for bad
    ones). Both regions must use the same shard count.

    Tuning: ``page_keys`` and ``page_ms`` bound each scan script call (keys, and
    Redis time, checked every 32 keys); ``max_keys`` bounds the keys listed and
    repaired per run (more differences: ``truncated``, the next run goes on);
    ``total_leaves`` the range tree's leaves over all shards; ``duty`` the share
    of a Redis's time our scans may take; ``streams`` the SCAN cursors run at
    once on one server (more than 1 only pays off when the agent is far from
    Redis: each queues a script ahead of the apps' calls); ``max_scans`` the
    passes run at once (served and initiated); ``exchange_ttl`` how long the
    state of an exchange served lives without a request; ``max_seconds`` how
    long :meth:`run` may take in all; ``shards_first_keys`` the keyspace size
    from which a first digest pass sums shards only (None: never), leaving the
    leaves of differing shards to a second pass; ``monotonic`` the clock that
    times an exchange's idleness (tests drive it).
    """

    def __init__(
        self,
        region: str,
        store: AsyncStore,
        layout: KeyLayout,
        rules: Mapping[str, Rule],
        send: Send,
        merge: Merge,
        clock: Callable[[], float] = time.time,
        page_keys: int = 256,
        *,
        max_keys: int = 200_000,
        total_leaves: int = TOTAL_LEAVES,
        exchange_ttl: float = 60.0,
        max_seconds: float = 900.0,
        poll_interval: float = 0.05,
        max_poll_interval: float = 0.5,
        max_scans: int = 2,
        streams: int = 1,
        duty: float = 1.0,
        page_ms: float = 1.0,
        shards_first_keys: int | None = SHARDS_FIRST_KEYS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= page_keys <= 4096:
            raise ValueError("page_keys must be from 1 to 4096")
        self.region = region
        self.store = store
        self.layout = layout
        self.send = send
        self.merge = merge
        self.clock = clock
        self.monotonic = monotonic
        self.max_keys = max_keys
        self.total_leaves = total_leaves
        self.leaves = leaves_per_shard(layout.shards, total_leaves)
        self.exchange_ttl = exchange_ttl
        self.max_seconds = max_seconds
        self.poll_interval = poll_interval
        self.max_poll_interval = max_poll_interval
        if streams < 1 or streams & (streams - 1):
            raise ValueError("streams must be a power of two")
        if not 0.05 <= duty <= 1.0:
            raise ValueError("duty must be from 0.05 to 1")
        if not 0.1 <= page_ms <= 100:
            raise ValueError("page_ms must be from 0.1 to 100")
        self._local = _Local(store, layout, page_keys, streams, duty, int(page_ms * 1000), shards_first_keys)
        self._scans = asyncio.Semaphore(max_scans)
        self._exchanges: dict[bytes, _Exchange] = {}
        self.stats: dict[str, float] = dict.fromkeys(
            ("runs", "served", "refused", "cells_merged", "cells_served", "keys_skipped"), 0.0
        )
        self.skipped_lines = LogEvery(log)  # keys left out of listings: a line per 10 s, counting the rest
        self.set_rules(rules)

    def set_rules(self, rules: Mapping[str, Rule]) -> None:
        """Rules to compare (exchanges already under way keep theirs)."""
        self.rules = dict(rules)

    async def close(self) -> None:
        """Drop every exchange served (cancels their passes)."""
        tasks = []
        for ex in self._exchanges.values():
            ex.cancel()
            tasks += [t for t in (ex.digest_task, ex.leaf_task, ex.list_task) if t is not None]
        self._exchanges.clear()
        self.skipped_lines.close()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- initiator ------------------------------------------------------------

    async def run(self, peer: str, settle: float = 0.0) -> AntiEntropyResult:
        """One full exchange with ``peer``; raises TransportError, ProtocolError or StorageError.

        ``settle`` (seconds): compare only buckets that ended at least that long ago
        (periodic exchanges; 0 compares up to the future tolerance)."""
        started = time.monotonic()
        deadline = started + self.max_seconds
        result = AntiEntropyResult(peer, settle=settle)
        self.stats["runs"] += 1
        xid = os.urandom(XID_BYTES)
        now_us = int(self.clock() * 1_000_000)
        rules = {n: r for n, r in self.rules.items() if not r.escrow}  # escrow rules keep no cells
        # About 4 keys a leaf: a small keyspace gets a shallow tree (fewer round trips).
        keys = await self._local._dbsize()
        leaves = leaves_per_shard(self.layout.shards, min(self.total_leaves, keys // 4))
        request = {
            "op": "begin", "x": xid, "now": now_us, "shards": self.layout.shards, "leaves": leaves,
            "rules": [[n, r.window_us, r.resolution_us] for n, r in rules.items()],
        }
        settle_us = min(MAX_SETTLE_US, int(settle * 1_000_000))
        if settle_us:
            request["settle"] = settle_us
        reply = await self._ask(peer, request, result)
        if reply.get("x") != xid:
            raise ProtocolError("anti-entropy: begin reply names another exchange")
        accepted = _list(reply, "rules", MAX_RULES)
        if any(type(n) is not str or n not in rules for n in accepted):
            raise ProtocolError("anti-entropy: the peer accepted rules we did not offer")
        plan = _Plan(now_us, {n: rules[n] for n in accepted}, leaves, self.layout.shards, settle_us)
        result.rules = sorted(plan.rules)
        try:
            async with self._scans:
                mine = await self._local.first_digests(plan, _Progress(), keys)
            result.scan_seconds, result.keys_scanned = mine.seconds, mine.keys
            differing = await self._descend(peer, xid, plan, mine, result, deadline)
            if differing:
                await self._repair(peer, xid, plan, mine, differing, result, deadline)
        finally:
            with contextlib.suppress(GeolimitError):
                await self._ask(peer, {"op": "end", "x": xid}, result)
        result.seconds = time.monotonic() - started
        return result

    async def _ask(self, peer: str, payload: dict[str, Any], result: AntiEntropyResult) -> dict[str, Any]:
        result.steps += 1
        reply = await self.send(peer, payload)
        await asyncio.sleep(0)  # a transport that answers at once must not keep the loop to us
        if not isinstance(reply, dict):
            raise ProtocolError(f"anti-entropy: reply to {payload['op']!r} is not a map")
        return reply

    async def _poll(self, delay: float, deadline: float, peer: str) -> float:
        if time.monotonic() + delay > deadline:
            raise ProtocolError(f"anti-entropy with {peer} did not finish within {self.max_seconds:g} s")
        await asyncio.sleep(delay)
        return min(self.max_poll_interval, delay * 1.25)

    async def _descend(
        self, peer: str, xid: bytes, plan: _Plan, mine: _Digests, result: AntiEntropyResult, deadline: float
    ) -> list[tuple[int, int, int]]:
        """The leaves whose digests differ, as ``(leaf, our keys, their keys)``.

        After a shards-only first pass, the leaves of the differing shards are
        digested here (``scope``, a bitmap the peer gets with the deeper levels,
        so it digests the same shards), while the peer digests its own.
        """
        levels = tree_levels(plan.leaves)
        nodes = list(range(plan.shards))
        own: asyncio.Future[None] | None = None
        scope: bytes | None = None
        try:
            for level, per_shard in enumerate(levels):
                differing: list[tuple[int, int, int]] = []
                for start in range(0, len(nodes), MAX_NODES):
                    chunk = nodes[start : start + MAX_NODES]
                    theirs_d, theirs_c = await self._tree(peer, xid, level, chunk, result, deadline, scope)
                    if own is not None:
                        await own
                        own = None
                        await mine.reduce()
                    mine_d, mine_c = _node_sums(mine, plan.leaves, per_shard, chunk)
                    for g, a, b, ca, cb in zip(chunk, mine_d, theirs_d, mine_c, theirs_c, strict=True):
                        if a != b:
                            differing.append((g, ca, cb))
                result.ranges_compared += len(nodes)
                result.ranges_differing += len(differing)
                if not differing or level == len(levels) - 1:
                    result.leaves_differing = len(differing) if level == len(levels) - 1 else 0
                    return differing
                if level == 0:
                    if all(mine.covers(g) for g, _, _ in differing):
                        await mine.reduce()
                    else:
                        scope = shard_bitmap(plan.shards, (g for g, _, _ in differing))
                        own = asyncio.ensure_future(self._leaves(plan, mine, scope))
                fan = levels[level + 1] // per_shard
                nodes = [g * fan + i for g, _, _ in differing for i in range(fan)]
        finally:
            if own is not None:
                own.cancel()
                await asyncio.gather(own, return_exceptions=True)
        return []  # pragma: no cover - the loop returns at the last level

    async def _leaves(self, plan: _Plan, mine: _Digests, scope: bytes) -> None:
        async with self._scans:
            await self._local.leaf_digests(plan, mine, scope, _Progress())

    async def _tree(
        self, peer: str, xid: bytes, level: int, nodes: list[int], result: AntiEntropyResult, deadline: float,
        scope: bytes | None = None,
    ) -> tuple[list[int], list[int]]:
        delay = self.poll_interval
        request: dict[str, Any] = {"op": "tree", "x": xid, "level": level, "nodes": nodes}
        if scope is not None and level > 0:
            request["scope"] = scope
        while True:
            reply = await self._ask(peer, request, result)
            if _bool(reply, "ready"):
                break
            delay = await self._poll(delay, deadline, peer)
        n = len(nodes)
        raw_d = _bytes(reply, "d", 8 * n, exact=8 * n)
        raw_c = _bytes(reply, "c", 4 * n, exact=4 * n)
        digests = list(struct.unpack(f">{n}Q", raw_d))
        if digests and max(digests) > MASK:
            raise ProtocolError("anti-entropy: digest out of range")
        return digests, list(struct.unpack(f">{n}I", raw_c))

    async def _repair(
        self, peer: str, xid: bytes, plan: _Plan, mine: _Digests, differing: list[tuple[int, int, int]],
        result: AntiEntropyResult, deadline: float,
    ) -> None:
        # Keep the listing bounded: leaves in order until max_keys keys (by the larger count).
        bitmap = bytearray((plan.total + 7) // 8)
        budget = 0
        for g, ours, theirs in differing:
            if budget and budget + max(ours, theirs) > self.max_keys:
                result.truncated = True
                break
            budget += max(ours, theirs)
            bitmap[g >> 3] |= 1 << (g & 7)
        await self._ask(peer, {"op": "list", "x": xid, "leaves": bytes(bitmap)}, result)
        cap = 2 * self.max_keys + 1024
        listing = _Listing(cap)
        async with self._scans:
            await self._local.listing(plan, bytes(bitmap), listing, _Progress())
        if listing.truncated:
            result.truncated = True
        result.keys_skipped += listing.skipped
        self._skipped(peer, "this region holds", listing.skipped, listing.skipped_why)
        unfit = _Listing(0)  # counts what the peer listed and may not exchange (an older agent does)
        ours_by_key = {(s, k): d for s, k, d in listing.entries}
        result.keys_listed += len(ours_by_key)
        fetch: list[tuple[int, bytes]] = []
        seen: set[tuple[int, bytes]] = set()
        start, delay = 0, self.poll_interval
        while True:
            reply = await self._ask(peer, {"op": "entries", "x": xid, "from": start}, result)
            ready = _bool(reply, "ready")
            total = _int(reply, "total", 0, 1 << 40)
            if _bool(reply, "truncated"):
                result.truncated = True
            entries = _list(reply, "e", MAX_ENTRIES)
            for item in entries:
                if type(item) is not list or len(item) != 3 or type(item[0]) is not int \
                        or type(item[1]) is not bytes or type(item[2]) is not int or not 0 <= item[2] <= MASK:
                    raise ProtocolError(f"anti-entropy: bad listing entry {_show(item)}")
                shard, suffix, digest = item
                try:
                    _check_suffix(self.layout, plan.rules, shard, suffix)
                except _Unexchangeable as exc:
                    unfit.skip(suffix, str(exc))
                    continue
                key = (shard, suffix)
                if key in seen:
                    continue
                seen.add(key)
                if ours_by_key.get(key) != digest:
                    fetch.append(key)
            start += len(entries)
            if ready and start >= total:
                break
            if start >= cap:  # more than we keep: the rest waits for the next run
                result.truncated = True
                break
            if ready and not entries:
                raise ProtocolError("anti-entropy: the peer's listing ended early")
            if not entries:
                delay = await self._poll(delay, deadline, peer)
            else:
                delay = self.poll_interval
        result.keys_listed += len(seen)
        result.keys_skipped += unfit.skipped
        self._skipped(peer, f"{peer} listed", unfit.skipped, unfit.skipped_why)
        fetching = set(fetch)
        push = [k for k in ours_by_key if k not in seen or k in fetching]
        result.keys_differing = len(fetching.union(push))
        fetch.sort()
        push.sort()
        await self._fetch(peer, xid, plan, fetch, result)
        await self._push(peer, xid, plan, push, result)

    async def _fetch(self, peer: str, xid: bytes, plan: _Plan, keys: list[tuple[int, bytes]], result: AntiEntropyResult) -> None:
        done = pos = 0
        while done < len(keys):
            batch: list[list[Any]] = []
            size = 0
            for shard, suffix in keys[done : done + MAX_READ_KEYS]:
                size += len(suffix) + 8
                if batch and size > MAX_READ_BYTES:
                    break
                batch.append([shard, suffix])
            reply = await self._ask(peer, {"op": "read", "x": xid, "keys": batch, "pos": pos}, result)
            got = _int(reply, "done", 0, len(batch))
            at = _int(reply, "pos", 0, 1 << 20)
            blobs, cells = _check_blobs(_list(reply, "blobs", 4096), self.layout, plan.rules, 4 * MAX_REPLY_BYTES)
            if got == 0 and at <= pos:
                raise ProtocolError("anti-entropy: a read step made no progress")
            if blobs:
                await self.merge(peer, blobs, None)
            result.blobs_received += len(blobs)
            result.cells_received += cells
            result.keys_received += got
            done += got
            pos = at

    async def _push(self, peer: str, xid: bytes, plan: _Plan, keys: list[tuple[int, bytes]], result: AntiEntropyResult) -> None:
        batch: list[list[Any]] = []
        size = 0

        async def flush() -> None:
            nonlocal batch, size
            reply = await self._ask(peer, {"op": "push", "x": xid, "blobs": batch}, result)
            result.cells_sent += _int(reply, "cells", 0, MAX_PUSH_BLOBS * MAX_BLOB_CELLS)
            result.blobs_sent += len(batch)
            batch, size = [], 0

        done = pos = 0
        while done < len(keys):
            blobs, got, pos = await self._local.read(plan, keys[done : done + MAX_READ_KEYS], pos, MAX_PUSH_BYTES // 2)
            done += got
            result.keys_sent += got
            for shard, blob in blobs:
                if batch and (len(batch) >= MAX_PUSH_BLOBS or size + len(blob) > MAX_PUSH_BYTES):
                    await flush()
                batch.append([shard, blob])
                size += len(blob)
        if batch:
            await flush()
