"""Anti-entropy that holds at a million live keys per region.

Two regions compare what they hold for the *live window* of the initiator's
clock (buckets ``[c - N, c + F]`` of every rule both sides share) and repair
the differences, in many small steps:

1. **Digests, in Redis.** ``ae_scan.lua`` walks the node's keys with ``SCAN``
   in bounded pages (a few hundred keys, at most ~8k hash fields per call) and
   returns, per key, its *leaf* and its *digest*. A key's digest is the sum
   (mod 2**52) of one hash per live non-zero cell ``(bucket, slot id, value,
   floor)`` (see ``ae_common.lua``): independent of storage order, of slot
   indices, and of how a big key is split into chunks (``ae_key.lua``). A key's
   leaf is ``sha1(rule:subject)`` modulo ``L`` leaves of its shard. Python only
   adds each page into two arrays of fixed size (``shards * L`` leaf digests
   and key counts, about 2**18), and awaits Redis between pages. A page stops
   after ``page_keys`` keys or about ``page_ms`` of Redis time; the next one is
   requested before a reply is processed; an optional pacer (``duty``) bounds
   the scripts' share of a Redis's time.
2. **Merkle descent.** Sums are additive, so a range's digest is the sum of its
   leaves': the initiator asks for the responder's digests of all shards, then
   of the 16 sub-ranges of each shard that differs, and so on down to leaves.
   Equal regions exchange one digest per shard.
3. **Listing.** For the differing leaves (capped at ``max_keys`` keys a run,
   judged by both sides' counts), both sides run a second pass that lists
   ``(shard, rule:subject, digest)`` of the keys in those leaves; the initiator
   pulls the responder's list page by page and compares key by key.
4. **Repair.** The initiator reads the responder's cells of keys that differ or
   that it lacks (``read`` steps; ``ae_read.lua`` returns merge blobs) and
   merges them with the ``merge`` callback, and pushes its own cells of keys
   that differ or that the responder lacks (``push`` steps). Merging is a max,
   so a key that differs both ways travels both ways.

The responder does its passes in background tasks and answers "not ready" until
they are done, so no request waits for a scan. Its state is kept per exchange
id (at most :data:`MAX_EXCHANGES_PER_PEER` per peer, dropped after
``exchange_ttl`` seconds without a request). Every field of every payload (and
of every reply) is checked; bad input raises :class:`ProtocolError` before
anything is written.

Steps (``payload["op"]``; ``x`` is the 16-byte exchange id)::

    begin   {x, now, shards, leaves, rules: [[name, window_us, res_us], ...]}
            -> {x, rules: [accepted names]}          (responder starts pass 1)
    tree    {x, level, nodes: [node, ...]}            (<= 2048 nodes)
            -> {ready: false, scanned} | {ready: true, d: 8 bytes/node, c: 4 bytes/node}
    list    {x, leaves: bitmap of shards*L bits}      -> {ok}  (starts the listing)
    entries {x, from}    -> {ready, total, truncated, e: [[shard, rule:subject, digest], ...]}
    read    {x, keys: [[shard, rule:subject], ...], pos} -> {blobs: [[shard, blob]], done, pos}
    push    {x, blobs: [[shard, blob], ...]}          -> {ok, cells}
    end     {x}                                        -> {ok}

A node of level ``k`` is ``shard * n_k + i`` where ``n_0 = 1`` and each level
has 16 times as many nodes per shard as the one above, down to ``n = L``
(leaves). Digests are big-endian 64-bit, counts big-endian 32-bit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import struct
import time
from array import array
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import msgpack
from redis.exceptions import RedisError

from geolimit.core.keys import MAX_SUBJECT_BYTES, KeyLayout, glob_escape
from geolimit.core.rule import Rule
from geolimit.errors import GeolimitError, ProtocolError, StorageError
from geolimit.store.async_store import AsyncStore
from geolimit.store.scripts import LuaScript

__all__ = [
    "MAX_BLOB_CELLS",
    "AntiEntropy",
    "AntiEntropyResult",
    "cell_sums",
    "check_blob",
    "digest_of_cells",
    "key_digest",
    "key_seed",
    "slot_code",
]

log = logging.getLogger("geolimit.antientropy")

Blob = tuple[int, bytes]
Send = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
Merge = Callable[[str, list[Blob]], Awaitable[None]]

#: Digests are sums mod 2**52 (exact in Lua's doubles).
MASK = (1 << 52) - 1
MAX_VALUE = 1 << 53
#: Children per node of the range tree.
FANOUT = 16
#: Default number of leaves over all shards (about 4 keys a leaf at 1M keys).
TOTAL_LEAVES = 1 << 18
MAX_TOTAL_LEAVES = 1 << 20
MAX_LEAVES_PER_SHARD = 1 << 16
#: Per-step bounds (both what we send and what we accept).
MAX_NODES = 2048
MAX_ENTRIES = 2048
MAX_ENTRY_BYTES = 512 * 1024
MAX_READ_KEYS = 512
MAX_READ_BYTES = 1024 * 1024
MAX_REPLY_BYTES = 512 * 1024
MAX_PUSH_BLOBS = 8
MAX_PUSH_BYTES = 2 * 1024 * 1024
MAX_BLOB_BYTES = 1024 * 1024
MAX_BLOB_CELLS = 2048
MAX_BLOB_SLOTS = 1024
MAX_SLOT_ID = 256
MAX_RULES = 1024
MAX_SUFFIX = 65 + MAX_SUBJECT_BYTES
#: Clock difference beyond which a peer's ``now`` is refused (µs).
MAX_SKEW_US = 300 * 1_000_000
MAX_EXCHANGES_PER_PEER = 2
MAX_EXCHANGES = 16
XID_BYTES = 16
#: Lua work bounds: hash fields read per call, and the size from which a key
#: is read in chunks of ring positions instead of one HGETALL.
PAGE_FIELDS = 8192
BIG_FIELDS = 1024
READ_FIELDS = 4096
#: A keyspace of at least this many keys is scanned in parallel streams.
STREAM_MIN_KEYS = 1 << 15
#: (leaf, digest) numbers a digest pass queues before adding them into its
#: leaves (16 MiB), and how many it adds between two awaits.
PENDING_NUMBERS = 2 << 20
REDUCE_NUMBERS = 1 << 16
#: Data keys per ``ae_read.lua`` call.
READ_CALL_KEYS = 64


@cache
def _script(name: str) -> LuaScript:
    """``ae_common.lua`` + ``<name>.lua`` (without the app scripts' prelude)."""
    folder = resources.files("geolimit.store") / "lua"
    source = (folder / "ae_common.lua").read_bytes() + b"\n" + (folder / f"{name}.lua").read_bytes()
    return LuaScript(name, source, hashlib.sha1(source).hexdigest().encode())


# -- digests (mirrors ae_common.lua: see there) ------------------------------------

P1, A1, P2, A2 = 67108859, 57568332, 67108763, 39432167
_W26 = 1 << 26


def slot_code(slot_id: bytes) -> tuple[int, int]:
    """The two 24-bit numbers that stand for a slot id in digests."""
    hx = hashlib.sha1(slot_id).hexdigest()
    return int(hx[:6], 16), int(hx[6:12], 16)


def key_seed(suffix: bytes, leaves: int) -> tuple[int, int, int]:
    """``(leaf, seed1, seed2)`` of a key ``rule:subject``."""
    x = int(hashlib.sha1(suffix).hexdigest()[:13], 16)
    return (x >> 26) % leaves, x % _W26, x >> 26


def cell_sums(slot_id: bytes, bucket: int, value: int, floor: int) -> tuple[int, int]:
    """One cell's terms of S (mod P1, mod P2)."""
    c1, c2 = slot_code(slot_id)
    bh, bl = divmod(bucket, _W26)
    x = pow(((c1 * A1 + bh) % P1 * A1 + bl) % P1, 3, P1)
    y = pow(((c2 * A2 + bh) % P2 * A2 + bl) % P2, 3, P2)
    return (x * value + x * x * floor) % P1, (y * value + y * y * floor) % P2


def key_digest(suffix: bytes, s1: int, s2: int) -> int:
    """A key's digest from its cells' sums S (mod P1, mod P2)."""
    _, k1, k2 = key_seed(suffix, 1)
    return pow((k1 + s1) % P1, 3, P1) * _W26 + pow((k2 + s2) % P2, 3, P2)


def digest_of_cells(suffix: bytes, cells: Iterable[tuple[int, bytes, int, int]]) -> int:
    """The digest of a key's live cells ``(bucket, slot id, value, floor)`` (tests, tools)."""
    s1 = s2 = 0
    for bucket, slot, value, floor in cells:
        if value or floor:
            t1, t2 = cell_sums(slot, bucket, value, floor)
            s1, s2 = s1 + t1, s2 + t2
    return key_digest(suffix, s1 % P1, s2 % P2)


def leaves_per_shard(shards: int, total: int = TOTAL_LEAVES) -> int:
    """A power of two such that ``shards * L`` is about ``total``."""
    per = max(1, min(MAX_LEAVES_PER_SHARD, total // shards))
    return 1 << (per.bit_length() - 1)


def tree_levels(leaves: int) -> list[int]:
    """Nodes per shard at each level, from 1 (the shard) to ``leaves``."""
    levels = [1]
    while levels[-1] < leaves:
        levels.append(min(leaves, levels[-1] * FANOUT))
    return levels


@dataclass(slots=True)
class AntiEntropyResult:
    """What one exchange compared and moved (initiator's view)."""

    peer: str
    seconds: float = 0.0
    scan_seconds: float = 0.0  # our digest pass
    keys_scanned: int = 0  # keys with live cells in our digest pass
    ranges_compared: int = 0  # tree nodes compared, all levels
    ranges_differing: int = 0
    leaves_differing: int = 0
    keys_listed: int = 0  # ours + theirs, in the listing pass
    keys_differing: int = 0
    keys_received: int = 0  # keys whose cells we asked for
    keys_sent: int = 0  # keys whose cells we pushed
    cells_received: int = 0
    cells_sent: int = 0
    blobs_received: int = 0
    blobs_sent: int = 0
    steps: int = 0  # requests sent
    truncated: bool = False  # more differences than max_keys: the next run goes on
    rules: list[str] = field(default_factory=list)

    @property
    def in_sync(self) -> bool:
        """Nothing differed (the regions held the same live cells)."""
        return self.leaves_differing == 0


@dataclass(slots=True)
class _Plan:
    """What one exchange compares: the initiator's clock, the shared rules, the leaves."""

    now_us: int
    rules: dict[str, Rule]
    leaves: int
    shards: int
    rule_args: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        args = [b"%d" % len(self.rules)]
        for name, rule in self.rules.items():
            args += (name.encode(), b"%d" % rule.resolution_us, b"%d" % rule.buckets,
                     b"%d" % rule.ring, b"%d" % rule.future)
        self.rule_args = args

    @property
    def total(self) -> int:
        return self.shards * self.leaves


class _Digests:
    """The result of a digest pass: per shard and (once reduced) per leaf, digest sums and key counts.

    Pages add their per-shard sums at once (equal regions compare nothing
    else) and queue their ``(leaf, digest)`` pairs in a flat array, added into
    the leaves only when a descent needs them (:meth:`reduce`) or when the
    queue passes :data:`PENDING_NUMBERS`. Arrays, not lists: a few MiB, and
    nothing for the garbage collector to walk through.
    """

    def __init__(self, shards: int, leaves_per_shard: int) -> None:
        total = shards * leaves_per_shard
        self.shard_digests = [0] * shards
        self.shard_counts = [0] * shards
        self.digests = array("Q", bytes(8 * total))
        self.counts = array("I", bytes(4 * total))
        self.pending = array("q")
        self.keys = 0
        self.seconds = 0.0

    def add_shards(self, flat: Sequence[int]) -> None:
        """``shard, digest sum, keys, ...`` of one page."""
        sd, sc = self.shard_digests, self.shard_counts
        for i in range(0, len(flat), 3):
            shard = flat[i]
            sd[shard] = (sd[shard] + flat[i + 1]) & MASK
            sc[shard] += flat[i + 2]
            self.keys += flat[i + 2]

    def add_leaf(self, g: int, digest: int) -> None:
        self.digests[g] = (self.digests[g] + digest) & MASK
        self.counts[g] += 1

    @property
    def reduced(self) -> bool:
        return not self.pending

    async def reduce(self) -> None:
        """Add the queued pairs into the leaves, awaiting between chunks."""
        digests, counts, mask = self.digests, self.counts, MASK
        while self.pending:
            chunk = self.pending[:REDUCE_NUMBERS]
            del self.pending[:REDUCE_NUMBERS]
            for g, w in zip(chunk[0::2], chunk[1::2], strict=True):
                digests[g] = (digests[g] + w) & mask
                counts[g] += 1
            await asyncio.sleep(0)


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
        page_us: int = 1000,
    ) -> None:
        self.store = store
        self.layout = layout
        self.page_keys = page_keys
        self.page_us = page_us
        self.streams = streams
        self.duty = duty
        prefix = layout.prefix.encode()
        self.pattern = glob_escape(prefix) + b":{*}:*"
        self.plen = b"%d" % len(prefix)

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
        bitmap: bytes | None,
        on_entry: Callable[[list[Any]], None],
        on_big: Callable[[int, bytes, int, int, int], None],
        progress: _Progress,
        after: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """One pass over every node: digests (``bitmap`` None) or the listing of some leaves.

        Nodes are scanned concurrently, and a large keyspace in ``streams``
        parts, each with one call in flight: Redis works on one part while we
        read the reply of another.
        """
        mode = b"d" if bitmap is None else b"l"
        jobs: list[Awaitable[None]] = []
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
        await _all(jobs)

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
                b"%d" % rule.resolution_us, b"%d" % rule.buckets, b"%d" % rule.ring, b"%d" % rule.future]
        s1 = s2 = cells = 0
        for p0 in range(0, rule.ring, chunk):
            p1 = min(rule.ring, p0 + chunk)
            reply = await self._run(_script("ae_key"), [*head, b"%d" % p0, b"%d" % p1, *codes])
            s1, s2, cells = s1 + int(reply[0]), s2 + int(reply[1]), cells + int(reply[2])
        return key_digest(key[len(self.layout.tag(shard)) + 1 :], s1 % P1, s2 % P2), cells

    async def digests(self, plan: _Plan, progress: _Progress) -> _Digests:
        started = time.monotonic()
        out = _Digests(plan.shards, plan.leaves)
        overflow: list[bool] = []

        def on_entry(reply: list[Any]) -> None:
            out.add_shards(reply[5])
            out.pending.extend(reply[2])
            if len(out.pending) > PENDING_NUMBERS and not overflow:
                overflow.append(True)

        def on_big(g: int, key: bytes, shard: int, digest: int, cells: int) -> None:
            out.shard_digests[shard] = (out.shard_digests[shard] + digest) & MASK
            out.shard_counts[shard] += 1
            out.keys += 1
            out.add_leaf(g, digest)

        async def drain() -> None:
            if overflow:
                overflow.clear()
                await out.reduce()

        try:
            await self.scan(plan, None, on_entry, on_big, progress, drain)
        except (IndexError, TypeError, ValueError, KeyError, OverflowError) as exc:
            raise StorageError(f"unexpected reply from ae_scan: {exc!r}") from exc
        out.seconds = time.monotonic() - started
        return out

    async def listing(self, plan: _Plan, bitmap: bytes, listing: _Listing, progress: _Progress) -> None:
        def on_entry(reply: list[Any]) -> None:
            flat = reply[2]
            for i in range(0, len(flat), 3):
                listing.add(int(flat[i]), flat[i + 1], int(flat[i + 2]))

        def on_big(g: int, key: bytes, shard: int, digest: int, cells: int) -> None:
            listing.add(shard, key[len(self.layout.tag(shard)) + 1 :], digest)

        try:
            await self.scan(plan, bitmap, on_entry, on_big, progress)
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


# -- validation ----------------------------------------------------------------


def _int(payload: Mapping[str, Any], name: str, lo: int, hi: int) -> int:
    value = payload.get(name)
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"anti-entropy: field {name!r} must be an integer in [{lo}, {hi}], got {_show(value)}")
    return value


