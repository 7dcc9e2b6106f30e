"""The replication agent's Redis operations: drain, merge, read the live window.

A thin I/O shell: the scripts do the atomic work (``drain.lua``, ``merge.lua``),
this module builds their arguments and turns replies into cells.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from geolimit.core.keys import KeyLayout
from geolimit.core.rule import Rule
from geolimit.core.usage import slot_names
from geolimit.core.window import bucket_of, read_key
from geolimit.errors import StorageError
from geolimit.replication.digest import live_range, partition_of
from geolimit.replication.wire import Cell6
from geolimit.store.async_store import AsyncStore
from geolimit.store.redis_store import describe_error
from geolimit.store.scripts import load_script

__all__ = ["Drained", "Merged", "ReplicationStore"]

_DRAIN = load_script("drain")
_MERGE = load_script("merge")


@dataclass(slots=True)
class Drained:
    cells: list[Cell6] = field(default_factory=list)
    unknown: int = 0  # changed keys of rules this agent does not know
    own_slots: dict[int, str] = field(default_factory=dict)  # shard -> this region's slot id


@dataclass(slots=True)
class Merged:
    increased: list[Cell6] = field(default_factory=list)
    dropped_old: int = 0
    dropped_future: int = 0


class ReplicationStore:
    """Drain, merge and read one region's Redis for the agent."""

    def __init__(
        self,
        store: AsyncStore,
        layout: KeyLayout,
        region: str,
        rules: Mapping[str, Rule],
        nonce: bytes,
        now_us: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.store = store
        self.layout = layout
        self.region = region
        self._region_b = region.encode()
        self._nonce = nonce
        self._now = now_us
        self.set_rules(rules)

    def set_rules(self, rules: Mapping[str, Rule]) -> None:
        self.rules = dict(rules)
        args: list[bytes] = [b"%d" % len(self.rules)]
        for name, rule in self.rules.items():
            args += (name.encode(), b"%d" % rule.resolution_us, b"%d" % rule.buckets, b"%d" % rule.ring)
        self._rule_args = args

    def _clock_arg(self) -> bytes:
        now = self._now()
        return b"" if now is None else b"%d" % now

    async def drain(self, lease_us: int = 15_000_000, peer_ages: Mapping[str, int] | None = None) -> Drained:
        """Take every shard's changes since the last drain (one pipelined round trip).

        Also renews the lease that makes apps record changes (for ``lease_us``) and
        publishes ``peer_ages``: for each peer, how old (µs) its counts here are.
        """
        ages = peer_ages or {}
        fresh: list[bytes] = [b"%d" % (len(ages) + 1), b"%d" % len(ages)]
        for peer, age in ages.items():
            fresh += (peer.encode(), b"%d" % age)
        head = [
            self._clock_arg(), self._region_b, self._nonce, new_incarnation(self._nonce), b"%d" % lease_us,
            *self._rule_args, *fresh,
        ]
        calls = [[b"3", *self.layout.aux_keys(s), *head] for s in range(self.layout.shards)]
        replies = await self.store.run_many(_DRAIN, calls)
        out = Drained()
        for shard, reply in enumerate(replies):
            if isinstance(reply, Exception):
                raise reply if isinstance(reply, StorageError) else StorageError(str(reply))
            own = reply[0].decode()
            out.own_slots[shard] = own
            names = slot_names(_pairs(reply[1])) if reply[1] else {0: own}
            out.unknown += int(reply[2])
            for i in range(3, len(reply), 2):
                _, rule, subject = self.layout.parse_data_key(reply[i])
                flat = reply[i + 1]
                for j in range(0, len(flat), 4):
                    slot = names.get(int(flat[j + 1]))
                    if slot is not None:
                        out.cells.append((rule, subject, int(flat[j]), slot, int(flat[j + 2]), int(flat[j + 3])))
        return out

    async def merge(self, cells: Iterable[Cell6]) -> Merged:
        """Max-merge cells of known rules; returns the cells that raised local state."""
        by_shard: dict[int, dict[tuple[str, bytes], list[Cell6]]] = {}
        for cell in cells:
            if cell[0] in self.rules:
                shard = self.layout.shard_of(cell[1])
                by_shard.setdefault(shard, {}).setdefault((cell[0], cell[1]), []).append(cell)
        if not by_shard:
            return Merged()
        clock = self._clock_arg()
        calls: list[list[bytes]] = []
        plans: list[list[list[Cell6]]] = []
        for shard, keys in by_shard.items():
            slots: dict[str, int] = {}
            keys_arg: list[bytes] = [self.layout.registry_key(shard)]
            body: list[bytes] = []
            plan: list[list[Cell6]] = []
            for (rule_name, subject), key_cells in keys.items():
                rule = self.rules[rule_name]
                keys_arg.append(self.layout.data_key(rule_name, subject))
                body += (
                    b"%d" % rule.resolution_us, b"%d" % rule.buckets, b"%d" % rule.ring,
                    b"%d" % rule.future, b"%d" % rule.ttl_ms, b"%d" % len(key_cells),
                )
                for _, _, bucket, slot, value, floor in key_cells:
                    ref = slots.setdefault(slot, len(slots))
                    body += (b"%d" % bucket, b"%d" % ref, b"%d" % value, b"%d" % floor)
                plan.append(key_cells)
            slot_args = [s.encode() for s in slots]
            calls.append(
                [b"%d" % len(keys_arg), *keys_arg, clock, self._region_b, self._nonce, b"%d" % len(slots), *slot_args, *body]
            )
            plans.append(plan)
        out = Merged()
        for reply, plan in zip(await self.store.run_many(_MERGE, calls), plans, strict=True):
            if isinstance(reply, Exception):
                raise reply if isinstance(reply, StorageError) else StorageError(str(reply))
            increased, old, future = reply
            for i in range(0, len(increased), 2):
                out.increased.append(plan[increased[i] - 1][increased[i + 1] - 1])
            out.dropped_old += int(old)
            out.dropped_future += int(future)
        return out

    async def read_live(
        self, now_us: int, partitions: set[int] | None = None
    ) -> dict[tuple[str, bytes], list[tuple[int, str, int, int]]]:
        """Every non-empty live cell by key, optionally only in some partitions."""
        client = self.store.client()
        pattern = self.layout.prefix.encode() + b":{*"
        keys: list[bytes] = []
        try:
            async for key in client.scan_iter(match=pattern, count=1000):
                if b"}:" in key:
                    keys.append(key)
        except RedisError as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc
        wanted: list[tuple[int, str, bytes, bytes]] = []
        for key in keys:
            try:
                shard, rule, subject = self.layout.parse_data_key(key)
            except ValueError:
                continue
            if rule in self.rules and (partitions is None or partition_of(subject) in partitions):
                wanted.append((shard, rule, subject, key))
        shards = sorted({w[0] for w in wanted})
        registries = dict(zip(shards, await self._hgetall([self.layout.registry_key(s) for s in shards]), strict=True))
        out: dict[tuple[str, bytes], list[tuple[int, str, int, int]]] = {}
        for start in range(0, len(wanted), 1000):
            chunk = wanted[start : start + 1000]
            for (shard, rule_name, subject, _), fields in zip(chunk, await self._hgetall([w[3] for w in chunk]), strict=True):
                spec = self.rules[rule_name]
                low, high = live_range(spec, now_us)
                view = read_key(fields, bucket_of(now_us, spec.resolution_us), spec.buckets, spec.ring)
                names = slot_names(registries.get(shard, {}))
                cells = [
                    (bucket, names[slot], value, floor)
                    for (slot, bucket), (value, floor) in view.cells.items()
                    if low <= bucket <= high and slot in names and (value or floor)
                ]
                if cells:
                    out[(rule_name, subject)] = cells
        return out

    async def _hgetall(self, keys: list[bytes]) -> list[dict[bytes, bytes]]:
        if not keys:
            return []
        client = self.store.client()
        try:
            async with client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hgetall(key)
                return list(await pipe.execute())
        except RedisError as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc


def new_incarnation(nonce: bytes) -> bytes:
    """A fresh incarnation id: microsecond time in hex plus this process's nonce."""
    micros = time.time_ns() // 1000
    return b"%x%05x" % (micros // 1_000_000, micros % 1_000_000) + nonce


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
