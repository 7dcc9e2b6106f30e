"""Approximate mode splits room that frees up between the regions that were using it.

When a full window frees room, every region sees the same room at the same moment.
A peer denied until then has stopped rising, so its rate predicts nothing, and
without more each region would take the whole room (three regions: three times
it). Instead a region reserves for each peer that rose within the last
``partition_after`` its share of the window's count of that room, at most what its
last rate would admit while its counts are stale; the region's own admissions since
the peers' counts were current (field 'u') are added back to the room, so taking
its share does not shrink the next share. tests/store/test_policy_lua_matches_model.py
holds ``hit.lua`` to this model.
"""

from __future__ import annotations

from geolimit import Rule
from geolimit.core.gcounter import Cell
from geolimit.core.model import ModelStore
from geolimit.core.window import SUBSTEPS

T0 = 1_700_000_000_000_000  # a bucket boundary
SECOND = 1_000_000
RULE = Rule("api", 100, 10, 1, mode="approximate")  # partition_after 1 s
NOW = T0 + 10 * SECOND + 500_000  # half of the oldest bucket (T0's) has left the window


def north(peer_rise_at: int) -> ModelStore:
    """30 admissions of each region in T0's bucket; east and west then rose by 5 each at
    ``peer_rise_at`` (100 ms after their previous update: 50/s) and were denied since
    (their counts are current 0.2 s ago, after the rise: they stopped)."""
    model = ModelStore("north", regions=3)
    model.peer_known = {"east": T0, "west": T0}
    for i in range(30):
        model.hit([RULE], b"u", 1, T0 + i)
    old = T0 // RULE.resolution_us
    recent = peer_rise_at // RULE.resolution_us
    for peer in ("east", "west"):
        model.merge(RULE.name, b"u", {old: {f"{peer}/i1": Cell(30 * SUBSTEPS, 0)}})
        model.merge(RULE.name, b"u", {recent: {f"{peer}/i1": Cell(5 * SUBSTEPS, 0)}}, now_us=peer_rise_at,
                    gap_us=SECOND // 10)
    model.peer_known = {"east": NOW - 200_000, "west": NOW - 200_000}
    return model


def admitted(model: ModelStore) -> int:
    """How many of 40 hits north admits now, with no news from its peers."""
    return sum(model.hit([RULE], b"u", 1, NOW + i)[0].allowed for i in range(40))


def test_a_region_takes_about_its_share_of_freed_room_when_its_peers_were_denied() -> None:
    model = north(peer_rise_at=NOW - 900_000)
    (peek,) = model.hit([RULE], b"u", 0, NOW, consume=False)
    room = RULE.limit - peek.used
    held = model.reservation(RULE, b"u", NOW)
    free = room + held.units  # the room north would take without the split: 32
    assert held.predicted > 0, "both peers rose within the last second: each is reserved its share"
    # each peer's share of the count is 35%, of 32 units 11.2, capped at 50/s x 0.2 s = 10
    assert abs(held.units - 2 * 10) < 1e-9
    got = admitted(model)
    assert got == room, "north takes what is left once the peers' shares are set aside"
    assert free - got >= 20 - 1e-9, "and leaves the peers' shares"


def test_a_peer_that_rose_longer_ago_than_partition_after_is_reserved_nothing() -> None:
    model = north(peer_rise_at=NOW - 1_100_000)
    assert model.reservation(RULE, b"u", NOW).units == 0
    (peek,) = model.hit([RULE], b"u", 0, NOW, consume=False)
    assert admitted(model) == RULE.limit - peek.used, "north takes all the room"


def test_own_admissions_since_the_peers_were_current_do_not_shrink_the_peers_share() -> None:
    """North's admissions are added back to the room it splits: the peers' reserve stays
    while north takes its part (else each admission would free part of the reserve)."""
    model = north(peer_rise_at=NOW - 900_000)
    before = model.reservation(RULE, b"u", NOW).units
    model.hit([RULE], b"u", 1, NOW)
    model.hit([RULE], b"u", 1, NOW + 1)
    assert model.reservation(RULE, b"u", NOW + 2).units >= before - 1e-9
