"""Hypothesis strategies for simulation schedules (see tests/sim/harness.py)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from tests.sim.schedule import (
    NAMES,
    Advance,
    Cut,
    Heal,
    Hit,
    Isolate,
    Jitter,
    Rejoin,
    RestartAgent,
    Schedule,
    SetFaults,
    Step,
    Wipe,
)

#: Step kinds, repeated by weight (hits and time dominate; shrinking moves towards the first).
KINDS = (
    ("hit",) * 8 + ("advance",) * 6 + ("cut", "heal") * 2 + ("isolate", "rejoin")
    + ("faults",) * 2 + ("jitter", "restart", "wipe")
)
PROBABILITIES = st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.9])
#: Region clock offsets: pairwise at most 2 s apart (MAX_CLOCK_SKEW), so no cell is "too far ahead".
SKEWS = st.sampled_from([0.0, 0.35, -0.6, 1.0, -1.0])


@st.composite
def steps(draw: st.DrawFn, names: str, kinds: Sequence[str] = KINDS) -> Step:
    region = st.sampled_from(names)
    kind = draw(st.sampled_from(kinds))
    if kind == "hit":
        rules = draw(st.sampled_from(["fine", "coarse", "fine+coarse"]))
        return Hit(draw(region), draw(st.integers(0, 3)), rules, draw(st.integers(1, 5)))
    if kind == "advance":
        return Advance(round(draw(st.integers(1, 40)) * 0.05, 2))
    if kind in ("cut", "heal", "faults"):
        a, b = draw(st.lists(region, min_size=2, max_size=2, unique=True))
        both = draw(st.booleans())
        if kind == "cut":
            return Cut(a, b, both)
        if kind == "heal":
            return Heal(a, b, both)
        return SetFaults(a, b, draw(PROBABILITIES), draw(PROBABILITIES), draw(PROBABILITIES), both)
    if kind == "isolate":
        return Isolate(draw(region))
    if kind == "rejoin":
        return Rejoin(draw(region))
    if kind == "jitter":
        return Jitter(draw(st.sampled_from([0.0, 0.03, 0.1, 0.3])))
    if kind == "restart":
        return RestartAgent(draw(region))
    return Wipe(draw(region), draw(st.booleans()))


@st.composite
def schedules(
    draw: st.DrawFn,
    regions: st.SearchStrategy[int] = st.sampled_from([3, 3, 3, 2, 4]),  # noqa: B008
    max_chunk: int = 8,
    kinds: Sequence[str] = KINDS,
    ae_intervals: st.SearchStrategy[float] = st.sampled_from([30.0, 2.0, 5.0]),  # noqa: B008
) -> Schedule:
    n = draw(regions)
    names = NAMES[:n]
    chunks = st.lists(steps(names, kinds), min_size=1, max_size=max_chunk)
    skew = tuple(draw(SKEWS) for _ in range(n)) if draw(st.booleans()) else ()
    return Schedule(
        # Lists of short lists: about 20 steps on average, and still shrinks by deleting any run.
        steps=tuple(s for chunk in draw(st.lists(chunks, min_size=1, max_size=max_chunk)) for s in chunk),
        regions=n,
        skew=skew,
        latency=draw(st.sampled_from([0.05, 0.01, 0.15])),
        shards=draw(st.sampled_from([4, 4, 1, 16, 64])),
        seed=draw(st.integers(0, 1000)),
        namespace=draw(st.integers(0, 10**6)),
        ae_interval=draw(ae_intervals),
    )
