"""The G-counter-with-floors state is a join semilattice."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from geolimit.core.gcounter import Cell, effective, join, join_cell, parse_slot_id, slot_id
from geolimit.core.window import SUBSTEPS

cells = st.builds(Cell, st.integers(0, 50), st.integers(0, 50))
states = st.dictionaries(
    st.integers(0, 4), st.dictionaries(st.sampled_from(["a/1", "b/1", "a/2"]), cells, max_size=3), max_size=4
)


@given(states, states)
def test_join_is_commutative(a: dict, b: dict) -> None:  # type: ignore[type-arg]
    assert join(a, b) == join(b, a)


@given(states, states, states)
def test_join_is_associative(a: dict, b: dict, c: dict) -> None:  # type: ignore[type-arg]
    assert join(join(a, b), c) == join(a, join(b, c))


@given(states)
def test_join_is_idempotent(a: dict) -> None:  # type: ignore[type-arg]
    assert join(a, a) == {k: dict(v) for k, v in a.items()}


@given(cells, cells)
def test_join_never_lowers_a_value_or_floor(a: Cell, b: Cell) -> None:
    j = join_cell(a, b)
    assert j.value == max(a.value, b.value)
    assert j.floor == max(a.floor, b.floor)


def test_effective_count_subtracts_the_floor_and_never_goes_negative() -> None:
    # stored values are count * SUBSTEPS + first-admission offset
    s = SUBSTEPS
    cells = {"a/1": Cell(10 * s + 5, 4 * s + 5), "b/1": Cell(3 * s, 5 * s), "c/1": Cell(7 * s + s - 1)}
    assert effective(cells) == 6 + 0 + 7


def test_slot_ids_round_trip() -> None:
    assert parse_slot_id(slot_id("us-east", "18c2f")) == ("us-east", "18c2f")
