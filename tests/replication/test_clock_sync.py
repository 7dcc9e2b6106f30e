"""The agreed region clock's correction (pure; the simulator tests are in tests/sim/test_clock_agreement.py)."""

from __future__ import annotations

import pytest

from geolimit.errors import ConfigError
from geolimit.replication.clock_sync import MAX_CORRECTION, agreed_correction


def test_the_correction_moves_a_clock_onto_the_mean_of_all_clocks() -> None:
    # This region's peers run 1 s ahead and 2 s ahead: the mean clock is 1 s ahead of this one.
    assert agreed_correction([1.0, 2.0], regions=3) == pytest.approx(1.0)
    # A peer not measured yet counts at offset 0.
    assert agreed_correction([3.0], regions=3) == pytest.approx(1.0)
    assert agreed_correction([], regions=1) == 0.0
    assert agreed_correction([1e6], regions=2) == MAX_CORRECTION
    with pytest.raises(ConfigError):
        agreed_correction([], regions=0)
