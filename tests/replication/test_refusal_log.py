"""A peer that keeps sending refused messages (a wrong secret retries several times a
second) gets one warning per source and reason every 10 s, saying how many it held back."""

from __future__ import annotations

import logging

import pytest

from geolimit.errors import AuthenticationError
from geolimit.replication.refusals import RefusalLog


def test_repeated_refusals_are_logged_once_per_ten_seconds_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    refusals = RefusalLog(logging.getLogger("geolimit.test.refusals"), clock=lambda: now[0])
    bad = AuthenticationError("bad signature on a message naming region 'c'")
    with caplog.at_level(logging.WARNING, logger="geolimit.test.refusals"):
        for _ in range(50):  # 5 s of retries at 10 per second
            refusals.warn("gossip", "127.0.0.1", bad)
            now[0] += 0.1
        refusals.warn("gossip", "127.0.0.9", bad)  # another source: its own line
        refusals.warn("gossip", "127.0.0.1", AuthenticationError("message from unknown region 'x'"))
        now[0] += 6
        refusals.warn("gossip", "127.0.0.1", bad)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "gossip from 127.0.0.1 refused: bad signature on a message naming region 'c'",
        "gossip from 127.0.0.9 refused: bad signature on a message naming region 'c'",
        "gossip from 127.0.0.1 refused: message from unknown region 'x'",
        "gossip from 127.0.0.1 refused: 50 more like it in the last 11 s "
        "(latest: bad signature on a message naming region 'c')",
    ]