def _bytes(payload: Mapping[str, Any], name: str, max_len: int, exact: int | None = None) -> bytes:
    value = payload.get(name)
    if type(value) is not bytes or len(value) > max_len or (exact is not None and len(value) != exact):
        size = exact if exact is not None else f"at most {max_len}"
        raise ProtocolError(f"anti-entropy: field {name!r} must be {size} bytes, got {_show(value)}")
    return value


def _list(payload: Mapping[str, Any], name: str, max_len: int) -> list[Any]:
    value = payload.get(name)
    if type(value) is not list or len(value) > max_len:
        raise ProtocolError(f"anti-entropy: field {name!r} must be a list of at most {max_len} items, got {_show(value)}")
    return value


def _bool(payload: Mapping[str, Any], name: str) -> bool:
    value = payload.get(name)
    if type(value) is not bool:
        raise ProtocolError(f"anti-entropy: field {name!r} must be true or false, got {_show(value)}")
    return value


def _show(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _pair(item: object, what: str) -> tuple[int, bytes]:
    if type(item) is not list or len(item) != 2 or type(item[0]) is not int or type(item[1]) is not bytes:
        raise ProtocolError(f"anti-entropy: {what} must be [shard, bytes], got {_show(item)}")
    return item[0], item[1]


def _check_suffix(layout: KeyLayout, rules: Mapping[str, Rule], shard: int, suffix: bytes) -> Rule:
    """The rule of ``rule:subject`` in ``shard``; ProtocolError unless it is one of ``rules``."""
    if not 0 <= shard < layout.shards:
        raise ProtocolError(f"anti-entropy: shard {shard} out of range (this region has {layout.shards})")
    if len(suffix) > MAX_SUFFIX:
        raise ProtocolError(f"anti-entropy: key of {len(suffix)} bytes is too long")
    name, sep, subject = suffix.partition(b":")
    try:
        rule = rules.get(name.decode()) if sep else None
    except UnicodeDecodeError:
        rule = None
    if rule is None:
        raise ProtocolError(f"anti-entropy: key {suffix[:80]!r} is not of a rule of this exchange")
    if len(subject) > MAX_SUBJECT_BYTES:
        raise ProtocolError(f"anti-entropy: subject of {len(subject)} bytes is too long")
    if layout.shard_of(subject) != shard:
        raise ProtocolError(f"anti-entropy: key {suffix[:80]!r} does not belong to shard {shard}")
    return rule


def check_blob(blob: bytes, shard: int, layout: KeyLayout, rules: Mapping[str, Rule]) -> tuple[int, int]:
    """Check one repair blob of ``shard`` completely; returns ``(keys, cells)``.

    Format: msgpack (str/raw types only, no bin) ``[slot ids, rule:subject, cells,
    ...]`` where cells is a flat ``bucket, slot_ref, value, floor, ...`` list.
    Raises :class:`ProtocolError` naming what is wrong.
    """
    if type(blob) is not bytes or len(blob) > MAX_BLOB_BYTES:
        raise ProtocolError(f"anti-entropy: blob must be at most {MAX_BLOB_BYTES} bytes")
    try:
        obj = msgpack.unpackb(
            blob, raw=True, use_list=True, max_str_len=MAX_BLOB_BYTES, max_bin_len=0,
            max_array_len=4 * MAX_BLOB_CELLS + 1, max_map_len=0, max_ext_len=0,
        )
    except Exception as exc:
        raise ProtocolError(f"anti-entropy: undecodable blob: {exc}") from exc
    if type(obj) is not list or len(obj) < 3 or len(obj) % 2 != 1:
        raise ProtocolError("anti-entropy: a blob must be [slots, key, cells, ...]")
    slots = obj[0]
    if type(slots) is not list or not 0 < len(slots) <= MAX_BLOB_SLOTS:
        raise ProtocolError(f"anti-entropy: a blob needs 1 to {MAX_BLOB_SLOTS} slot ids")
    for slot in slots:
        if type(slot) is not bytes or not 3 <= len(slot) <= MAX_SLOT_ID:
            raise ProtocolError(f"anti-entropy: bad slot id {_show(slot)}")
        region, sep, incarnation = slot.rpartition(b"/")
        if not sep or not region or not incarnation:
            raise ProtocolError(f"anti-entropy: slot id {slot[:80]!r} is not region/incarnation")
    if len(set(slots)) != len(slots):
        raise ProtocolError("anti-entropy: a blob names a slot twice")
    nslots, total = len(slots), 0
    for i in range(1, len(obj), 2):
        suffix, cells = obj[i], obj[i + 1]
        if type(suffix) is not bytes:
            raise ProtocolError(f"anti-entropy: bad key in blob: {_show(suffix)}")
        _check_suffix(layout, rules, shard, suffix)
        if type(cells) is not list or not cells or len(cells) % 4:
            raise ProtocolError("anti-entropy: cells must be a non-empty flat list of 4-tuples")
        total += len(cells) // 4
        if total > MAX_BLOB_CELLS:
            raise ProtocolError(f"anti-entropy: a blob holds more than {MAX_BLOB_CELLS} cells")
        if not all(type(x) is int for x in cells):
            raise ProtocolError("anti-entropy: cells must be integers")
        if min(cells) < 0 or max(cells) >= MAX_VALUE:
            raise ProtocolError("anti-entropy: cell number out of range [0, 2**53)")
        if max(cells[1::4]) >= nslots:
            raise ProtocolError("anti-entropy: cell names a slot the blob does not list")
    return len(obj) // 2, total


def _check_blobs(items: list[Any], layout: KeyLayout, rules: Mapping[str, Rule], max_bytes: int) -> tuple[list[Blob], int]:
    blobs: list[Blob] = []
    cells = size = 0
    for item in items:
        shard, blob = _pair(item, "a blob entry")
        size += len(blob)
        if size > max_bytes:
            raise ProtocolError(f"anti-entropy: blobs exceed {max_bytes} bytes")
        cells += check_blob(blob, shard, layout, rules)[1]
        blobs.append((shard, blob))
    return blobs, cells


def _node_sums(d: _Digests, leaves: int, per_shard: int, nodes: Sequence[int]) -> tuple[list[int], list[int]]:
    """Digest sums and key counts of tree nodes (leaf levels need ``d.reduce()`` first)."""
    if per_shard == 1:
        return [d.shard_digests[g] for g in nodes], [d.shard_counts[g] for g in nodes]
    if not d.reduced:
        raise RuntimeError("leaf digests not reduced yet")
    span = leaves // per_shard
    if span == 1:
        return [d.digests[g] for g in nodes], [d.counts[g] for g in nodes]
    ds: list[int] = []
    cs: list[int] = []
    for g in nodes:
        shard, i = divmod(g, per_shard)
        a = shard * leaves + i * span
        ds.append(sum(d.digests[a : a + span]) & MASK)
        cs.append(sum(d.counts[a : a + span]))
    return ds, cs


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


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: an abandoned exchange's failure is not "never retrieved"


@dataclass(eq=False)
class _Exchange:
    """The responder's state for one exchange."""

    xid: bytes
    peer: str
    plan: _Plan
    touched: float
    reply: dict[str, Any]
    progress: _Progress = field(default_factory=_Progress)
    digest_task: asyncio.Task[_Digests] | None = None
    reduce_task: asyncio.Task[None] | None = None
    list_task: asyncio.Task[None] | None = None
    list_key: bytes = b""
    listing: _Listing | None = None

    def cancel(self) -> None:
        for task in (self.digest_task, self.reduce_task, self.list_task):
            if task is not None and not task.done():
                task.cancel()


class AntiEntropy:
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
    long :meth:`run` may take in all.
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
    ) -> None:
        if not 1 <= page_keys <= 4096:
            raise ValueError("page_keys must be from 1 to 4096")
        self.region = region
        self.store = store
        self.layout = layout
        self.send = send
        self.merge = merge
        self.clock = clock
        self.max_keys = max_keys
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
        self._local = _Local(store, layout, page_keys, streams, duty, int(page_ms * 1000))
        self._scans = asyncio.Semaphore(max_scans)
        self._exchanges: dict[bytes, _Exchange] = {}
        self.stats: dict[str, float] = dict.fromkeys(
            ("runs", "served", "refused", "cells_merged", "cells_served"), 0.0
        )
        self.set_rules(rules)

    def set_rules(self, rules: Mapping[str, Rule]) -> None:
        """Rules to compare (exchanges already under way keep theirs)."""
        self.rules = dict(rules)

    async def close(self) -> None:
        """Drop every exchange served (cancels their passes)."""
        tasks = []
        for ex in self._exchanges.values():
            ex.cancel()
            tasks += [t for t in (ex.digest_task, ex.list_task) if t is not None]
        self._exchanges.clear()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- initiator ------------------------------------------------------------

    async def run(self, peer: str) -> AntiEntropyResult:
        """One full exchange with ``peer``; raises TransportError, ProtocolError or StorageError."""
        started = time.monotonic()
        deadline = started + self.max_seconds
        result = AntiEntropyResult(peer)
        self.stats["runs"] += 1
        xid = os.urandom(XID_BYTES)
        now_us = int(self.clock() * 1_000_000)
        rules = dict(self.rules)
        request = {
            "op": "begin", "x": xid, "now": now_us, "shards": self.layout.shards, "leaves": self.leaves,
            "rules": [[n, r.window_us, r.resolution_us] for n, r in rules.items()],
        }
        reply = await self._ask(peer, request, result)
        if reply.get("x") != xid:
            raise ProtocolError("anti-entropy: begin reply names another exchange")
        accepted = _list(reply, "rules", MAX_RULES)
        if any(type(n) is not str or n not in rules for n in accepted):
            raise ProtocolError("anti-entropy: the peer accepted rules we did not offer")
        plan = _Plan(now_us, {n: rules[n] for n in accepted}, self.leaves, self.layout.shards)
        result.rules = sorted(plan.rules)
        try:
            async with self._scans:
                mine = await self._local.digests(plan, _Progress())
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
        """The leaves whose digests differ, as ``(leaf, our keys, their keys)``."""
        levels = tree_levels(plan.leaves)
        nodes = list(range(plan.shards))
        for level, per_shard in enumerate(levels):
            differing: list[tuple[int, int, int]] = []
            for start in range(0, len(nodes), MAX_NODES):
                chunk = nodes[start : start + MAX_NODES]
                theirs_d, theirs_c = await self._tree(peer, xid, level, chunk, result, deadline)
                mine_d, mine_c = _node_sums(mine, plan.leaves, per_shard, chunk)
                for g, a, b, ca, cb in zip(chunk, mine_d, theirs_d, mine_c, theirs_c, strict=True):
                    if a != b:
                        differing.append((g, ca, cb))
            result.ranges_compared += len(nodes)
            result.ranges_differing += len(differing)
            if differing and level == 0:
                await mine.reduce()
            if not differing or level == len(levels) - 1:
                result.leaves_differing = len(differing) if level == len(levels) - 1 else 0
                return differing
            fan = levels[level + 1] // per_shard
            nodes = [g * fan + i for g, _, _ in differing for i in range(fan)]
        return []  # pragma: no cover - the loop returns at the last level

    async def _tree(
        self, peer: str, xid: bytes, level: int, nodes: list[int], result: AntiEntropyResult, deadline: float
    ) -> tuple[list[int], list[int]]:
        delay = self.poll_interval
        while True:
            reply = await self._ask(peer, {"op": "tree", "x": xid, "level": level, "nodes": nodes}, result)
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
                _check_suffix(self.layout, plan.rules, shard, suffix)
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
                await self.merge(peer, blobs)
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

    # -- responder ------------------------------------------------------------

    async def handle(self, peer: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Serve one step of an exchange ``peer`` initiated."""
        try:
            return await self._handle(peer, payload)
        except ProtocolError:
            self.stats["refused"] += 1
            raise

    async def _handle(self, peer: str, payload: dict[str, Any]) -> dict[str, Any]:
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
        ex.touched = time.monotonic()
        if op == "tree":
            return self._on_tree(ex, payload)
        if op == "list":
            return self._on_list(ex, payload)
        if op == "entries":
            return self._on_entries(ex, payload)
        if op == "read":
            return await self._on_read(ex, payload)
        if op == "push":
            return await self._on_push(ex, payload)
        if op == "end":
            ex.cancel()
            self._exchanges.pop(xid, None)
            return {"ok": True}
        raise ProtocolError(f"anti-entropy: unknown step {_show(op)}")

    def _expire(self) -> None:
        """Drop exchanges idle for ``exchange_ttl`` (a pass under way is not idle)."""
        limit = time.monotonic() - self.exchange_ttl
        for xid, ex in list(self._exchanges.items()):
            running = any(t is not None and not t.done() for t in (ex.digest_task, ex.list_task))
            if ex.touched < limit and not running:
                ex.cancel()
                del self._exchanges[xid]

    def _begin(self, peer: str, payload: dict[str, Any]) -> dict[str, Any]:
        xid = _bytes(payload, "x", XID_BYTES, exact=XID_BYTES)
        existing = self._exchanges.get(xid)
        if existing is not None:
            if existing.peer != peer:
                raise ProtocolError("anti-entropy: exchange id already in use")
            existing.touched = time.monotonic()
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
            if rule is not None and rule.structure == (item[1], item[2]):
                accepted[item[0]] = rule
        mine = [x for x in self._exchanges.values() if x.peer == peer]
        if len(mine) >= MAX_EXCHANGES_PER_PEER:
            oldest = min(mine, key=lambda x: x.touched)
            oldest.cancel()
            self._exchanges.pop(oldest.xid, None)
        if len(self._exchanges) >= MAX_EXCHANGES:
            raise ProtocolError("anti-entropy: too many exchanges under way; try later")
        plan = _Plan(now, accepted, leaves, shards)
        reply = {"x": xid, "rules": list(accepted)}
        ex = _Exchange(xid, peer, plan, time.monotonic(), reply)
        ex.digest_task = asyncio.ensure_future(self._serve_digests(ex))
        ex.digest_task.add_done_callback(_consume)
        self._exchanges[xid] = ex
        return reply

    async def _serve_digests(self, ex: _Exchange) -> _Digests:
        try:
            async with self._scans:
                return await self._local.digests(ex.plan, ex.progress)
        finally:
            ex.touched = time.monotonic()  # the idle time starts when the pass ends

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
            ex.touched = time.monotonic()

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

    async def _on_push(self, ex: _Exchange, payload: dict[str, Any]) -> dict[str, Any]:
        blobs, cells = _check_blobs(_list(payload, "blobs", MAX_PUSH_BLOBS), self.layout, ex.plan.rules, MAX_PUSH_BYTES)
        if blobs:
            await self.merge(ex.peer, blobs)
        self.stats["cells_merged"] += cells
        return {"ok": True, "cells": cells}
