"""Redis I/O of escrow replication: the scripts of one region's agent and the scans it serves.

* :meth:`EscrowStore.drain` takes the escrow keys that changed (``escrow_drain.lua``);
* :meth:`EscrowStore.give` writes an advert and this region's gifts (``escrow_give.lua``);
* :meth:`EscrowStore.check` and :meth:`EscrowStore.merge` check, then merge, a peer's vetted
  fields (``escrow_merge.lua``: a push claiming this region gave more than it recorded is
  refused, a pulled page's such claims are merged and counted);
* :meth:`EscrowStore.page` reads a page of escrow keys for a peer's pull (SCAN);
* :meth:`EscrowStore.holds` and :meth:`EscrowStore.release` handle the per-shard hold
  after a new or wiped Redis (registry fields ``xs``: since when, ``xo``: intact);
* :meth:`EscrowStore.recall` records a peer's holds and tells which ones follow an
  earlier hold of that peer (registry field ``xk:<peer>``: its first hold's start);
* :meth:`EscrowStore.publish` tells the apps the regions (rules hash, ``@escrow``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from geolimit.core.keys import KeyLayout, glob_escape
from geolimit.core.rule import Rule
from geolimit.errors import ProtocolError, StorageError
from geolimit.limiter_base import ESCROW_FIELD
from geolimit.store.async_store import AsyncStore
from geolimit.store.escrow_fields import replicated
from geolimit.store.redis_store import describe_error
from geolimit.store.scripts import load_script

__all__ = ["OVER_LIMIT", "OWN_CLAIM", "EscrowStore", "Given", "Held", "Items", "refusal_reason"]

_DRAIN = load_script("escrow_drain")
_GIVE = load_script("escrow_give")
_MERGE = load_script("escrow_merge")

#: Added to the clock tolerance for an advert's version (rounding, and the time a push travels).
ADVERT_MARGIN_MS = 1000
#: Keys taken from one shard's changed set per round.
DRAIN_PER_SHARD = 500
#: Keys a SCAN step looks at for a pull page.
SCAN_COUNT = 500
#: In escrow_merge.lua's refusal of a push claiming that this region gave more than it recorded.
OWN_CLAIM = "writes its own transfers"
#: In its refusal of transfers that would give this region rights above the limit.
OVER_LIMIT = "were never made"
#: Per shard, the keys of a message to merge: (data key, rule, this region's share of its limit, vetted pairs).
Items = Mapping[int, list[tuple[bytes, Rule, int, list[tuple[bytes, bytes]]]]]


def refusal_reason(exc: ProtocolError) -> str:
    """The ``reason`` of a refused escrow message: ``own_transfer``, ``over_limit`` or ``decode``."""
    text = str(exc)
    return "own_transfer" if OWN_CLAIM in text else "over_limit" if OVER_LIMIT in text else "decode"


def _raise_refusal(reply: Any) -> None:
    """A script's error reply: ``escrow_merge.lua``'s refusals as ProtocolError, others as StorageError."""
    if isinstance(reply, BaseException):
        text = str(reply)
        refused = text.find("ResponseError: escrow: ")
        if refused >= 0 or text.startswith("escrow: "):
            raise ProtocolError(text[refused + len("ResponseError: "):] if refused >= 0 else text)
        raise reply if isinstance(reply, StorageError) else StorageError(describe_error(reply))


def _flat(pairs: Sequence[Any]) -> dict[bytes, bytes]:
    return {pairs[i]: pairs[i + 1] for i in range(0, len(pairs) - 1, 2)}


@dataclass(frozen=True, slots=True)
class Given:
    key: bytes
    changed: bool
    given: int
    rights: int
    fields: dict[bytes, bytes]  # the key's replicated fields (when changed)


@dataclass(slots=True)
class Held:
    """Shards whose escrow state is held (registry field ``xs``, no ``xo``)."""

    since: dict[int, int] = field(default_factory=dict)  # shard -> xs (µs)
    #: Every shard's last hold start (``xs``), held or released: what identifies this Redis's
    #: escrow state there, sent with every pull so that a peer that lost its record learns it again.
    starts: dict[int, int] = field(default_factory=dict)


class EscrowStore:
    def __init__(
        self, store: AsyncStore, layout: KeyLayout, region: str, nonce: bytes, *, clock_tolerance: float = 30.0,
    ) -> None:
        self.store = store
        self.layout = layout
        self.region = region
        self.nonce = nonce
        #: A peer's advert version (its region's clock in ms when made, see escrow_give.lua) may be
        #: this far ahead of ours: the gossip auth window, which bounds the peers' clock offsets.
        self.advert_ahead_ms = round(clock_tolerance * 1000) + ADVERT_MARGIN_MS

    async def time_us(self) -> int:
        try:
            seconds, micros = await self.store.client().time()
        except Exception as exc:  # redis-py errors and a closed client alike
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc
        return int(seconds) * 1_000_000 + int(micros)

    async def publish(self, regions: Sequence[str], wait_us: int) -> None:
        value = ",".join(sorted(regions)) + f";{wait_us}"
        try:
            await self.store.client().hset(self.layout.rules_key, ESCROW_FIELD, value)
        except Exception as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc

    async def holds(self, shards: Sequence[int], now_us: int) -> Held:
        """The held shards among ``shards``; a shard with neither field starts its hold now."""
        client = self.store.client()
        held = Held()
        regs = [self.layout.registry_key(s) for s in shards]
        try:
            pipe = client.pipeline(transaction=False)
            for reg in regs:
                pipe.hmget(reg, ["xo", "xs"])
            got = await pipe.execute()
            fresh = [i for i, (intact, since) in enumerate(got) if intact is None and since is None]
            if fresh:
                pipe = client.pipeline(transaction=False)
                for i in fresh:
                    pipe.hsetnx(regs[i], "xs", str(now_us))
                    pipe.hmget(regs[i], ["xo", "xs"])
                for i, pair in zip(fresh, (await pipe.execute())[1::2], strict=True):
                    got[i] = pair
        except Exception as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc
        for shard, (intact, since) in zip(shards, got, strict=True):
            start = None if since is None else int(since)
            if start is not None and 0 <= start < 2**63:
                held.starts[shard] = start
                if intact is None:
                    held.since[shard] = start
        return held

    async def recall(self, peer: str, holds: Mapping[int, int]) -> list[int]:
        """Record ``peer``'s hold starts (the first per shard is kept; a peer sends every
        shard's, held or not, so a record this Redis lost is learnt again) and return the
        shards where another one was recorded: there the peer's Redis held escrow state
        before and lost it (it matters for the shards the peer holds now)."""
        if not holds:
            return []
        field_name = f"xk:{peer}"
        shards = sorted(holds)
        try:
            pipe = self.store.client().pipeline(transaction=False)
            for shard in shards:
                reg = self.layout.registry_key(shard)
                pipe.hsetnx(reg, field_name, str(holds[shard]))
                pipe.hget(reg, field_name)
            got = await pipe.execute()
        except Exception as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc
        return [shard for shard, first in zip(shards, got[1::2], strict=True)
                if first is not None and first != str(holds[shard]).encode()]

    async def release(self, shard: int) -> None:
        try:
            await self.store.client().hset(self.layout.registry_key(shard), "xo", "1")
        except Exception as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc

    async def drain(self, shards: Sequence[int]) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Changed escrow keys of ``shards`` with their fields (each taken once)."""
        calls = [[b"1", self.layout.tag(s) + b"#e", b"%d" % DRAIN_PER_SHARD] for s in shards]
        out: list[tuple[bytes, dict[bytes, bytes]]] = []
        for reply in await self.store.run_many(_DRAIN, calls):
            if isinstance(reply, BaseException):
                raise reply
            for i in range(0, len(reply) - 1, 2):
                out.append((reply[i], _flat(reply[i + 1])))
        return out

    async def give(
        self, plans: Sequence[tuple[bytes, Rule, int, Mapping[str, int]]], now_us: int | None,
    ) -> list[Given]:
        """For each ``(key, rule, share, gifts)``: write the advert and the gifts, capped by the spare."""
        calls = []
        for key, rule, share, gifts in plans:
            shard, _, _ = self.layout.parse_data_key(key)
            args = [b"2", self.layout.registry_key(shard), key, b"" if now_us is None else b"%d" % now_us,
                    self.region.encode(), b"%d" % rule.limit, b"%d" % share, b"%d" % rule.escrow_steps,
                    b"%d" % rule.buckets, b"%d" % rule.resolution_us, b"%d" % rule.ttl_ms]
            for receiver, amount in sorted(gifts.items()):
                args += [receiver.encode(), b"%d" % amount]
            calls.append(args)
        out = []
        for (key, _, _, _), reply in zip(plans, await self.store.run_many(_GIVE, calls), strict=True):
            if isinstance(reply, BaseException):
                raise reply
            if reply[0] == 0:
                continue  # held: nothing written
            out.append(Given(key, reply[0] == 2, int(reply[1]), int(reply[2]), _flat(reply[3:])))
        return out

    async def check(self, by_shard: Items, now_us: int | None = None, *, repair: bool = False) -> None:
        """What needs Redis state or its clock (how many fields each key would hold, advert
        versions, this region's own transfers and rights), before anything is written:
        :class:`ProtocolError` naming the reason. ``repair``: a page this region pulled."""
        for reply in await self.store.run_many(_MERGE, self._merge_calls(by_shard, now_us, b"0", repair)):
            _raise_refusal(reply)

    async def merge(self, by_shard: Items, now_us: int | None, *, repair: bool = False) -> tuple[int, int]:
        """Merge vetted and checked fields, one script call per shard: the number of fields
        that changed, and of this region's own transfers raised (``repair`` only)."""
        changed = raised = 0
        for reply in await self.store.run_many(_MERGE, self._merge_calls(by_shard, now_us, b"1", repair)):
            _raise_refusal(reply)  # only a change since the checks can refuse now
            changed += sum(int(x) for x in reply[:-1])
            raised += int(reply[-1])
        return changed, raised

    def _merge_calls(self, by_shard: Items, now_us: int | None, apply: bytes, repair: bool) -> list[list[bytes]]:
        calls = []
        for shard, items in by_shard.items():
            keys = [self.layout.registry_key(shard), *(key for key, _, _, _ in items)]
            args = [b"" if now_us is None else b"%d" % now_us, self.region.encode(), self.nonce, apply,
                    b"%d" % self.advert_ahead_ms, b"pull" if repair else b"push"]
            for _, rule, share, pairs in items:
                args += [b"%d" % rule.limit, b"%d" % rule.ttl_ms, b"%d" % share, b"%d" % len(pairs)]
                for name, value in pairs:
                    args += [name, value]
            calls.append([b"%d" % len(keys), *keys, *args])
        return calls

    async def page(
        self, rules: Sequence[Rule], cursor: tuple[int, int, int],
    ) -> tuple[list[tuple[bytes, dict[bytes, bytes]]], tuple[int, int, int] | None]:
        """Escrow keys of ``rules`` from ``cursor`` on (rule index, node index, SCAN cursor):
        ``(rule:subject, replicated fields)`` pairs and the next cursor (None: done)."""
        index, node, scan = cursor
        if index >= len(rules) or self.store.clustered:
            # Redis Cluster: a pull serves nothing (pushes and merges still replicate every change).
            return [], None
        prefix = self.layout.prefix.encode()
        pattern = glob_escape(prefix) + b":{*}:" + rules[index].name.encode() + b":*"
        try:
            scan, keys = await self.store.client().scan(cursor=scan, match=pattern, count=SCAN_COUNT)
        except Exception as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc
        out = []
        found = [k if isinstance(k, bytes) else k.encode() for k in keys]
        if found:
            for key, fields in zip(found, await self.store.read(found), strict=True):
                shared = replicated(fields)
                if shared:
                    _, rule, subject = self.layout.parse_data_key(key)
                    out.append((rule.encode() + b":" + subject, shared))
        if scan == 0:
            index, scan = index + 1, 0
        return out, (None if index >= len(rules) else (index, node, int(scan)))
