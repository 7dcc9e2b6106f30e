"""From a rate limit request to script calls, and from their replies to the answer (no I/O).

One Envoy request becomes one *transaction*: ``hit.lua`` requests (one per shard
and cost for the enforced descriptors, all-or-nothing each; one per shadow
descriptor, independent) that :mod:`geolimit.server.rls.script` decides
together: nothing is consumed unless every enforced descriptor is within its
limit. Several transactions share one script call (:func:`encode_batch`), each
decided in turn.

Descriptors that name the same counter (same limit, same entries) are counted
once, with their costs added.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from geolimit.core.decision import Decision, RuleDecision, combine
from geolimit.core.keys import KeyLayout
from geolimit.core.rule import Rule
from geolimit.errors import RequestError, StorageError
from geolimit.http.headers import rate_limit_headers
from geolimit.server.rls.descriptors import Domain, Limit, match, subject_of
from geolimit.store.protocol import MAX_COST, REPLY_PER_RULE, HitRequest, RulePlan, bulk, decode_hit

__all__ = [
    "MAX_DESCRIPTORS", "MAX_ENTRIES", "Answer", "Descriptor", "Result", "Status", "Transaction", "answer",
    "decode_batch", "degraded", "encode_batch", "encode_batch_resp", "plan",
]

#: Descriptors per request, and entries per descriptor, that the service accepts.
MAX_DESCRIPTORS = 64
MAX_ENTRIES = 32
#: ``limit_remaining`` of an unlimited descriptor (envoyproxy/ratelimit sends the same).
UNLIMITED_REMAINING = 2**32 - 1

Result = Literal["ok", "over_limit", "shadow_over_limit", "unlimited", "no_limit"]


@dataclass(frozen=True, slots=True)
class Descriptor:
    """One descriptor of a request: its entries and its cost (``hits_addend``)."""

    entries: tuple[tuple[str, str], ...]
    cost: int


@dataclass(slots=True)
class Transaction:
    """The script work of one request, and where each descriptor's outcome will be."""

    domain: str
    limits: list[Limit | None]  # per descriptor, after ``replaces``
    metrics: list[str]  # per descriptor: the metric name of its limit
    requests: list[HitRequest]
    enforced: list[bool]  # per request
    places: list[tuple[int, int] | None]  # per descriptor: (request, rule) of its result

    @property
    def shards(self) -> set[int]:
        return {r.shard for r in self.requests}


@dataclass(frozen=True, slots=True)
class Status:
    """The outcome of one descriptor (``DescriptorStatus``)."""

    result: Result
    limit: Limit | None  # the current limit (None: no limit applies, or unlimited)
    remaining: int
    reset_after: float | None
    metric: str

    @property
    def over_limit(self) -> bool:
        return self.result == "over_limit"


@dataclass(frozen=True, slots=True)
class Answer:
    over_limit: bool
    statuses: list[Status]
    headers: list[tuple[str, str]]


