"""Escrow mode's pure model: the state is a join semilattice, rights are conserved, and
no interleaving of hits, merges, transfers, partitions, delays or skewed clocks
admits more than the limit in any true window."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geolimit.core.escrow import (
    Advert,
    EscrowState,
    Ledger,
    View,
    decide,
    give,
    merge,
    plan,
    rebalance,
    rights,
    share,
    targets,
)

REGIONS = ["a", "b", "c"]
RES = 1_000  # us: small numbers keep the examples readable
WINDOW = 10 * RES

adverts = st.builds(Advert, st.integers(0, 5), st.integers(0, 9), st.integers(0, 9), st.integers(0, 3))
transfers = st.tuples(
    st.sampled_from(REGIONS), st.sampled_from(REGIONS), st.sampled_from([5, 9, 30])
).filter(lambda t: t[0] != t[1])
states = st.builds(
    EscrowState,
    st.dictionaries(transfers, st.integers(1, 30), max_size=6),
    st.dictionaries(st.sampled_from(REGIONS), adverts, max_size=3),
)


@given(states, states)
def test_merge_is_commutative(a: EscrowState, b: EscrowState) -> None:
    assert merge(a, b) == merge(b, a)


@given(states, states, states)
def test_merge_is_associative(a: EscrowState, b: EscrowState, c: EscrowState) -> None:
    assert merge(merge(a, b), c) == merge(a, merge(b, c))


@given(states)
def test_merge_is_idempotent(a: EscrowState) -> None:
    assert merge(a, a) == EscrowState(dict(a.transfers), dict(a.adverts))


@given(st.integers(0, 10_000), st.integers(1, 7))
def test_shares_split_the_limit_and_grow_with_it(limit: int, n: int) -> None:
    names = [f"r{i}" for i in range(n)]
    assert sum(share(limit, names, r) for r in names) == limit
    assert all(share(limit + 1, names, r) >= share(limit, names, r) for r in names)
    assert max(share(limit, names, r) for r in names) - min(share(limit, names, r) for r in names) <= 1


def test_a_transfer_moves_rights_from_the_giver_to_the_receiver() -> None:
    s = give(EscrowState(), "a", "b", 3, 9)
    assert [rights(s, r, REGIONS, 9) for r in REGIONS] == [0, 6, 3]
    s = give(s, "b", "a", 1, 9)  # entries only grow: b's gift is another entry
    assert s.transfers == {("a", "b", 9): 3, ("b", "a", 9): 1}
    assert [rights(s, r, REGIONS, 9) for r in REGIONS] == [1, 5, 3]


def test_the_oldest_step_stops_counting_once_the_window_passed_its_last_admission() -> None:
    ledger = Ledger(WINDOW, RES)
    t0 = 50 * RES
    d, ledger = decide(ledger, 2, t0 + 100, 1, 10)
    d, ledger = decide(ledger, 2, t0 + 300, 1, 10)
    assert d.allowed
    assert d.used == 2
    d, ledger = decide(ledger, 2, t0 + 500, 1, 10)
    assert not d.allowed
    # Both admissions are in the oldest bucket of the window ending at t0 + W + 300 ...
    assert ledger.used(t0 + WINDOW + 300) == 2
    # ... and one microsecond later the window has passed the last of them.
    assert ledger.used(t0 + WINDOW + 301) == 0
    assert d.retry_after_us == WINDOW + 301 - 500


def test_a_region_never_gives_away_rights_its_window_still_uses() -> None:
    ledger = Ledger(WINDOW, RES)
    now = 50 * RES
    for _ in range(3):
        _, ledger = decide(ledger, 3, now, 1, 9)  # b uses all 3 of its rights
    s = EscrowState(adverts={"a": Advert(1, 3, 90, 50)})  # a is busy
    s, given = rebalance(s, "b", REGIONS, 9, ledger, now + 10, {"a", "c"})
    assert given == {}
    assert rights(s, "b", REGIONS, 9) == 3
    # Once its admissions leave the window, the capacity is b's again, and b can give it.
    s = merge(s, EscrowState(adverts={"a": Advert(2, 3, 90, 60)}))
    s, given = rebalance(s, "b", REGIONS, 9, ledger, now + WINDOW + 1, {"a", "c"})
    assert given == {"a": 3}


def test_a_busy_region_is_given_the_idle_regions_spare() -> None:
    seen = {"a": View(rights=4, used=4, demand=50), "b": View(3, 0, 0), "c": View(3, 1, 0)}
    goal = targets(seen, {"a": 4, "b": 3, "c": 3})
    assert goal == {"a": 10, "b": 0, "c": 1}
    assert plan(seen, goal) == {("b", "a"): 3, ("c", "a"): 2}


def test_a_limit_change_scales_every_regions_rights() -> None:
    s = give(EscrowState(), "b", "a", 3, 9)  # b gave a all of its 3 of 9
    assert [rights(s, r, REGIONS, 9) for r in REGIONS] == [6, 0, 3]
    assert [rights(s, r, REGIONS, 30) for r in REGIONS] == [20, 0, 10]  # the same thirds of 30
    assert [rights(s, r, REGIONS, 3) for r in REGIONS] == [2, 0, 1]  # ... and of 3
    # Later transfers under the new limit add to the scaled ones.
    s = give(s, "c", "a", 4, 30)
    assert [rights(s, r, REGIONS, 30) for r in REGIONS] == [24, 0, 6]
    assert [rights(s, r, REGIONS, 9) for r in REGIONS] == [7, 0, 1]  # 6 + 4*9/30 = 7.2, 3 - 1.2 = 1.8: floors
    assert 9 - 2 <= sum(rights(s, r, REGIONS, 9) for r in REGIONS) <= 9


# -- any interleaving ------------------------------------------------------------------


@dataclass
class Region:
    name: str
    offset: int  # its clock minus the true time, us
    limit: int
    state: EscrowState = field(default_factory=EscrowState)
    ledger: Ledger = field(default_factory=lambda: Ledger(WINDOW, RES))


hit = st.tuples(st.just("hit"), st.sampled_from(REGIONS), st.integers(1, 3))
# Small steps, and jumps to around one window later (where the oldest step leaves the window).
tick = st.tuples(st.just("tick"), st.one_of(st.integers(1, RES), st.integers(WINDOW - RES, WINDOW + RES)))
# A gossip round (live peers: the ones it may give to), then its messages are in flight.
live = st.one_of(st.just(set(REGIONS)), st.sets(st.sampled_from(REGIONS)))
round_ = st.tuples(st.just("round"), st.sampled_from(REGIONS), live)
deliver = st.tuples(st.just("deliver"), st.integers(0, 50), st.booleans())  # any message, maybe kept for a duplicate
flush = st.tuples(st.just("flush"))  # everything in flight arrives, in order
resize = st.tuples(st.just("limit"), st.sampled_from(REGIONS), st.integers(0, 12))
step = st.one_of(hit, hit, hit, tick, tick, round_, round_, round_, deliver, deliver, flush)


def run(limit: int, steps_per_bucket: int, offsets: list[int], schedule: list[tuple], resizes: bool) -> None:  # type: ignore[type-arg]
    regions = {
        n: Region(n, off, limit, ledger=Ledger(WINDOW, RES, steps_per_bucket))
        for n, off in zip(REGIONS, offsets, strict=True)
    }
    now = 1_000 * RES  # true time
    admitted: list[tuple[int, int]] = []  # (true time, cost)
    limits_seen = [limit]
    in_flight: list[tuple[str, EscrowState]] = []  # (receiver, a snapshot of the sender's state)
    everything = EscrowState()
    for action in schedule:
        kind = action[0]
        if kind == "tick":
            now += action[1]
        elif kind == "limit":
            regions[action[1]].limit = action[2]
            limits_seen.append(action[2])
        elif kind == "hit":
            r = regions[action[1]]
            held = rights(r.state, r.name, REGIONS, r.limit)
            d, r.ledger = decide(r.ledger, held, now + r.offset, action[2], r.limit)
            if d.allowed:
                admitted.append((now, action[2]))
                in_window = sum(c for t, c in admitted if t >= now - WINDOW)
                bound = max(limits_seen) if resizes else limit
                assert in_window <= bound, (in_window, bound)
        elif kind == "round":
            r = regions[action[1]]
            r.state, _ = rebalance(r.state, r.name, REGIONS, r.limit, r.ledger, now + r.offset, action[2] - {r.name})
            in_flight.extend((peer, r.state) for peer in REGIONS if peer != r.name)
            everything = merge(everything, r.state)
        elif kind == "deliver" and in_flight:
            i = action[1] % len(in_flight)
            to, state = in_flight[i] if action[2] else in_flight.pop(i)
            regions[to].state = merge(regions[to].state, state)
        elif kind == "flush":
            for to, state in in_flight:
                regions[to].state = merge(regions[to].state, state)
            in_flight.clear()
        # Rights are conserved in the join of every state ever produced (what every copy and
        # every message is made of), and no region believes it holds more than its share of it.
        if not resizes:
            assert sum(rights(everything, n, REGIONS, limit) for n in REGIONS) == limit
        else:  # the floors of the scaled transfers may leave up to regions - 1 units unassigned
            at = max(r.limit for r in regions.values())
            assert at - len(REGIONS) < sum(rights(everything, n, REGIONS, at) for n in REGIONS) <= at
        for r in regions.values():
            assert rights(r.state, r.name, REGIONS, r.limit) <= rights(everything, r.name, REGIONS, r.limit)


SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    st.integers(1, 8),
    st.sampled_from([1, 2, 4]),
    st.lists(st.integers(-2 * RES, 2 * RES), min_size=3, max_size=3),
    st.lists(step, min_size=20, max_size=150),
)
def test_no_interleaving_admits_more_than_the_limit_in_any_window(
    limit: int, steps_per_bucket: int, offsets: list[int], schedule: list[tuple]  # type: ignore[type-arg]
) -> None:
    run(limit, steps_per_bucket, offsets, schedule, resizes=False)


@SETTINGS
@given(
    st.integers(1, 12),
    st.lists(st.integers(-2 * RES, 2 * RES), min_size=3, max_size=3),
    st.lists(st.one_of(step, resize), min_size=20, max_size=150),
)
def test_limit_changes_never_admit_more_than_the_largest_limit_in_force(
    limit: int, offsets: list[int], schedule: list[tuple]  # type: ignore[type-arg]
) -> None:
    run(limit, 1, offsets, schedule, resizes=True)
