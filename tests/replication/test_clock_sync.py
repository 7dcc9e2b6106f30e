"""The agreed region clock's correction (pure; the simulator tests are in tests/sim/test_clock_agreement.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from geolimit import Rule
from geolimit.errors import ConfigError
from geolimit.replication.clock_sync import MAX_CORRECTION, agreed_correction
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions

Factory = Callable[..., EmbeddedRedis]


def test_the_correction_moves_a_clock_onto_the_mean_of_all_clocks() -> None:
    # This region's peers run 1 s ahead and 2 s ahead: the mean clock is 1 s ahead of this one.
    assert agreed_correction([1.0, 2.0], regions=3) == pytest.approx(1.0)
    # A peer not measured yet counts at offset 0.
    assert agreed_correction([3.0], regions=3) == pytest.approx(1.0)
    assert agreed_correction([], regions=1) == 0.0
    assert agreed_correction([1e6], regions=2) == MAX_CORRECTION
    with pytest.raises(ConfigError):
        agreed_correction([], regions=0)


async def test_a_peers_offset_comes_from_its_least_delayed_exchange(redis_server_factory: Factory) -> None:
    """b's clock runs 0.5 s ahead. Exchanges whose answer waited in a queue (ours or b's)
    look later than they are; the estimate is the offset of the exchange with the shortest
    round trip, not an average that every delayed message pulls down (which swung by
    ±0.18 s on a loaded host)."""
    async with Regions(redis_server_factory, ["a", "b"], [Rule("api", 10, 10, 1)], run_loops=False) as rs:
        engine = rs["a"].agent.engine
        assert engine is not None
        peer = engine.peers["b"]
        truth = 0.5

        def exchange(sent: float, out: float, back: float) -> None:
            """a sends at ``sent``; b stamps its answer ``out`` later (its clock ahead by truth);
            the answer reaches a ``back`` after that."""
            engine.note_clock_sample(peer, round((sent + out + truth) * 1e6), sent, sent + out + back)

        exchange(100.0, 0.05, 0.05)  # clean: 0.1 s round trip
        for k in range(6):  # answers held 0.1-0.6 s in queues on the way back
            exchange(101.0 + k, 0.05, 0.05 + 0.1 * (k + 1))
        assert peer.skew == pytest.approx(truth, abs=1e-6)
        assert peer.skew_known
        for k in range(8):  # the clean exchange ages out; then the least delayed of the rest
            exchange(110.0 + k, 0.05, 0.25 + 0.05 * k)
        assert peer.skew == pytest.approx(truth - 0.1, abs=1e-6)  # half of the 0.2 s extra delay
