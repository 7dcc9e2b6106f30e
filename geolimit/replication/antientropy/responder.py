"""Anti-entropy: serving the steps of exchanges that peers initiate."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

from geolimit.core.keys import MAX_SUBJECT_BYTES, KeyLayout
from geolimit.core.rule import Rule
from geolimit.errors import GeolimitError, ProtocolError, StorageError
from geolimit.log_every import LogEvery
from geolimit.replication.antientropy.checks import (
    _bytes,
    _check_blobs,
    _check_suffix,
    _int,
    _list,
    _pair,
    _show,
)
from geolimit.replication.antientropy.common import (
    MAX_ENTRIES,
    MAX_ENTRY_BYTES,
    MAX_EXCHANGES,
    MAX_EXCHANGES_PER_PEER,
    MAX_LEAVES_PER_SHARD,
    MAX_NODES,
    MAX_PUSH_BLOBS,
    MAX_PUSH_BYTES,
    MAX_READ_BYTES,
    MAX_READ_KEYS,
    MAX_RULES,
    MAX_SETTLE_US,
    MAX_SKEW_US,
    MAX_TOTAL_LEAVES,
    XID_BYTES,
    Admit,
    Merge,
    _Digests,
    _node_sums,
    _Plan,
    tree_levels,
)
from geolimit.replication.antientropy.exchange import _consume, _Exchange
from geolimit.replication.antientropy.local import _Listing, _Local


class _Responder:
    """The responder's side of :class:`AntiEntropy` (see there), which sets these attributes."""

    region: str
    layout: KeyLayout
    rules: dict[str, Rule]
    merge: Merge
    clock: Callable[[], float]
    monotonic: Callable[[], float]
    max_keys: int
    exchange_ttl: float
    stats: dict[str, float]
    skipped_lines: LogEvery
    _local: _Local
    _scans: asyncio.Semaphore
    _exchanges: dict[bytes, _Exchange]

    # -- responder ------------------------------------------------------------

    async def handle(self, peer: str, payload: dict[str, Any], admit: Admit | None = None) -> dict[str, Any]:
        """Serve one step of an exchange ``peer`` initiated.

        ``admit`` (the transport's replay guard) runs once the step passed every
        check and before anything is written to Redis: a ``push`` calls it between
        its checks and its merge, every other step (they only read Redis) once it
        is done. A refused step (ProtocolError) leaves Redis as it was.
        """
        xid = payload.get("x") if isinstance(payload, dict) else None
        opened = isinstance(xid, bytes) and xid not in self._exchanges
        try:
            reply = await self._handle(peer, payload, admit)
        except ProtocolError:
            self.stats["refused"] += 1
            raise
        if admit is not None and payload.get("op") != "push":
            try:
                await admit()
            except BaseException:
                ex = self._exchanges.pop(xid, None) if opened and isinstance(xid, bytes) else None
                if ex is not None:  # a refused begin leaves no exchange behind
                    ex.cancel()
                raise
        return reply

    async def _handle(self, peer: str, payload: dict[str, Any], admit: Admit | None) -> dict[str, Any]:
        if not isinstance(payload, dict):
            raise ProtocolError("anti-entropy: a request must be a map")
        self._expire()
        self.stats["served"] += 1
        op = payload.get("op")
        if op == "begin":
            return self._begin(peer, payload)
        xid = _bytes(payload, "x", XID_BYTES, exact=XID_BYTES)
        ex = self._exchanges.get(xid)
        if ex is None or ex.peer != peer:
            raise ProtocolError("anti-entropy: unknown or expired exchange")
        ex.touched = self.monotonic()
        if op == "tree":
            return self._on_tree(ex, payload)
        if op == "list":
            return self._on_list(ex, payload)
        if op == "entries":
            return self._on_entries(ex, payload)
        if op == "read":
            return await self._on_read(ex, payload)
        if op == "push":
            return await self._on_push(ex, payload, admit)
        if op == "end":
            ex.cancel()
            self._exchanges.pop(xid, None)
            return {"ok": True}
        raise ProtocolError(f"anti-entropy: unknown step {_show(op)}")

    def _expire(self) -> None:
        """Drop exchanges idle for ``exchange_ttl`` (a pass under way is not idle)."""
        limit = self.monotonic() - self.exchange_ttl
        for xid, ex in list(self._exchanges.items()):
            running = any(t is not None and not t.done() for t in (ex.digest_task, ex.leaf_task, ex.list_task))
            if ex.touched < limit and not running:
                ex.cancel()
                del self._exchanges[xid]

    def _begin(self, peer: str, payload: dict[str, Any]) -> dict[str, Any]:
        xid = _bytes(payload, "x", XID_BYTES, exact=XID_BYTES)
        existing = self._exchanges.get(xid)
        if existing is not None:
            if existing.peer != peer:
                raise ProtocolError("anti-entropy: exchange id already in use")
            existing.touched = self.monotonic()
            return existing.reply  # a retried begin
        local_now = int(self.clock() * 1_000_000)
        now = _int(payload, "now", max(0, local_now - MAX_SKEW_US), local_now + MAX_SKEW_US)
        shards = _int(payload, "shards", 1, 16384)
        if shards != self.layout.shards:
            raise ProtocolError(f"anti-entropy: peer has {shards} shards, this region {self.layout.shards}")
        leaves = _int(payload, "leaves", 1, MAX_LEAVES_PER_SHARD)
        if leaves & (leaves - 1) or shards * leaves > MAX_TOTAL_LEAVES:
            raise ProtocolError(f"anti-entropy: bad leaf count {leaves}")
        accepted: dict[str, Rule] = {}
        for item in _list(payload, "rules", MAX_RULES):
            if type(item) is not list or len(item) != 3 or type(item[0]) is not str or len(item[0]) > 64 \
                    or type(item[1]) is not int or type(item[2]) is not int:
                raise ProtocolError(f"anti-entropy: bad rule entry {_show(item)}")
            rule = self.rules.get(item[0])
            # Escrow rules keep no cells: their state replicates through geolimit.replication.escrow.
            if rule is not None and rule.structure == (item[1], item[2], 0):
                accepted[item[0]] = rule
        mine = [x for x in self._exchanges.values() if x.peer == peer]
        if len(mine) >= MAX_EXCHANGES_PER_PEER:
            oldest = min(mine, key=lambda x: x.touched)
            oldest.cancel()
            self._exchanges.pop(oldest.xid, None)
        if len(self._exchanges) >= MAX_EXCHANGES:
            raise ProtocolError("anti-entropy: too many exchanges under way; try later")
        settle = _int(payload, "settle", 0, MAX_SETTLE_US) if "settle" in payload else 0
        plan = _Plan(now, accepted, leaves, shards, settle)
        reply = {"x": xid, "rules": list(accepted)}
        ex = _Exchange(xid, peer, plan, self.monotonic(), reply)
        ex.digest_task = asyncio.ensure_future(self._serve_digests(ex))
        ex.digest_task.add_done_callback(_consume)
        self._exchanges[xid] = ex
        return reply

    async def _serve_digests(self, ex: _Exchange) -> _Digests:
        try:
            async with self._scans:
                return await self._local.first_digests(ex.plan, ex.progress)
        finally:
            ex.touched = self.monotonic()  # the idle time starts when the pass ends

    async def _serve_leaves(self, ex: _Exchange, mine: _Digests, scope: bytes | None) -> None:
        try:
            async with self._scans:
                await self._local.leaf_digests(ex.plan, mine, scope, ex.progress)
        finally:
            ex.touched = self.monotonic()

    @staticmethod
    def _finished(task: asyncio.Task[Any] | None) -> bool:
        if task is None or not task.done():
            return False
        if task.cancelled():
            raise ProtocolError("anti-entropy: exchange was cancelled")
        exc = task.exception()
        if exc is not None:
            raise exc if isinstance(exc, GeolimitError) else StorageError(f"anti-entropy pass failed: {exc!r}")
        return True

    def _on_tree(self, ex: _Exchange, payload: dict[str, Any]) -> dict[str, Any]:
        levels = tree_levels(ex.plan.leaves)
        level = _int(payload, "level", 0, len(levels) - 1)
        nodes = _list(payload, "nodes", MAX_NODES)
        top = ex.plan.shards * levels[level]
        if not all(type(g) is int and 0 <= g < top for g in nodes):
            raise ProtocolError(f"anti-entropy: tree nodes must be integers in [0, {top})")
        if not self._finished(ex.digest_task):
            return {"ready": False, "scanned": ex.progress.visited}
        assert ex.digest_task is not None
        mine = ex.digest_task.result()
        if level > 0 and not all(mine.covers(g // levels[level]) for g in nodes):
            # A shards-only first pass: digest the leaves of the shards the initiator
            # names (those that differed), or of every shard if it names none.
            if ex.leaf_task is None:
                size = (ex.plan.shards + 7) // 8
                ex.leaf_scope = _bytes(payload, "scope", size, exact=size) if "scope" in payload else None
                ex.leaf_task = asyncio.ensure_future(self._serve_leaves(ex, mine, ex.leaf_scope))
                ex.leaf_task.add_done_callback(_consume)
            if not self._finished(ex.leaf_task):
                return {"ready": False, "scanned": ex.progress.visited}
            if not all(mine.covers(g // levels[level]) for g in nodes):
                raise ProtocolError("anti-entropy: tree nodes outside the shards being compared")
        if level > 0 and not mine.reduced:
            if ex.reduce_task is None:
                ex.reduce_task = asyncio.ensure_future(mine.reduce())
                ex.reduce_task.add_done_callback(_consume)
            if not self._finished(ex.reduce_task):
                return {"ready": False, "scanned": ex.progress.visited}
        digests, counts = _node_sums(mine, ex.plan.leaves, levels[level], nodes)
        n = len(nodes)
        return {"ready": True, "d": struct.pack(f">{n}Q", *digests),
                "c": struct.pack(f">{n}I", *(min(c, 0xFFFFFFFF) for c in counts))}

    def _on_list(self, ex: _Exchange, payload: dict[str, Any]) -> dict[str, Any]:
        size = (ex.plan.total + 7) // 8
        bitmap = _bytes(payload, "leaves", size, exact=size)
        if ex.list_task is not None:
            if bitmap != ex.list_key:
                raise ProtocolError("anti-entropy: this exchange is already listing other leaves")
            return {"ok": True}
        if not self._finished(ex.digest_task):
            raise ProtocolError("anti-entropy: listing requested before the digests were compared")
        ex.list_key = bitmap
        ex.listing = _Listing(2 * self.max_keys + 1024)
        ex.list_task = asyncio.ensure_future(self._serve_listing(ex, bitmap, ex.listing))
        ex.list_task.add_done_callback(_consume)
        return {"ok": True}

    async def _serve_listing(self, ex: _Exchange, bitmap: bytes, listing: _Listing) -> None:
        try:
            async with self._scans:
                await self._local.listing(ex.plan, bitmap, listing, ex.progress)
        finally:
            ex.touched = self.monotonic()
        self._skipped(ex.peer, "this region holds", listing.skipped, listing.skipped_why)

    def _skipped(self, peer: str, whose: str, keys: int, why: str) -> None:
        """Count, and log at most once every 10 s, keys left out of a listing (:class:`_Unexchangeable`)."""
        if not keys:
            return
        self.stats["keys_skipped"] += keys
        self.skipped_lines.warn(
            ("skipped", peer, whose), f"region {self.region}: anti-entropy with {peer}",
            f"{keys} key(s) {whose} cannot be exchanged and were skipped (a subject over {MAX_SUBJECT_BYTES} "
            f"bytes or of another shard, which an older agent merged: they expire with their rule's window); "
            f"the latest: {why}", "key(s) skipped", keys,
        )

    def _on_entries(self, ex: _Exchange, payload: dict[str, Any]) -> dict[str, Any]:
        if ex.listing is None:
            raise ProtocolError("anti-entropy: entries requested before a listing")
        listing = ex.listing
        start = _int(payload, "from", 0, len(listing.entries))
        ready = self._finished(ex.list_task)
        out: list[list[Any]] = []
        size = 0
        for shard, suffix, digest in listing.entries[start : start + MAX_ENTRIES]:
            size += len(suffix) + 16
            if out and size > MAX_ENTRY_BYTES:
                break
            out.append([shard, suffix, digest])
        return {"ready": ready, "total": len(listing.entries), "truncated": listing.truncated, "e": out}

    async def _on_read(self, ex: _Exchange, payload: dict[str, Any]) -> dict[str, Any]:
        items = _list(payload, "keys", MAX_READ_KEYS)
        keys: list[tuple[int, bytes]] = []
        rings: list[int] = []
        size = 0
        for item in items:
            shard, suffix = _pair(item, "a key to read")
            rings.append(_check_suffix(self.layout, ex.plan.rules, shard, suffix).ring)
            size += len(suffix)
            if size > MAX_READ_BYTES:
                raise ProtocolError(f"anti-entropy: keys to read exceed {MAX_READ_BYTES} bytes")
            keys.append((shard, suffix))
        pos = _int(payload, "pos", 0, rings[0] - 1 if rings else 0)
        if not keys:
            return {"blobs": [], "done": 0, "pos": 0}
        blobs, done, pos = await self._local.read(ex.plan, keys, pos)
        return {"blobs": [[s, b] for s, b in blobs], "done": done, "pos": pos}

    async def _on_push(self, ex: _Exchange, payload: dict[str, Any], admit: Admit | None) -> dict[str, Any]:
        blobs, cells = _check_blobs(_list(payload, "blobs", MAX_PUSH_BLOBS), self.layout, ex.plan.rules, MAX_PUSH_BYTES)
        if blobs:
            await self.merge(ex.peer, blobs, admit)  # admits once merge.lua's checks passed
        elif admit is not None:
            await admit()
        self.stats["cells_merged"] += cells
        return {"ok": True, "cells": cells}
