"""Prediction never makes retry_after lie: a client that waits it out is admitted.

Prediction reserves units for what peers probably admitted since their last
update. With no new traffic that reserve is gone once the peers' counts are
``partition_after`` old, so ``retry_after`` is at most that, or when the window
alone admits the request. The model decides as ``hit.lua`` does (pinned by
tests/store/test_policy_lua_matches_model.py, which covers these paths).
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from geolimit import Rule
from geolimit.core.gcounter import Cell
from geolimit.core.model import ModelStore
from geolimit.core.window import SUBSTEPS, evaluate

T0 = 1_700_000_000_000_000
SECOND = 1_000_000
#: A rule, east's hits ``(count, seconds ago)``, north's own and when: what the properties draw.
SCHEDULES = dict(
    limit=st.integers(1, 30),
    buckets=st.integers(1, 6),
    after_ms=st.integers(100, 3000),
    peer_hits=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 8)), max_size=4),
    own=st.integers(0, 20),
    age_us=st.integers(1, 3 * SECOND),
    into=st.integers(0, SECOND - 1),
)


def region(rule: Rule, peer_hits: list[tuple[int, int]], known_age_us: int, now: int) -> ModelStore:
    """This region, having heard of ``(hits, seconds ago)`` from peer "east", whose counts are ``known_age_us`` old.

    Each of east's updates came a tenth of a second after its previous one; those
    it sent after its counts were last current (``ago`` at most the age) are what
    prediction reserves for.
    """
    model = ModelStore("north", regions=3)
    totals: dict[int, int] = {}
    for hits, ago in sorted(peer_hits, key=lambda h: -h[1]):  # oldest first
        bucket = (now - ago * SECOND) // rule.resolution_us
        totals[bucket] = totals.get(bucket, 0) + hits
        model.merge(rule.name, b"u", {bucket: {"east/i1": Cell(totals[bucket] * SUBSTEPS, 0)}},
                    now_us=now - ago * SECOND, gap_us=SECOND // 10)
    model.peer_known = {"east": now - known_age_us, "west": now}
    return model


def test_a_fresh_peer_burst_denies_for_at_most_the_prediction_not_the_window() -> None:
    """East took 6 of 10/60s 0.4 s ago: north waits at most the prediction (partition_after), not the 60 s window."""
    rule = Rule("otp", 10, 60, 1)
    now = T0 + 100_000
    model = region(rule, [(6, 0)], known_age_us=400_000, now=now)
    model.hit([rule], b"u", 3, now - 10)  # north's own 3
    (first,) = model.hit([rule], b"u", 1, now, consume=False)
    assert not first.allowed, "6 + 3 + the predicted burst leave no room"
    assert 0 < first.retry_after_us <= rule.partition_after_us + SECOND // 10
    (later,) = model.hit([rule], b"u", 1, now + first.retry_after_us, consume=False)
    assert later.allowed, "waiting retry_after is enough when nothing new happens"


def test_news_that_a_peer_stopped_does_not_make_waiting_retry_after_too_short() -> None:
    """Approximate mode, as three real agents showed it: east's 6 were merged here after
    its counts were current (news travels), and east's later updates say it stopped. Its
    recent rise still counts until it is partition_after old, so retry_after reaches
    that far, and waiting it out is enough (before: denied again with a new retry_after)."""
    rule = Rule("api", 10, 60, 1, "approximate")
    now = T0 + 10 * SECOND + 300_000
    model = region(rule, [(6, 0)], known_age_us=100_000, now=now)  # merged now, counts 0.1 s old
    model.peer_known["west"] = now - 150_000  # west idle, its last update older still
    (first,) = model.hit([rule], b"u", 2, now + 70_000, consume=False)
    assert not first.allowed
    assert first.retry_after_us <= rule.partition_after_us + 1
    at = now + 70_000 + first.retry_after_us
    model.peer_known = {"east": at - 50_000, "west": at - 50_000}  # east's last update: nothing new
    (later,) = model.hit([rule], b"u", 2, at, consume=False)
    assert later.allowed, "waiting retry_after is enough, news of a stopped peer included"


@settings(max_examples=300, deadline=None)
@given(**SCHEDULES, cost=st.integers(1, 5), approx=st.booleans(), news=st.none() | st.floats(0.0, 1.0))
def test_retry_after_is_at_most_until_the_prediction_expires_and_then_enough(
    limit: int, buckets: int, after_ms: int, peer_hits: list[tuple[int, int]], own: int, age_us: int,
    into: int, cost: int, approx: bool, news: float | None,
) -> None:
    """With no new traffic: retry_after is at most the later of when the prediction
    expires and when the window alone admits the request, and waiting it out (or
    until the prediction expired, if later) is enough, whether or not the peers'
    updates (``news``: when, as a fraction of the wait) say that they stopped. In
    approximate mode news can also keep a peer in contact while room frees up, and
    its share of that room is then reserved for up to partition_after more.

    Not held: that it never points past the *first* admission. A peer's predicted
    rate can drop earlier (its recent buckets leave the window at a boundary), or
    the growing reserve can still fit before it expires; computing that instant
    needs the reserve re-evaluated at every bucket boundary, which is not done.
    """
    rule = Rule("api", limit, buckets, 1, "approximate" if approx else "strict", partition_after=after_ms / 1000)
    now = T0 + 10 * SECOND + into
    model = region(rule, peer_hits, age_us, now)
    if own:
        model.hit([rule], b"u", min(own, limit), now - 1)
    (got,) = model.hit([rule], b"u", cost, now, consume=False)
    if got.allowed or got.retry_after_us < 0:
        return
    retry = got.retry_after_us
    held = model.reservation(rule, b"u", now)
    window_only = evaluate(*model.sums(rule, b"u", now), now, cost, rule.limit, rule.resolution_us, approx, False,
                           held.units - held.predicted, model.firsts(rule, b"u", now))
    if held.predicted > 0:
        assert retry <= max(window_only.retry_after_us, held.predicted_until_us - now)
    wait = max(retry, held.predicted_until_us - now)
    if news is not None:  # the peers' last updates before the wait ends: no new admission
        heard = now + int(news * wait)
        model.peer_known = {p: max(t, heard) for p, t in model.peer_known.items()}
    if news is not None and approx:
        # Room the window frees while peers are in contact is split between the regions
        # (the contested room): a peer's share of it stays reserved while its counts
        # are at most partition_after old, news or not.
        wait += rule.partition_after_us + 1
    assert model.hit([rule], b"u", cost, now + wait, consume=False)[0].allowed, "waiting it out is enough"


def test_stable_for_is_cut_to_when_a_peers_prediction_ends() -> None:
    """East's counts are 0.4 s old (partition_after 0.5 s): the units predicted for it
    are gone 0.1 s + 1 us from now, and remaining grows then, long before north's
    own unit leaves the window."""
    rule = Rule("api", 20, 10, 1, partition_after=0.5)
    now = T0 + 10 * SECOND + 600_000
    model = region(rule, [(6, 0)], known_age_us=400_000, now=now)
    (got,) = model.hit([rule], b"u", 1, now)
    assert model.reservation(rule, b"u", now).predicted > 0
    assert got.stable_us == 100_001
    (later,) = model.hit([rule], b"u", 0, now + got.stable_us, consume=False)
    assert later.used < got.used, "the prediction has ended: remaining grew"


def test_stable_for_is_not_cut_for_a_peer_that_stopped() -> None:
    """East's 8 units rose 1 s ago, and its counts were current 0.3 s ago with no rise
    since: it stopped, nothing is predicted for it, and ``t`` runs until its bucket
    leaves the window (9.4 s), not to a bucket boundary or the end of a prediction."""
    rule = Rule("api", 30, 10, 1, partition_after=2.0)
    now = T0 + 10 * SECOND + 600_000
    model = region(rule, [(8, 1)], known_age_us=300_000, now=now)
    assert model.reservation(rule, b"u", now).units == 0
    (got,) = model.hit([rule], b"u", 1, now)
    assert got.stable_us == 9_400_000
    (before,) = model.hit([rule], b"u", 0, now + got.stable_us - 1, consume=False)
    (after,) = model.hit([rule], b"u", 0, now + got.stable_us, consume=False)
    assert before.used == got.used > after.used


@settings(max_examples=300, deadline=None)
@given(**SCHEDULES, cost=st.integers(0, 5), approx=st.booleans(), partition=st.sampled_from(["local", "share", "closed"]))
@example(limit=30, buckets=10, after_ms=2000, peer_hits=[(8, 1)], own=1, age_us=300_000, into=600_000, cost=1,
         approx=False, partition="share")
def test_remaining_cannot_grow_within_stable_for_while_peers_are_predicted_for(
    limit: int, buckets: int, after_ms: int, peer_hits: list[tuple[int, int]], own: int, age_us: int,
    into: int, cost: int, approx: bool, partition: str,
) -> None:
    """With no new traffic and no news from peers, remaining never grows before stable_for ends,
    whatever the predicted reserve does (it grows within a bucket, may fall at a boundary, and ends)."""
    rule = Rule("api", limit, buckets, 1, "approximate" if approx else "strict", partition=partition,
                partition_after=after_ms / 1000)
    now = T0 + 10 * SECOND + into
    model = region(rule, peer_hits, age_us, now)
    if own:
        model.hit([rule], b"u", min(own, limit), now - 1)
    (got,) = model.hit([rule], b"u", cost, now)
    remaining = max(0, limit - got.used)
    end = now + got.stable_us
    boundaries = range((now // SECOND + 1) * SECOND, end, SECOND)
    for at in {now, end - 1, (now + end) // 2, *boundaries, *(b - 1 for b in boundaries)}:
        if now <= at < end:
            (later,) = model.hit([rule], b"u", 0, at, consume=False)
            assert max(0, limit - later.used) <= remaining, (at - now, got)
