"""Escrow mode: the global limit as rights that regions hold and pass on (a bounded counter).

The model is the bounded counter of Balegas et al. ("Extending Eventually
Consistent Cloud Databases for Enforcing Numeric Invariants", SRDS 2015) and
AntidoteDB's ``antidote_crdt_counter_b``, applied to a sliding window:

* Region ``p`` holds ``rights(p) = share(limit, p) + Σ_q T[q→p] - Σ_q T[p→q]``.
  :func:`share` splits the limit over the sorted regions, so the rights of all
  regions sum to the limit.
* ``T[q→p]`` is everything ``q`` ever gave ``p``: a G-counter entry that only
  ``q`` increments, and only out of its spare, so the state is a product of
  max-registers and replicates by max-merge (:func:`merge`). An entry is kept
  per limit in force when it was given (``T[q→p@L]``) and counts as that
  fraction of the current limit, so a region's rights keep their share of
  the limit when it changes.
* A region admits a request only if its own count in the window plus the cost
  fits its rights (:func:`decide`). Its own count needs nothing from other
  regions, so no delay, partition or clock skew can break the bound: at every
  instant the regions' own counts sum to at most the limit.
* A region's own count is kept in steps of ``resolution / k`` (:class:`Ledger`):
  every step that overlaps the window counts in full, except the oldest, which
  stops counting once the window has passed its last admission. Capacity freed
  as a region's own steps leave the window stays with that region. The step
  width is what escrow mode gives up in under-use (about ``1/(N*k)`` of the
  limit at saturation, ``N`` buckets per window).
* Every gossip round each region advertises its use and demand
  (:func:`advertise`) and gives part of its spare to regions whose
  demand-proportional target exceeds their rights (:func:`rebalance`).
* A limit change (SIGHUP) scales every region's rights to the new limit: a
  region that held 60% of the old limit holds (the floor of) 60% of the new
  one. Rights of regions at the same limit sum to that limit, less at most
  ``regions - 1`` units lost to the floors. While regions disagree on the
  limit, each holds its fraction of its own limit (the property tests hold
  every window to the largest limit in force). A region whose own count is
  above its new rights denies until its own steps leave the window.

Everything here is pure. ``geolimit.sim.escrow`` runs it between simulated regions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction

__all__ = [
    "Advert",
    "EscrowDecision",
    "EscrowState",
    "Ledger",
    "OwnBucket",
    "View",
    "advertise",
    "decide",
    "give",
    "merge",
    "net_received",
    "plan",
    "plan_round",
    "rebalance",
    "rights",
    "share",
    "spare_elsewhere",
    "targets",
]

Transfer = tuple[str, str, int]  # (giver, receiver, the giver's limit when it gave)
#: An advert older than this many buckets carries no demand (its region went quiet or is cut off).
DEMAND_BUCKETS = 2


def share(limit: int, regions: Sequence[str], region: str) -> int:
    """``region``'s part of ``limit`` before any transfer: an even split, the
    remainder going to the first regions in sorted order. Grows with ``limit``."""
    ordered = sorted(regions)
    index = ordered.index(region)
    return (limit + len(ordered) - 1 - index) // len(ordered)


@dataclass(frozen=True, slots=True)
class Advert:
    """What a region last said about one key: a register only that region writes.

    ``used`` is its own count in the window, ``demand`` the units per window it
    was asked for recently (admitted or not), both measured in ``bucket``.
    """

    version: int = 0
    used: int = 0
    demand: int = 0
    bucket: int = 0

    def key(self) -> tuple[int, int, int, int]:
        return (self.version, self.used, self.demand, self.bucket)


@dataclass(frozen=True)
class EscrowState:
    """The replicated escrow state of one (rule, subject): transfers and adverts."""

    transfers: Mapping[Transfer, int] = field(default_factory=dict)
    adverts: Mapping[str, Advert] = field(default_factory=dict)


def merge(a: EscrowState, b: EscrowState) -> EscrowState:
    """The join: max of every transfer entry, the newer advert of every region."""
    transfers = dict(a.transfers)
    for pair, amount in b.transfers.items():
        if amount > transfers.get(pair, 0):
            transfers[pair] = amount
    adverts = dict(a.adverts)
    for region, advert in b.adverts.items():
        mine = adverts.get(region)
        if mine is None or advert.key() > mine.key():
            adverts[region] = advert
    return EscrowState(transfers, adverts)


def rights(state: EscrowState, region: str, regions: Sequence[str], limit: int) -> int:
    """``region``'s rights under ``limit``, as this copy of the state knows them.

    A transfer made under limit ``L`` counts ``amount * limit / L``; the total is
    rounded down. A region's own copy holds all of its outgoing transfers (it
    wrote them) and at most what others gave it, so its view never exceeds its true rights.
    """
    return share(limit, regions, region) + math.floor(net_received(state, region) * limit)


def net_received(state: EscrowState, region: str) -> Fraction:
    """What ``region`` was given minus what it gave, as a fraction of the limit (a
    transfer of ``amount`` made under limit ``L`` is ``amount / L`` of it)."""
    net = Fraction(0)
    for (giver, to, made_under), amount in state.transfers.items():
        if giver == to or made_under <= 0:
            continue
        if to == region:
            net += Fraction(amount, made_under)
        elif giver == region:
            net -= Fraction(amount, made_under)
    return net


def give(state: EscrowState, giver: str, receiver: str, amount: int, limit: int) -> EscrowState:
    """``giver`` hands ``amount`` of its rights under ``limit`` to ``receiver``. The caller checks the spare."""
    if amount < 0 or giver == receiver or limit <= 0:
        raise ValueError(f"invalid transfer of {amount} from {giver!r} to {receiver!r} under limit {limit}")
    if amount == 0:
        return state
    key = (giver, receiver, limit)
    transfers = dict(state.transfers)
    transfers[key] = transfers.get(key, 0) + amount
    return EscrowState(transfers, state.adverts)


def advertise(state: EscrowState, region: str, used: int, demand: int, bucket: int, now_ms: int = 0) -> EscrowState:
    """A new advert of ``region``: its version is one above the last it knows, and at least
    ``now_ms`` (its clock): peers refuse versions further ahead of their clocks than the
    auth window, so a version a peer forged ahead is passed within that window."""
    old = state.adverts.get(region, Advert())
    adverts = dict(state.adverts)
    adverts[region] = Advert(max(old.version + 1, now_ms), used, demand, bucket)
    return EscrowState(state.transfers, adverts)


# -- a region's own window --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OwnBucket:
    """This region's own traffic in one bucket (never replicated)."""

    admitted: int = 0
    last_us: int = -1  # time of the latest admission, this region's clock
    requested: int = 0  # units asked for, admitted or not


