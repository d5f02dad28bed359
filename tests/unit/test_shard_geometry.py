"""Pure shape arithmetic of sharded tensors (dist_checkpointing._shard_geometry)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing._shard_geometry import (
    Box,
    box_intersection,
    box_minus,
    grid_from_rank_offsets,
    narrowed_flat_range,
    object_unique_key,
    parse_object_unique_key,
    uncovered_boxes,
)


def _cells(box: Box) -> set[tuple[int, ...]]:
    offsets, sizes = box
    return set(itertools.product(*(range(o, o + s) for o, s in zip(offsets, sizes))))


@st.composite
def _boxes_in(draw: st.DrawFn, shape: tuple[int, ...]) -> Box:
    offsets = tuple(draw(st.integers(0, s - 1)) for s in shape)
    sizes = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
    return offsets, sizes


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_box_minus_leaves_exactly_the_cells_outside_the_hole(data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    box, hole = data.draw(_boxes_in(shape)), data.draw(_boxes_in(shape))
    parts = box_minus(box, hole)
    assert len(parts) <= 2 * len(shape)
    cells = [_cells(p) for p in parts]
    assert sum(map(len, cells)) == len(set().union(*cells))  # disjoint
    assert set().union(*cells) == _cells(box) - _cells(hole)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_box_intersection_is_the_common_cells(data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=0, max_size=3)))
    a = data.draw(_boxes_in(shape)) if shape else ((), ())
    b = data.draw(_boxes_in(shape)) if shape else ((), ())
    common = _cells(a) & _cells(b)
    got = box_intersection(a, b)
    if not common:
        assert got is None
    else:
        assert got is not None and _cells(got) == common
        assert all(type(v) is tuple for v in got)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_uncovered_boxes_cover_the_complement(data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    holes = data.draw(st.lists(_boxes_in(shape), max_size=4))
    rest = uncovered_boxes(shape, holes)
    everything = _cells(((0,) * len(shape), shape))
    covered = set().union(*(_cells(h) for h in holes)) if holes else set()
    rest_cells = [_cells(b) for b in rest]
    assert sum(map(len, rest_cells)) == len(set().union(*rest_cells)) if rest else True
    assert (set().union(*rest_cells) if rest else set()) == everything - covered


def test_grid_from_rank_offsets_and_its_problems() -> None:
    # Axis 1 is the data axis 0 (axis 0 is the prepended one, local size 1).
    assert grid_from_rank_offsets((2, 3), [(1, 1, 4)], 1) == ((1, 8, 3), (0, 2, 0), (1, 4, 1))
    assert grid_from_rank_offsets((2, 3), [(0, 1, 4)], 1) == ((4, 2, 3), (1, 0, 0), (4, 1, 1))
    assert "each axis once" in str(grid_from_rank_offsets((2,), [(0, 0, 2), (0, 1, 2)], 0))
    assert "got (0, 1)" in str(grid_from_rank_offsets((2,), [(0, 1)], 0))  # type: ignore[list-item]


def test_narrowed_flat_range() -> None:
    # Block (4, 3), flat range [2, 8); keep rows [1, 3): elements [3, 9) of the block.
    assert narrowed_flat_range(slice(2, 8), (4, 3), 1, 2) == (slice(0, 5), slice(1, 6))
    assert narrowed_flat_range(slice(0, 2), (4, 3), 2, 2) is None


def test_object_unique_keys_round_trip() -> None:
    key = object_unique_key("opt/rng", (1, 0), (2, 3))
    assert key == "opt/rng/shard_1.0_2.3"
    assert parse_object_unique_key(key) == ("opt/rng", (1, 0), (2, 3))
    assert parse_object_unique_key("x/shard__") == ("x", (), ())
    assert "not a ShardedObject unique key" in str(parse_object_unique_key("nokey"))
