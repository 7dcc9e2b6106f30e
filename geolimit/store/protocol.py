"""Encoding requests for the Lua scripts and decoding their replies (no I/O).

The sync and async stores share this module, so both send byte-identical
script calls.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from geolimit.core.decision import Decision, combine, rule_decision
from geolimit.core.escrow import share as escrow_share
from geolimit.core.keys import KeyLayout
from geolimit.core.rule import Rule
from geolimit.core.window import MAX_COUNT
from geolimit.errors import RequestError, StorageError

__all__ = [
    "ESCROW_DENIALS",
    "MAX_COST",
    "REPLY_PER_RULE",
    "EscrowPlacement",
    "HitRequest",
    "RequestBuilder",
    "RulePlan",
    "build_request",
    "bulk",
    "decode_hit",
    "encode_hit",
    "encode_hit_resp",
    "encode_reset",
    "pack_command",
    "validate_cost",
]

#: The largest cost of one request (inclusive): see geolimit.core.window.MAX_COUNT.
MAX_COST = MAX_COUNT
#: hit.lua answers, per rule after each request's own flag: allowed, used, retry_us,
#: reset_us, stable_us (see :func:`decode_hit`).
REPLY_PER_RULE = 5


@dataclass(frozen=True, slots=True)
class HitRequest:
    """One request (one subject, one or more rules) ready for ``hit.lua``."""

    rules: tuple[Rule, ...]
    shard: int
    keys: tuple[bytes, ...]  # registry, changed, peers, then one data key per rule
    args: tuple[bytes, ...]  # consume, cost, nrules, then 10 per rule
    resp_keys: bytes  # ``keys`` RESP-encoded, for the pre-packed path
    resp_args: bytes  # ``args`` RESP-encoded


def validate_cost(cost: object) -> int:
    if isinstance(cost, bool) or not isinstance(cost, int):
        raise RequestError(f"cost must be an integer, got {cost!r}")
    if not 0 <= cost <= MAX_COST:
        raise RequestError(f"cost must be from 0 to 2**46 ({MAX_COST}), got {cost}")
    return cost


def bulk(part: bytes) -> bytes:
    """``part`` as a RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(part), part)


_bulk = bulk


@dataclass(frozen=True, slots=True)
class RulePlan:
    """A rule's script arguments, encoded once."""

    rule: Rule
    name: bytes
    args: tuple[bytes, ...]
    resp: bytes

    @classmethod
    def of(cls, rule: Rule, escrow: EscrowPlacement | None = None) -> RulePlan:
        """``escrow``: where this region stands among the regions, for an escrow rule
        (None while unknown: ``hit.lua`` then denies the rule)."""
        if not rule.escrow:
            spec = b""
        elif escrow is None:
            spec = b"-1 %d 0" % rule.escrow_steps
        else:
            spec = b"%d %d %d" % (escrow.share(rule.limit), rule.escrow_steps, escrow.wait_us)
        args = (
            b"%d" % rule.limit,
            b"%d" % rule.resolution_us,
            b"%d" % rule.buckets,
            b"%d" % rule.ring,
            b"%d" % rule.ttl_ms,
            b"1" if rule.mode == "approximate" else b"0",
            b"1" if rule.predict else b"0",
            b"%d" % ("local", "share", "closed").index(rule.partition),
            b"%d" % rule.partition_after_us,
            spec,
        )
        return cls(rule, rule.name.encode(), args, b"".join(map(_bulk, args)))


@dataclass(frozen=True, slots=True)
class EscrowPlacement:
    """This region's place among the regions of escrow mode (published by the agent)."""

    regions: tuple[str, ...]  # every region, sorted
    region: str
    wait_us: int  # about how soon rights given by a peer arrive (two rounds and two trips)

    def share(self, limit: int) -> int:
        """This region's part of ``limit`` before transfers (geolimit.core.escrow.share)."""
        return escrow_share(limit, self.regions, self.region)


#: Reasons of the negative per-rule codes of hit.lua (an escrow rule denied before it was counted).
ESCROW_DENIALS = {
    -1: "escrow: this region does not know the regions yet (its agent publishes them); denied until it does",
    -2: "escrow: this Redis lost or never had its escrow state; denied until the agent has restored it "
        "from every peer and one window has passed",
}


_FLAGS = {True: (b"1", b"$1\r\n1\r\n"), False: (b"0", b"$1\r\n0\r\n")}