@dataclass(frozen=True)
class Ledger:
    """A region's own traffic for one (rule, subject), in steps of ``resolution / steps``.

    ``steps`` sets how finely the region knows when its own admissions leave the
    window: each step is counted in full while it overlaps the window, so the
    coarser it is, the longer spent capacity stays unusable (the under-use of
    escrow mode, see docs/design.md).
    """

    window_us: int
    resolution_us: int
    steps: int = 1
    buckets: Mapping[int, OwnBucket] = field(default_factory=dict)  # step index -> own traffic

    @property
    def step_us(self) -> int:
        return self.resolution_us // self.steps

    @property
    def n(self) -> int:
        """Steps per window."""
        return self.window_us // self.step_us

    def counts(self, step: int, now_us: int) -> bool:
        """Whether ``step``'s admissions may still lie in the window ``[now - W, now]``: every
        step overlapping it (or newer) does, except an oldest step whose last admission the window has passed."""
        current = now_us // self.step_us
        if current - self.n < step:  # (a step ahead of now, after the clock stepped back, counts too)
            return True
        own = self.buckets.get(step)
        return step == current - self.n and own is not None and own.last_us >= now_us - self.window_us

    def used(self, now_us: int) -> int:
        """Own admissions that may still lie in the window ending at ``now_us``."""
        return sum(own.admitted for b, own in self.buckets.items() if self.counts(b, now_us))

    def stable_us(self, now_us: int) -> int:
        """Until the oldest own step that counts at ``now_us`` stops counting (the window when
        none does): with no new traffic and no rights moved, what the region may admit cannot grow before."""
        exits = [
            max(own.last_us + self.window_us + 1, (b + self.n) * self.step_us)
            for b, own in self.buckets.items() if own.admitted and self.counts(b, now_us)
        ]
        return min(exits) - now_us if exits else self.window_us

    def demand(self, now_us: int) -> int:
        """Units per window asked for (admitted or not) over the current and the previous bucket, scaled."""
        since = (now_us // self.resolution_us - 1) * self.resolution_us
        asked = sum(own.requested for b, own in self.buckets.items() if b * self.step_us >= since)
        return -(-asked * self.window_us // max(1, now_us - since))

    def pruned(self, now_us: int) -> Ledger:
        """Without the steps that can no longer count or feed the demand estimate."""
        oldest = min(now_us // self.step_us - self.n, (now_us // self.resolution_us - 1) * self.steps)
        return replace(self, buckets={b: o for b, o in self.buckets.items() if b >= oldest})


@dataclass(frozen=True, slots=True)
class EscrowDecision:
    allowed: bool
    used: int  # own count after this request
    rights: int
    retry_after_us: int  # 0 when allowed; -1 when the cost exceeds the limit


def decide(
    ledger: Ledger, rights_now: int, now_us: int, cost: int, limit: int, *, rights_wait_us: int | None = None,
) -> tuple[EscrowDecision, Ledger]:
    """Admit ``cost`` if the region's own count plus the cost fits its rights.

    ``retry_after`` is the earliest moment at which the region's own buckets free
    enough, or ``rights_wait_us`` (the caller's estimate of when transfers can
    arrive, when peers hold spare) if that is sooner.
    """
    ledger = ledger.pruned(now_us)
    used = ledger.used(now_us)
    allowed = cost <= limit and used + cost <= rights_now
    b = now_us // ledger.step_us
    own = ledger.buckets.get(b, OwnBucket())
    if allowed and cost > 0:  # (a request of cost 0 leaves no trace in the window)
        own = OwnBucket(own.admitted + cost, now_us, own.requested + cost)
        used += cost
    else:
        own = OwnBucket(own.admitted, own.last_us, own.requested + cost)
    buckets = dict(ledger.buckets)
    buckets[b] = own
    after = replace(ledger, buckets=buckets)
    retry = 0 if allowed else _retry_us(after, rights_now, now_us, cost, limit, rights_wait_us)
    return EscrowDecision(allowed, used, rights_now, retry), after


def _retry_us(ledger: Ledger, rights_now: int, now_us: int, cost: int, limit: int, wait: int | None) -> int:
    if cost > limit:
        return -1
    best = wait
    # Own buckets leave the window in order, each 1 us after its last admission is W old.
    remaining = ledger.used(now_us)
    for b in sorted(b for b in ledger.buckets if ledger.counts(b, now_us)):
        own = ledger.buckets[b]
        remaining -= own.admitted
        if own.admitted and remaining + cost <= rights_now:
            at = max(own.last_us + ledger.window_us + 1, (b + ledger.n) * ledger.step_us) - now_us
            best = at if best is None else min(best, at)
            break
    return ledger.window_us if best is None else max(1, best)


# -- rebalancing ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class View:
    """What the deciding region knows of one region: rights, use and demand."""

    rights: int
    used: int
    demand: int


def views(
    state: EscrowState, me: str, regions: Sequence[str], limit: int, my_used: int, my_demand: int, bucket: int,
    n: int,
) -> dict[str, View]:
    """Every region as ``me`` sees it: its own figures exact, the others' from their adverts
    (demand only while fresh, use only while the advert's bucket can still be in the window)."""
    out: dict[str, View] = {}
    for region in regions:
        if region == me:
            out[region] = View(rights(state, me, regions, limit), my_used, my_demand)
            continue
        ad = state.adverts.get(region, Advert())
        age = bucket - ad.bucket
        demand = ad.demand if ad.version and age <= DEMAND_BUCKETS else 0
        used = ad.used if ad.version and age <= n else 0
        out[region] = View(rights(state, region, regions, limit), used, demand)
    return out


def targets(seen: Mapping[str, View], initial: Mapping[str, int]) -> dict[str, int]:
    """How many rights each region should hold: the rights in play split in proportion
    to demand (never below a region's use); with no demand anywhere, the initial split."""
    pool = sum(v.rights for v in seen.values())
    asked = sum(v.demand for v in seen.values())
    if asked == 0:
        return {r: max(v.used, min(initial[r], pool)) for r, v in seen.items()}
    return {r: max(v.used, pool * v.demand // asked) for r, v in seen.items()}


def plan(seen: Mapping[str, View], goal: Mapping[str, int], minimum: int = 1) -> dict[tuple[str, str], int]:
    """Transfers from regions above their target to regions below it, largest first.

    Every region that computes this from the same views gets the same matrix and
    carries out its own row; diverging views only make a transfer land a round late.
    """
    givers = sorted(
        ((r, min(v.rights - goal[r], v.rights - v.used)) for r, v in seen.items()), key=lambda x: (-x[1], x[0])
    )
    takers = sorted(((r, goal[r] - v.rights) for r, v in seen.items()), key=lambda x: (-x[1], x[0]))
    give_left = [(r, n) for r, n in givers if n > 0]
    take_left = [(r, n) for r, n in takers if n > 0]
    out: dict[tuple[str, str], int] = {}
    gi = ti = 0
    g_rest = give_left[0][1] if give_left else 0
    t_rest = take_left[0][1] if take_left else 0
    while gi < len(give_left) and ti < len(take_left):
        amount = min(g_rest, t_rest)
        if amount >= minimum:
            out[(give_left[gi][0], take_left[ti][0])] = amount
        g_rest -= amount
        t_rest -= amount
        if g_rest == 0:
            gi += 1
            g_rest = give_left[gi][1] if gi < len(give_left) else 0
        if t_rest == 0:
            ti += 1
            t_rest = take_left[ti][1] if ti < len(take_left) else 0
    return out


def spare_elsewhere(state: EscrowState, me: str, limit: int, rights_me: int, bucket: int, n: int) -> int:
    """Rights the other regions hold unused, as ``me`` sees them: the limit less its own
    rights less the others' advertised use (adverts of the last ``n`` buckets)."""
    spare = limit - rights_me
    for region, ad in state.adverts.items():
        if region != me and ad.version and bucket - ad.bucket <= n:
            spare -= ad.used
    return spare


def rebalance(
    state: EscrowState, me: str, regions: Sequence[str], limit: int, ledger: Ledger, now_us: int,
    live: Iterable[str], minimum: int = 1,
) -> tuple[EscrowState, dict[str, int]]:
    """One round for ``me``: advertise its use and demand, then give its row of the plan
    to live regions, never more than its spare (rights minus own use) at this instant."""
    return plan_round(
        state, me, regions, limit, ledger.used(now_us), ledger.demand(now_us), now_us // ledger.resolution_us,
        ledger.window_us // ledger.resolution_us, live, minimum,
    )


def plan_round(
    state: EscrowState, me: str, regions: Sequence[str], limit: int, used: int, demand: int, bucket: int, n: int,
    live: Iterable[str], minimum: int = 1,
) -> tuple[EscrowState, dict[str, int]]:
    """:func:`rebalance` from ``me``'s own use and demand in ``bucket`` (``n`` buckets per window)."""
    state = advertise(state, me, used, demand, bucket)
    members = [r for r in regions if r == me or r in set(live)]
    seen = views(state, me, regions, limit, used, demand, bucket, n)
    seen = {r: seen[r] for r in members}
    initial = {r: share(limit, regions, r) for r in members}
    spare = rights(state, me, regions, limit) - used
    given: dict[str, int] = {}
    for (giver, receiver), amount in plan(seen, targets(seen, initial), minimum).items():
        amount = min(amount, spare)
        if giver != me or amount <= 0:
            continue
        state = give(state, me, receiver, amount, limit)
        spare -= amount
        given[receiver] = amount
    return state, given
