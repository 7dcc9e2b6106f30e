"""Approximate mode splits room between the regions that race for it.

When a full window frees room, every region sees the same room at the same moment.
A peer denied until then has stopped rising, so its rate predicts nothing, and
without more each region would take the whole room (three regions: three times
it). Instead a region reserves for each peer its share of the window's count of
that room; the region's own admissions since the peers' counts were current (field
'u') are added back to the room, so taking its share does not shrink the next share.

* *Contested room* (at most what the window frees and takes in ``partition_after``):
  each peer that rose within ``partition_after`` is reserved its share, uncapped; if
  the oldest bucket freed all of the room within ``partition_after`` (the window was
  full: a silent peer may just have been denied), every peer is. Together they are
  reserved at most the room less one unit, so that the window can fill to the limit.
* *Standing room*: a peer that rose within ``partition_after`` is reserved its share
  at most what its last rate admits while its counts are stale (a handoff: the peer
  that stopped has no demand), one that did not, nothing.

tests/store/test_policy_lua_matches_model.py holds ``hit.lua`` to this model.
"""

from __future__ import annotations

import pytest

from geolimit import Rule
from geolimit.core.gcounter import Cell
from geolimit.core.model import ModelStore
from geolimit.core.policy import Rise, Window, reserve
from geolimit.core.window import SUBSTEPS, oldest_part, share

T0 = 1_700_000_000_000_000  # a bucket boundary
SECOND = 1_000_000
RULE = Rule("api", 100, 10, 1, mode="approximate")  # partition_after 1 s
NOW = T0 + 10 * SECOND + 500_000  # half of the oldest bucket (T0's) has left the window


def north(peer_rise_at: int, rule: Rule = RULE, old_at: int = T0) -> ModelStore:
    """30 admissions of each region in ``old_at``'s bucket; east and west then rose by 5
    each at ``peer_rise_at`` (100 ms after their previous update: 50/s) and were denied
    since (their counts are current 0.2 s ago, after the rise: they stopped)."""
    model = ModelStore("north", regions=3)
    model.peer_known = {"east": T0, "west": T0}
    for i in range(30):
        model.hit([rule], b"u", 1, old_at + i)
    old = old_at // rule.resolution_us
    recent = peer_rise_at // rule.resolution_us
    for peer in ("east", "west"):
        model.merge(rule.name, b"u", {old: {f"{peer}/i1": Cell(30 * SUBSTEPS, 0)}})
        model.merge(rule.name, b"u", {recent: {f"{peer}/i1": Cell(5 * SUBSTEPS, 0)}}, now_us=peer_rise_at,
                    gap_us=SECOND // 10)
    model.peer_known = {"east": NOW - 200_000, "west": NOW - 200_000}
    return model


def admitted(model: ModelStore, rule: Rule = RULE) -> int:
    """How many of 300 hits north admits now, with no news from its peers."""
    return sum(model.hit([rule], b"u", 1, NOW + i)[0].allowed for i in range(300))


def room_without_reserve(model: ModelStore, rule: Rule = RULE) -> float:
    """The limit less the window's weighted count (north has admitted nothing since its
    peers' counts were current)."""
    sums, _ = model.sums(rule, b"u", NOW)
    n = rule.buckets
    weight = share(model.firsts(rule, b"u", NOW)[n], NOW // rule.resolution_us, rule.resolution_us, NOW)
    return rule.limit - sum(sums[:n]) - oldest_part(sums[n], weight)


@pytest.mark.parametrize("rise_ago", [900_000, 1_100_000])
def test_a_region_takes_its_share_of_room_the_window_just_freed(rise_ago: int) -> None:
    """The oldest bucket freed all of the room within partition_after: north keeps its
    peers' shares (35% each), whether or not they rose within partition_after (they may
    only have been denied since)."""
    model = north(peer_rise_at=NOW - rise_ago)
    free = room_without_reserve(model)  # about 33 units
    held = model.reservation(RULE, b"u", NOW)
    assert 30 < free < 40
    assert held.predicted == pytest.approx(0.7 * free), "not capped by the peers' last rates (50/s x 0.2 s = 10)"
    got = admitted(model)
    assert got == int(0.3 * free), "north takes its 30%"


def test_own_admissions_since_the_peers_were_current_do_not_shrink_the_peers_share() -> None:
    """North's admissions are added back to the room it splits: once it has taken its
    part, what it still reserves for its peers is what they have not taken yet (else
    each admission would free part of the reserve, and north would take it all)."""
    model = north(peer_rise_at=NOW - 900_000)
    free = room_without_reserve(model)
    got = admitted(model)
    left = model.reservation(RULE, b"u", NOW + 300).units
    assert left >= free - got - 1
    assert got + left <= free + 1e-9


def test_standing_room_keeps_a_peer_that_stopped_to_what_its_last_rate_admits() -> None:
    """A larger limit, so the room (233 units) is not contested: a peer that rose within
    partition_after is reserved at most its last rate times its staleness (50/s x 0.2 s),
    one that rose earlier nothing: after a handoff the new region gets the room."""
    rule = Rule("api", 300, 10, 1, mode="approximate")
    recent = north(peer_rise_at=NOW - 900_000, rule=rule)
    assert recent.reservation(rule, b"u", NOW).units == pytest.approx(2 * 10)
    earlier = north(peer_rise_at=NOW - 1_100_000, rule=rule)
    assert earlier.reservation(rule, b"u", NOW).units == 0
    free = room_without_reserve(earlier, rule)
    assert admitted(earlier, rule) == int(free)


def window(room: float, freeing_per_s: float, intake_per_s: float) -> Window:
    return Window(1000 - room, 1000, freeing_per_s / SECOND, intake_per_s / SECOND)


RISE = Rise(NOW - 100_000, 5, SECOND // 10)  # 50/s, after the peer's counts were current: not over
KNOWN = {"east": NOW - 200_000, "west": NOW - 200_000}


def split(room: float, freeing_per_s: float, intake_per_s: float, rises: dict[str, list[Rise]]) -> float:
    """What north reserves for east and west (300 of the window's 1000 units each)."""
    return reserve(limit=1000, now_us=NOW, counts={"east": 300, "west": 300}, rises=rises, known_until=KNOWN,
                   regions=3, predict=True, partition="local", partition_after_us=SECOND,
                   window=window(room, freeing_per_s, intake_per_s)).units


def test_room_the_window_takes_faster_than_partition_after_is_split_without_a_cap() -> None:
    """A window filling at 300/s with 40 units left (no bucket leaving yet): peers that rose
    lately are reserved their 30% each, not 50/s x 0.2 s; a silent one is not (the room is
    not fresh: it may have no demand)."""
    assert split(40, 0, 300, {"east": [RISE], "west": [RISE]}) == pytest.approx(0.6 * 40)
    assert split(40, 0, 300, {"east": [RISE]}) == pytest.approx(0.3 * 40)
    assert split(400, 0, 300, {"east": [RISE], "west": [RISE]}) == pytest.approx(2 * 10), "standing room: capped"


def test_the_last_unit_of_the_room_goes_to_someone() -> None:
    """With 2 units of room each region's share is below one unit: the peers are reserved
    one unit less than the room, so north can take one (and the window can fill)."""
    both = {"east": [RISE], "west": [RISE]}
    assert split(2, 60, 100, both) == pytest.approx(1)
    assert split(0.5, 60, 100, both) == 0
    assert split(10, 60, 100, both) == pytest.approx(6)
