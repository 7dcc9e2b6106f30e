"""Anti-entropy: constants, digests (mirrors ``ae_common.lua``) and the plan of an exchange."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from array import array
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from geolimit.core.keys import MAX_SUBJECT_BYTES
from geolimit.core.rule import Rule
from geolimit.store.scripts import LuaScript

log = logging.getLogger("geolimit.antientropy")

Blob = tuple[int, bytes]
Send = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
Admit = Callable[[], Awaitable[object]]
#: merge(peer, blobs, admit): max-merge; ``admit`` (the replay guard, or None) runs
#: after every check and before the first write, so a refused push leaves no trace.
Merge = Callable[[str, list[Blob], Admit | None], Awaitable[None]]

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
#: The longest settle time an exchange may ask for (µs).
MAX_SETTLE_US = 3600 * 1_000_000
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
#: leaves (1 MiB: an agent's memory must not grow with the keyspace while it
#: scans), and how many it adds between two awaits.
PENDING_NUMBERS = 1 << 17
REDUCE_NUMBERS = 1 << 16
#: Data keys per ``ae_read.lua`` call.
READ_CALL_KEYS = 64
#: A keyspace of at least this many keys gets a first digest pass of shard sums
#: only (leaves in a second pass, of the differing shards): below it the leaves
#: fit the queue and cost little.
SHARDS_FIRST_KEYS = PENDING_NUMBERS // 2


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
    keys_skipped: int = 0  # listed keys (ours or theirs) that may not be exchanged (checks._Unexchangeable)
    keys_received: int = 0  # keys whose cells we asked for
    keys_sent: int = 0  # keys whose cells we pushed
    cells_received: int = 0
    cells_sent: int = 0
    blobs_received: int = 0
    blobs_sent: int = 0
    steps: int = 0  # requests sent
    truncated: bool = False  # more differences than max_keys: the next run goes on
    settle: float = 0.0  # seconds: buckets that ended later than this were not compared (periodic runs)
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
    #: Compare only buckets that ended at least this long before ``now_us`` (0: up to
    #: ``c + F``). Periodic exchanges settle: cells still travelling in deltas are not
    #: differences, and under load they would fill every listing.
    settle_us: int = 0
    rule_args: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        args = [b"%d" % len(self.rules)]
        for name, rule in self.rules.items():
            args += (name.encode(), b"%d" % rule.resolution_us, b"%d" % rule.buckets,
                     b"%d" % rule.ring, b"%d" % self.future(rule))
        self.rule_args = args

    def future(self, rule: Rule) -> int:
        """The last bucket compared, relative to the current one (``F``, or negative when settling)."""
        if not self.settle_us:
            return rule.future
        res = rule.resolution_us
        return (self.now_us - self.settle_us) // res - 1 - self.now_us // res

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

    A big keyspace's first pass adds only the shard sums (``leaves`` False): equal
    regions compare nothing else, and a per-key leaf costs the agent more than
    the rest of the pass. A descent then digests the leaves of the differing
    shards (``scope``, a shard bitmap; None for every shard) in a second pass.
    """

    def __init__(self, shards: int, leaves_per_shard: int) -> None:
        total = shards * leaves_per_shard
        self.shard_digests = [0] * shards
        self.shard_counts = [0] * shards
        self.digests = array("Q", bytes(8 * total))
        self.counts = array("I", bytes(4 * total))
        self.pending = array("q")
        self._reducing = 0  # reduce() calls running (the leaves are incomplete meanwhile)
        self.keys = 0
        self.seconds = 0.0
        self.leaves = False  # the leaves of the shards in scope are digested (once reduced)
        self.scope: bytes | None = None  # the shards whose leaves are (None: all)

    def covers(self, shard: int) -> bool:
        """Are ``shard``'s leaves digested (once reduced)?"""
        return self.leaves and in_scope(self.scope, shard)

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
        return not self.pending and not self._reducing

    async def reduce(self) -> None:
        """Add the queued pairs into the leaves, awaiting between chunks."""
        digests, counts, mask = self.digests, self.counts, MASK
        self._reducing += 1
        try:
            while self.pending:
                queued, self.pending = self.pending, array("q")
                for start in range(0, len(queued), REDUCE_NUMBERS):
                    chunk = queued[start : start + REDUCE_NUMBERS]
                    for g, w in zip(chunk[0::2], chunk[1::2], strict=True):
                        digests[g] = (digests[g] + w) & mask
                        counts[g] += 1
                    await asyncio.sleep(0)
        finally:
            self._reducing -= 1


def in_scope(scope: bytes | None, shard: int) -> bool:
    """Is ``shard`` in a shard bitmap (bit ``s`` of byte ``s // 8``; None: every shard)?"""
    return scope is None or (shard >> 3 < len(scope) and bool(scope[shard >> 3] >> (shard & 7) & 1))


def shard_bitmap(shards: int, chosen: Iterable[int]) -> bytes:
    """The bitmap of ``chosen`` shards (of ``shards``), as :func:`in_scope` reads it."""
    out = bytearray((shards + 7) // 8)
    for s in chosen:
        out[s >> 3] |= 1 << (s & 7)
    return bytes(out)


def _node_sums(d: _Digests, leaves: int, per_shard: int, nodes: Sequence[int]) -> tuple[list[int], list[int]]:
    """Digest sums and key counts of tree nodes (leaf levels need ``d.reduce()`` first)."""
    if per_shard == 1:
        return [d.shard_digests[g] for g in nodes], [d.shard_counts[g] for g in nodes]
    if not d.reduced:
        raise RuntimeError("leaf digests not reduced yet")
    if not all(d.covers(g // per_shard) for g in nodes):
        raise RuntimeError("leaf digests of these shards not computed")
    span = leaves // per_shard
    if span == 1:
        return [d.digests[g] for g in nodes], [d.counts[g] for g in nodes]
    # Each node is summed once a request, however often it is named (2048 copies of
    # node 0 over 4096 leaves each took 160 ms): the distinct nodes of a level cover
    # each leaf once, so a request costs at most one pass over the leaves.
    ds: list[int] = []
    cs: list[int] = []
    known: dict[int, tuple[int, int]] = {}
    for g in nodes:
        sums = known.get(g)
        if sums is None:
            shard, i = divmod(g, per_shard)
            a = shard * leaves + i * span
            sums = known[g] = (sum(d.digests[a : a + span]) & MASK, sum(d.counts[a : a + span]))
        ds.append(sums[0])
        cs.append(sums[1])
    return ds, cs