def plan(domain: Domain | None, name: str, descriptors: Sequence[Descriptor], layout: KeyLayout,
         plans: dict[str, RulePlan]) -> Transaction:
    """The transaction of one request (``plans`` caches each rule's encoded arguments)."""
    if not 1 <= len(descriptors) <= MAX_DESCRIPTORS:
        raise RequestError(f"a request holds 1 to {MAX_DESCRIPTORS} descriptors, got {len(descriptors)}")
    limits: list[Limit | None] = []
    metrics: list[str] = []
    for i, d in enumerate(descriptors):
        if not 1 <= len(d.entries) <= MAX_ENTRIES:
            raise RequestError(f"descriptors[{i}] holds {len(d.entries)} entries; 1 to {MAX_ENTRIES} are accepted")
        if not 0 <= d.cost <= MAX_COST:
            raise RequestError(f"descriptors[{i}].hits_addend must be at most 2**46 ({MAX_COST}), got {d.cost}")
        limit = match(domain, d.entries) if domain is not None else None
        limits.append(limit)
        metrics.append(_metric(limit, d.entries) if limit is not None else f"{name}.{d.entries[0][0]}")
    replaced = {n for limit in limits if limit is not None for n in limit.replaces}
    if replaced:
        limits = [None if limit is not None and limit.name in replaced else limit for limit in limits]
    if len(descriptors) == 1:  # the common request: what the general case below makes, without its tables
        limit = limits[0]
        if limit is None or limit.rule is None:
            return Transaction(name, limits, metrics, [], [], [None])
        subject = subject_of(descriptors[0].entries)
        shard = layout.shard_of(subject)
        request = _request(layout, shard, descriptors[0].cost, [(_rule_plan(plans, limit.rule), subject)])
        return Transaction(name, limits, metrics, [request], [not limit.shadow], [(0, 0)])
    # One counter per (rule, subject), costs added; then hit.lua requests per shard and cost.
    units: dict[tuple[str, bytes], list[int]] = {}  # -> [cost, *descriptor indexes]
    for i, (d, limit) in enumerate(zip(descriptors, limits, strict=True)):
        if limit is not None and limit.rule is not None:
            unit = units.setdefault((limit.rule.name, subject_of(d.entries)), [0])
            unit[0] += d.cost
            unit.append(i)
    groups: dict[tuple[int, int, int], list[tuple[RulePlan, bytes, list[int]]]] = {}
    for n, ((_, subject), (cost, *indexes)) in enumerate(units.items()):
        limit = limits[indexes[0]]
        assert limit is not None
        assert limit.rule is not None
        rule_plan = _rule_plan(plans, limit.rule)
        shard = layout.shard_of(subject)
        # Shadow counters are requests of their own: they never deny the others.
        group = (shard, min(cost, MAX_COST), -1 if not limit.shadow else n)
        groups.setdefault(group, []).append((rule_plan, subject, indexes))
    requests: list[HitRequest] = []
    enforced: list[bool] = []
    places: list[tuple[int, int] | None] = [None] * len(descriptors)
    for (shard, cost, shadow), members in groups.items():
        for j, (_, _, indexes) in enumerate(members):
            for i in indexes:
                places[i] = (len(requests), j)
        requests.append(_request(layout, shard, cost, [(p, s) for p, s, _ in members]))
        enforced.append(shadow < 0)
    return Transaction(name, limits, metrics, requests, enforced, places)


def _rule_plan(plans: dict[str, RulePlan], rule: Rule) -> RulePlan:
    rule_plan = plans.get(rule.name)
    if rule_plan is None or rule_plan.rule is not rule:  # a reload makes new rules
        rule_plan = plans[rule.name] = RulePlan.of(rule)
    return rule_plan


def _metric(limit: Limit, entries: Sequence[tuple[str, str]]) -> str:
    key, value = entries[-1]
    if limit.detailed_metric and not limit.full_key.endswith(f"{key}_{value}"):
        return f"{limit.full_key}_{value}"
    return limit.full_key


_CONSUME = bulk(b"1")  # also: one member
_PEEK = bulk(b"0")


def _request(layout: KeyLayout, shard: int, cost: int, members: Sequence[tuple[RulePlan, bytes]]) -> HitRequest:
    """A ``hit.lua`` request over several (rule, subject) counters of one shard, consuming nothing.

    ``resp_args`` starts with the peek flag (``0``): :func:`encode_batch_resp` swaps it
    for a transaction of one request.
    """
    tag = layout.tag(shard) + b":"
    aux = layout.aux_keys(shard)
    if len(members) == 1:  # the usual request: the same as below, with fewer steps
        p, subject = members[0]
        key = tag + p.name + b":" + subject
        counted = b"%d" % cost
        return HitRequest((p.rule,), shard, (*aux, key), (b"0", counted, b"1", *p.args),
                          _aux_resp(aux) + bulk(key), b"".join((_PEEK, bulk(counted), _CONSUME, p.resp)))
    data = tuple(tag + p.name + b":" + subject for p, subject in members)
    head: tuple[bytes, ...] = (b"0", b"%d" % cost, b"%d" % len(members))
    args = head
    for p, _ in members:
        args += p.args
    resp_keys = b"".join([_aux_resp(aux), *map(bulk, data)])
    resp_args = b"".join([*map(bulk, head), *(p.resp for p, _ in members)])
    return HitRequest(tuple(p.rule for p, _ in members), shard, aux + data, args, resp_keys, resp_args)