class RequestBuilder:
    """Builds :class:`HitRequest` objects for one key layout, caching per-shard keys."""

    def __init__(self, layout: KeyLayout) -> None:
        self.layout = layout
        self._aux: dict[int, tuple[tuple[bytes, bytes, bytes], bytes]] = {}
        #: One-rule requests built lately, by (subject, cost, consume), with their plan (a busy subject
        #: asks again and again; a HitRequest is never changed, so it is shared).
        self._built: dict[tuple[bytes, int, bool], tuple[RulePlan, HitRequest]] = {}

    def build(self, plans: Sequence[RulePlan], subject: bytes, cost: int, consume: bool) -> HitRequest:
        if len(plans) == 1:
            key = (subject, cost, consume)
            built = self._built.get(key)
            if built is not None and built[0] is plans[0]:
                return built[1]
            request = self._build(plans, subject, cost, consume)
            if len(self._built) >= 1024:
                self._built.clear()
            self._built[key] = (plans[0], request)
            return request
        return self._build(plans, subject, cost, consume)

    def _build(self, plans: Sequence[RulePlan], subject: bytes, cost: int, consume: bool) -> HitRequest:
        layout = self.layout
        shard = zlib.crc32(subject) % layout.shards
        aux = self._aux.get(shard)
        if aux is None:
            keys = layout.aux_keys(shard)
            aux = self._aux[shard] = (keys, b"".join(map(_bulk, keys)))
        if len(plans) == 1:  # the common case, without the general loop
            plan = plans[0]
            key = layout.tag(shard) + b":" + plan.name + b":" + subject
            flag, flag_resp = _FLAGS[consume]
            cost_b = b"%d" % cost
            return HitRequest(
                (plan.rule,),
                shard,
                (*aux[0], key),
                (flag, cost_b, b"1", *plan.args),
                aux[1] + b"$%d\r\n%b\r\n" % (len(key), key),
                b"%b$%d\r\n%b\r\n$1\r\n1\r\n%b" % (flag_resp, len(cost_b), cost_b, plan.resp),
            )
        tag = layout.tag(shard) + b":"
        data_keys = tuple(tag + p.name + b":" + subject for p in plans)
        flag, flag_resp = _FLAGS[consume]
        cost_b = b"%d" % cost
        count_b = b"%d" % len(plans)
        args: tuple[bytes, ...] = (flag, cost_b, count_b)
        resp = [flag_resp, _bulk(cost_b), _bulk(count_b)]
        for plan in plans:
            args += plan.args
            resp.append(plan.resp)
        return HitRequest(
            tuple(p.rule for p in plans),
            shard,
            aux[0] + data_keys,
            args,
            aux[1] + b"".join(map(_bulk, data_keys)),
            b"".join(resp),
        )


def build_request(
    layout: KeyLayout, rules: Sequence[Rule], subject: bytes, cost: int, consume: bool
) -> HitRequest:
    """One-off form of :meth:`RequestBuilder.build`."""
    return RequestBuilder(layout).build([RulePlan.of(r) for r in rules], subject, cost, consume)


def encode_hit(
    requests: Sequence[HitRequest], now_us: int | None, region: bytes, nonce: bytes
) -> list[bytes]:
    """EVALSHA arguments after the SHA: numkeys, keys..., args..."""
    keys: list[bytes] = []
    args: list[bytes] = [b"" if now_us is None else b"%d" % now_us, region, nonce, b"%d" % len(requests)]
    for request in requests:
        keys += request.keys
        args += request.args
    return [b"%d" % len(keys), *keys, *args]


def encode_hit_resp(
    requests: Sequence[HitRequest], now_us: int | None, region: bytes, nonce: bytes
) -> tuple[int, bytes]:
    """The call of :func:`encode_hit` as ``(argument count, RESP body)``, pre-packed."""
    nkeys = sum(len(r.keys) for r in requests)
    nargs = sum(len(r.args) for r in requests)
    body = b"".join(
        (
            _bulk(b"%d" % nkeys),
            *(r.resp_keys for r in requests),
            _bulk(b"" if now_us is None else b"%d" % now_us),
            _bulk(region),
            _bulk(nonce),
            _bulk(b"%d" % len(requests)),
            *(r.resp_args for r in requests),
        )
    )
    return 1 + nkeys + 4 + nargs, body


def encode_reset(
    layout: KeyLayout, rules: Sequence[Rule], subject: bytes, now_us: int | None, region: bytes, nonce: bytes
) -> list[bytes]:
    shard = layout.shard_of(subject)
    keys = [*layout.aux_keys(shard), *(layout.data_key(r.name, subject) for r in rules)]
    args = [b"" if now_us is None else b"%d" % now_us, region, nonce]
    for rule in rules:
        args += (b"%d" % rule.resolution_us, b"%d" % rule.buckets, b"%d" % rule.ring)
    return [b"%d" % len(keys), *keys, *args]


def decode_hit(reply: object, requests: Sequence[HitRequest]) -> list[Decision]:
    """Turn ``hit.lua``'s flat integer reply into one :class:`Decision` per request."""
    if not isinstance(reply, list):
        raise StorageError(f"unexpected reply from hit script: {reply!r}")
    if len(requests) == 1 and len(requests[0].rules) == 1 and len(reply) == 6 and reply[1] >= 0:
        r = rule_decision(requests[0].rules[0], reply[1], reply[2], reply[3], reply[4], reply[5])
        return [Decision(r.allowed, r.limit, r.remaining, r.retry_after, r.reset_after, r.rule, (r,))]
    out: list[Decision] = []
    i = 0
    try:
        for request in requests:
            i += 1  # request-level allowed flag; combine() recomputes it
            results = []
            reason = None
            for rule in request.rules:
                if reply[i] < 0:
                    reason = ESCROW_DENIALS.get(reply[i], "escrow: denied")
                results.append(rule_decision(rule, reply[i], reply[i + 1], reply[i + 2], reply[i + 3], reply[i + 4]))
                i += REPLY_PER_RULE
            decision = combine(results)
            if reason is not None:
                decision.error = reason
            out.append(decision)
    except (IndexError, TypeError) as exc:
        raise StorageError(f"malformed reply from hit script: {reply!r}") from exc
    return out


def pack_command(*parts: bytes) -> bytes:
    """RESP-encode a command whose arguments are already bytes."""
    chunks = [b"*%d\r\n" % len(parts)]
    for part in parts:
        chunks.append(b"$%d\r\n%b\r\n" % (len(part), part))
    return b"".join(chunks)
