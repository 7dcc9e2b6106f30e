"""Keys larger than one script call's worth of cells replicate and are repaired."""

from __future__ import annotations

from collections.abc import Callable

from geolimit import ManualClock, Rule
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions

Factory = Callable[..., EmbeddedRedis]
HOURLY = Rule("hourly", 1_000_000, 3600, 1)  # 3600 buckets: a fills all of them, b and c every 4th (5400 cells)


def hits_at(name: str, second: int) -> bool:
    """Region a hits every second, b and c every 4th: one key of 5400 cells over 3600 buckets
    (each hit reads the whole key, so 10800 cells took a minute of the test suite)."""
    return name == "a" or second % 4 == 0


async def test_a_3600_bucket_key_of_three_regions_replicates_and_is_repaired_after_a_wipe(
    redis_server_factory: Factory,
) -> None:
    # A 5 s gossip interval gives the agents a 100 s lease: a round every 90 s keeps it.
    async with Regions(redis_server_factory, ["a", "b", "c"], [HOURLY], run_loops=False, interval=5.0) as rs:
        clock = rs.clock
        assert isinstance(clock, ManualClock)
        apps = {name: rs[name].app() for name in "abc"}
        await rs.step()
        for second in range(3600):
            for name, app in apps.items():
                if hits_at(name, second):
                    app.hit("hourly", "big", cost=1 + (second % 3))
            clock.advance(1.0)
            if second % 90 == 89:
                await rs.step(rounds=1)
        await rs.step(rounds=2)
        expected = {name: sum(1 + (s % 3) for s in range(3600) if hits_at(name, s)) for name in "abc"}  # minus what slid out
        window = {n: apps[n].usage("hourly", "big") for n in "abc"}
        # The oldest second has left the window by now: compare with what every region counts.
        counted = window["a"].by_region
        assert counted.keys() == expected.keys()
        assert all(0 < counted[n] <= expected[n] for n in "abc")
        for name in "bc":
            assert window[name].by_region == counted, name  # every region holds all 5400 cells
        rs["a"].client().flushall()  # a loses the key (and everything else)
        apps["a"].hit("hourly", "big", cost=1)  # a new incarnation
        await rs.step(rounds=3)  # a notices the wipe; anti-entropy brings the 5400 cells back
        views = {n: apps[n].usage("hourly", "big").by_slot for n in "abc"}
        assert views["a"] == views["b"] == views["c"], "a holds every cell again, as b and c do"
        incarnations = {s: n for s, n in views["a"].items() if s.startswith("a/")}
        assert len(incarnations) == 2
        assert min(incarnations.values()) == 1  # the new incarnation: its one hit
        key = next(k for k in rs["a"].client().scan_iter(match=b"gl:{*}:hourly:big"))
        assert rs["a"].client().hlen(key) > 5000  # one key, more cells than one blob holds (4096)