_AUX_RESP: dict[tuple[bytes, ...], bytes] = {}


def _aux_resp(aux: tuple[bytes, ...]) -> bytes:
    """A shard's auxiliary keys, RESP-encoded (cached: a layout has a few hundred shards at most)."""
    resp = _AUX_RESP.get(aux)
    if resp is None:
        resp = b"".join(map(bulk, aux))
        if len(_AUX_RESP) < 4096:
            _AUX_RESP[aux] = resp
    return resp


def encode_batch_resp(transactions: Sequence[Transaction], now_us: int | None, region: bytes,
                      nonce: bytes) -> tuple[int, bytes]:
    """:func:`encode_batch` as ``(argument count, RESP body)``, from the requests' pre-encoded
    keys and arguments (the rules' arguments are encoded once, in their :class:`RulePlan`)."""
    key_parts: list[bytes] = []
    nkeys = 0
    arg_parts: list[bytes] = [bulk(b"" if now_us is None else b"%d" % now_us), bulk(region), bulk(nonce),
                              bulk(b"%d" % len(transactions))]
    nargs = 4
    for tx in transactions:
        meta: list[bytes] = []
        body: list[bytes] = []
        nbody = 0
        tx_keys = 0
        reply_at = 1
        single = len(tx.requests) == 1 and not any(rule.escrow for rule in tx.requests[0].rules)
        for request, enforced in zip(tx.requests, tx.enforced, strict=True):
            meta += (_CONSUME if enforced else _PEEK, bulk(b"%d" % (5 + nbody)), bulk(b"%d" % reply_at))
            # one pass, consuming (script.py): the consume flag is the first argument
            body.append(_CONSUME + request.resp_args[len(_PEEK):] if single else request.resp_args)
            nbody += len(request.args)
            key_parts.append(request.resp_keys)
            tx_keys += len(request.keys)
            reply_at += 1 + REPLY_PER_RULE * len(request.rules)
        nkeys += tx_keys
        arg_parts += (bulk(b"%d" % tx_keys), bulk(b"%d" % len(tx.requests)), bulk(b"%d" % nbody), *meta, *body)
        nargs += 3 + len(meta) + nbody
    return 1 + nkeys + nargs, b"".join([bulk(b"%d" % nkeys), *key_parts, *arg_parts])


def encode_batch(transactions: Sequence[Transaction], now_us: int | None, region: bytes, nonce: bytes) -> list[bytes]:
    """EVALSHA arguments (after the SHA) of the RLS script for ``transactions``.

    ARGV: now_us|'', region, nonce, count, then per transaction: its number of
    keys, of requests and of request arguments, per request (enforced, where its
    consume flag sits in hit.lua's ARGV, where its flag sits in hit.lua's reply),
    then the requests' own arguments.
    """
    keys: list[bytes] = []
    args: list[bytes] = [b"" if now_us is None else b"%d" % now_us, region, nonce, b"%d" % len(transactions)]
    for tx in transactions:
        meta: list[bytes] = []
        body: list[bytes] = []
        nkeys = 0
        reply_at = 1
        single = len(tx.requests) == 1 and not any(rule.escrow for rule in tx.requests[0].rules)
        for request, enforced in zip(tx.requests, tx.enforced, strict=True):
            meta += (b"1" if enforced else b"0", b"%d" % (5 + len(body)), b"%d" % reply_at)
            body += (b"1", *request.args[1:]) if single else request.args  # one pass, consuming (script.py)
            keys += request.keys
            nkeys += len(request.keys)
            reply_at += 1 + REPLY_PER_RULE * len(request.rules)
        args += (b"%d" % nkeys, b"%d" % len(tx.requests), b"%d" % len(body), *meta, *body)
    return [b"%d" % len(keys), *keys, *args]


