"""Prediction estimates a peer's rate from its last two updates, and stops when the peer stops.

A peer's update that raised a key records the rise and the time since the
peer's previous update (``merge.lua`` does it for deltas; the model here, held
to it by tests/store/test_policy_lua_matches_model.py). The predicted rate is
that rise over that time; once a later update of the peer shows its counts
current past the rise without a new one, the peer has stopped on the key and
nothing is reserved for it.
"""

from __future__ import annotations

from geolimit import Rule
from geolimit.core.gcounter import Cell
from geolimit.core.model import ModelStore
from geolimit.core.window import SUBSTEPS

T0 = 1_700_000_000_000_000
SECOND = 1_000_000
RULE = Rule("api", 100, 60, 6)  # partition_after 1 s


def north_after_east_burst(burst: int, at: int, gap_us: int) -> ModelStore:
    """North, having merged east's update (at ``at``, ``gap_us`` after east's previous one) with ``burst`` hits."""
    model = ModelStore("north", regions=2)
    bucket = at // RULE.resolution_us
    model.merge(RULE.name, b"u", {bucket: {"east/i1": Cell(burst * SUBSTEPS, 0)}}, now_us=at, gap_us=gap_us)
    model.peer_known = {"east": at}  # the update's counts were current when it arrived
    return model


def test_the_predicted_rate_is_the_rise_between_the_last_two_updates_over_their_gap() -> None:
    """East rose by 20 in an update 100 ms after its previous one: 200/s, so 0.15 s later north reserves 30."""
    at = T0 + 2 * SECOND
    model = north_after_east_burst(20, at, SECOND // 10)
    held = model.reservation(RULE, b"u", at + 150_000)
    assert abs(held.units - 30) < 1e-9
    (got,) = model.hit([RULE], b"u", 51, at + 150_000, consume=False)
    assert not got.allowed, "20 counted + 30 predicted + 51 > 100"
    (fits,) = model.hit([RULE], b"u", 50, at + 150_000, consume=False)
    assert fits.allowed


def test_a_peer_that_stopped_is_no_longer_reserved_for_after_its_next_update() -> None:
    """East's burst is reserved for until east's next update, which raises nothing: then north may use all the rest."""
    at = T0 + 2 * SECOND
    model = north_after_east_burst(60, at, SECOND // 10)
    (before,) = model.hit([RULE], b"u", 40, at + 50_000, consume=False)
    assert not before.allowed, "60 counted plus east's predicted rate leave less than 40"
    model.peer_known["east"] = at + 100_000  # east's next update: its counts are current, and the key did not rise
    for i in range(40):
        (got,) = model.hit([RULE], b"u", 1, at + 150_000 + i)
        assert got.allowed, f"north's hit {i + 1} of the 40 left"
    (over,) = model.hit([RULE], b"u", 1, at + 150_040)
    assert not over.allowed, "the limit still holds"
    assert model.reservation(RULE, b"u", at + 150_040).units == 0


def test_a_peer_still_rising_at_its_next_update_is_still_reserved_for_at_its_new_rate() -> None:
    """East's next update raises the key by 5 more in 100 ms: north now reserves 50/s, not the burst's rate."""
    at = T0 + 2 * SECOND
    model = north_after_east_burst(60, at, SECOND // 10)
    later = at + 100_000
    bucket = later // RULE.resolution_us
    model.merge(RULE.name, b"u", {bucket: {"east/i1": Cell(65 * SUBSTEPS, 0)}}, now_us=later, gap_us=SECOND // 10)
    model.peer_known["east"] = later
    held = model.reservation(RULE, b"u", later + 200_000)
    assert abs(held.units - 10) < 1e-9, "5 in 0.1 s, for 0.2 s"


def test_a_repair_records_no_rate() -> None:
    """Cells merged without an update gap (anti-entropy repairs) are counted but not predicted for."""
    model = ModelStore("north", regions=2)
    at = T0 + 2 * SECOND
    model.merge(RULE.name, b"u", {at // RULE.resolution_us: {"east/i1": Cell(60 * SUBSTEPS, 0)}})
    model.peer_known = {"east": at - 100_000}
    assert model.reservation(RULE, b"u", at).units == 0
    (got,) = model.hit([RULE], b"u", 40, at, consume=False)
    assert got.allowed
