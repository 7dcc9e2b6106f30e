"""geolimit/log_every.py: one line per key every period, the rest counted; the count line comes by
itself when the events stop (a timer on the running loop), on asyncio's loop and on uvloop."""

from __future__ import annotations

import asyncio
import logging

import pytest
import uvloop

from geolimit.log_every import LogEvery
from tests.support.regions import eventually

pytestmark = pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture")

LOGGER = "geolimit.test.log_every"


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    return uvloop.EventLoopPolicy() if request.param == "uvloop" else asyncio.DefaultEventLoopPolicy()


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_each_key_gets_a_line_per_period_and_the_next_counts_what_was_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [50.0]
    lines = LogEvery(logging.getLogger(LOGGER), clock=lambda: now[0])  # no event loop: no timer
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for i in range(100):
        lines.warn(("up-a", "connect"), "upstream a", f"cannot connect ({i})", "request(s) could not connect")
        lines.warn(("up-a", "timeout"), "upstream a", "no response", "request(s) timed out")
        lines.warn(("up-b", "connect"), "upstream b", "cannot connect", "request(s) could not connect")
        now[0] += 0.05
    assert messages(caplog) == ["upstream a: cannot connect (0)", "upstream a: no response",
                                "upstream b: cannot connect"]
    now[0] += 5.5  # 10.5 s after the first lines
    lines.warn(("up-a", "connect"), "upstream a", "cannot connect (100)", "request(s) could not connect")
    lines.close()  # the proxy stops: the other keys' counts
    assert messages(caplog)[3:] == [
        "upstream a: 100 more request(s) could not connect in the last 10 s (latest: cannot connect (100))",
        "upstream a: 99 more request(s) timed out in the last 10 s (latest: no response)",
        "upstream b: 99 more request(s) could not connect in the last 10 s (latest: cannot connect)",
    ]
    now[0] += 10
    lines.flush()  # quiet keys are forgotten: the next event is written at once
    lines.warn(("up-b", "connect"), "upstream b", "cannot connect again", "request(s) could not connect")
    assert messages(caplog)[-1] == "upstream b: cannot connect again"


async def test_the_count_is_written_when_the_period_ends_even_if_nothing_more_happens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    lines = LogEvery(logging.getLogger(LOGGER), every=0.2)
    for _ in range(5):
        lines.warn("k", "peer x", "refused", "like it")
    await eventually(lambda: len(messages(caplog)) == 2, timeout=5, what="the count line, by the timer")
    assert messages(caplog)[1].startswith("peer x: 4 more like it in the last 0 s (latest: refused)")
    lines.close()
    assert len(messages(caplog)) == 2, "nothing left to write"


async def test_a_period_ending_within_a_millisecond_is_scheduled_and_never_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """uvloop gives a Handle without ``when()`` for such a delay: asking it raised into the request
    that failed (a 500 from the proxy's aiohttp path after 14,626 failures to a dead upstream)."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    now = [100.0]
    lines = LogEvery(logging.getLogger(LOGGER), every=10.0, clock=lambda: now[0])
    lines.warn("k", "upstream a", "first", "request(s) failed")
    now[0] = 110.0 - 1e-7  # the period ends in 0.1 us: the timer is due at once
    lines.warn("k", "upstream a", "second", "request(s) failed")
    lines.warn("k", "upstream a", "third", "request(s) failed")
    now[0] = 110.0
    await eventually(lambda: len(messages(caplog)) == 2, timeout=5, what="the count line, by the timer")
    assert messages(caplog)[1] == "upstream a: 2 more request(s) failed in the last 10 s (latest: third)"


def test_the_keys_remembered_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    lines = LogEvery(logging.getLogger(LOGGER), clock=lambda: now[0], max_keys=64)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for source in range(10_000):  # a flood of sources, each with a line of its own
        lines.warn(source, f"peer {source}", "refused", "like it")
        lines.warn(source, f"peer {source}", "refused", "like it")
    assert len(lines._keys) <= 64
    assert len(messages(caplog)) == 10_000


def test_a_batch_of_events_counts_as_many(caplog: pytest.LogCaptureFixture) -> None:
    now = [10.0]
    lines = LogEvery(logging.getLogger(LOGGER), clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert lines.warn("reset", "service", "reset 3 request(s)", "request(s) reset", 3)
    now[0] += 1.0
    assert not lines.warn("reset", "service", "reset 5 request(s)", "request(s) reset", 5)
    now[0] += 9.5
    assert lines.warn("reset", "service", "reset 2 request(s)", "request(s) reset", 2)
    assert messages(caplog) == ["service: reset 3 request(s)",
                                "service: 7 more request(s) reset in the last 10 s (latest: reset 2 request(s))"]