def decode_batch(reply: object, transactions: Sequence[Transaction]) -> list[list[Decision]]:
    """Per transaction, the decision of each of its requests."""
    if not isinstance(reply, list):
        raise StorageError(f"unexpected reply from the RLS script: {reply!r:.200}")
    out: list[list[Decision]] = []
    i = 0
    for tx in transactions:
        i += 1  # the transaction's own flag; answer() recomputes it
        decisions = []
        for request in tx.requests:
            size = 1 + REPLY_PER_RULE * len(request.rules)
            decisions += decode_hit(reply[i : i + size], [request])
            i += size
        out.append(decisions)
    return out


def answer(tx: Transaction, decisions: Sequence[Decision]) -> Answer:
    """Statuses, overall code and headers of a decided transaction."""
    if len(tx.limits) == 1 and tx.places[0] is not None:  # the usual request: as below, in fewer steps
        limit = tx.limits[0]
        assert limit is not None
        at = tx.places[0]
        result = decisions[at[0]].results[at[1]]
        if result.allowed:
            status = Status("ok", limit, min(result.remaining, UNLIMITED_REMAINING), result.reset_after, tx.metrics[0])
        else:
            status = Status("shadow_over_limit" if limit.shadow else "over_limit", limit, 0, result.reset_after,
                            tx.metrics[0])
        return Answer(status.over_limit, [status], [] if limit.shadow else rate_limit_headers(combine([result])))
    statuses: list[Status] = []
    shown: dict[tuple[int, int], RuleDecision] = {}
    for limit, place, metric in zip(tx.limits, tx.places, tx.metrics, strict=True):
        if limit is None:
            statuses.append(Status("no_limit", None, 0, None, metric))
        elif limit.rule is None:
            statuses.append(Status("unlimited", None, UNLIMITED_REMAINING, None, metric))
        else:
            assert place is not None
            result = decisions[place[0]].results[place[1]]
            if not limit.shadow:
                shown[place] = result
            if result.allowed:
                status = Status("ok", limit, min(result.remaining, UNLIMITED_REMAINING), result.reset_after, metric)
            elif limit.shadow:
                status = Status("shadow_over_limit", limit, 0, result.reset_after, metric)
            else:
                status = Status("over_limit", limit, 0, result.reset_after, metric)
            statuses.append(status)
    headers = rate_limit_headers(combine(list(shown.values()))) if shown else []
    return Answer(any(s.over_limit for s in statuses), statuses, headers)


def degraded(tx: Transaction, allowed: bool) -> Answer:
    """The answer when Redis cannot be reached and the agent's ``on_error`` is allow or deny."""
    statuses: list[Status] = []
    for limit, metric in zip(tx.limits, tx.metrics, strict=True):
        if limit is None:
            statuses.append(Status("no_limit", None, 0, None, metric))
        elif limit.rule is None:
            statuses.append(Status("unlimited", None, UNLIMITED_REMAINING, None, metric))
        elif allowed or limit.shadow:
            statuses.append(Status("ok", limit, limit.rule.limit if allowed else 0, None, metric))
        else:
            retry = limit.rule.resolution_us / 1e6
            statuses.append(Status("over_limit", limit, 0, retry, metric))
    over = any(s.over_limit for s in statuses)
    headers = [("Retry-After", str(max(1, math.ceil(max(s.reset_after or 0 for s in statuses)))))] if over else []
    return Answer(over, statuses, headers)
