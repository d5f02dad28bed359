"""The chunk checks of a ``.metadata`` entry agree with the definition, on both paths
(per chunk below 16 chunks, vectorized from 16 on) and on the grid shortcut: a tensor's
chunks are accepted exactly when every one lies inside the tensor and no two non-empty
ones share an element."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from dist_checkpointing.engine.safety.metadata_check import check_metadata
from dist_checkpointing.errors import CorruptCheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _valid(size: tuple[int, ...], boxes: list[Box]) -> bool:
    """The definition, by brute force."""
    for off, ext in boxes:
        if any(o < 0 or e < 0 or o + e > s for o, e, s in zip(off, ext, size)):
            return False
    full = [b for b in boxes if all(b[1])]
    for (a, x), (b, y) in itertools.combinations(full, 2):
        if all(p < q + m and q < p + n for p, n, q, m in zip(a, x, b, y)):
            return False
    return True


def _accepted(size: tuple[int, ...], boxes: list[Box]) -> bool:
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(e)) for o, e in boxes]
    md = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size(size), chunks)
    try:
        check_metadata(Metadata(state_dict_metadata={"t": md}), "test")
    except CorruptCheckpointError as exc:
        assert "'t'" in str(exc)  # the error names the key
        return False
    return True


@st.composite
def _random_chunks(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    ndim = draw(st.integers(0, 2))
    size = tuple(draw(st.lists(st.integers(0, 12), min_size=ndim, max_size=ndim)))
    count = draw(st.sampled_from([1, 2, 5, 15, 16, 17, 30]))
    dim = st.integers(-1, 13)
    box = st.tuples(
        st.lists(dim, min_size=ndim, max_size=ndim).map(tuple),
        st.lists(dim, min_size=ndim, max_size=ndim).map(tuple),
    )
    return size, draw(st.lists(box, min_size=count, max_size=count))


@st.composite
def _grids(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """Tensor-parallel style shards (a regular grid), sometimes spoiled by one chunk
    moved by one element or repeated."""
    grid = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=2)))
    block = tuple(draw(st.lists(st.integers(1, 4), min_size=len(grid), max_size=len(grid))))
    size = tuple(g * b for g, b in zip(grid, block))
    boxes: list[Box] = [
        (tuple(i * b for i, b in zip(cell, block)), block)
        for cell in itertools.product(*(range(g) for g in grid))
    ]
    spoil = draw(st.sampled_from(["none", "shift", "repeat"]))
    if spoil == "shift":
        i, d = draw(st.integers(0, len(boxes) - 1)), draw(st.integers(0, len(grid) - 1))
        off = list(boxes[i][0])
        off[d] += draw(st.sampled_from([-1, 1]))
        boxes[i] = (tuple(off), block)
    elif spoil == "repeat":
        boxes.append(boxes[draw(st.integers(0, len(boxes) - 1))])
    return size, boxes


@settings(max_examples=400, deadline=None)
@given(_random_chunks())
def test_random_chunks_are_accepted_exactly_when_valid(case: tuple[Any, Any]) -> None:
    size, boxes = case
    assert _accepted(size, boxes) == _valid(size, boxes)


@settings(max_examples=300, deadline=None)
@given(_grids())
def test_grids_are_accepted_exactly_when_valid(case: tuple[Any, Any]) -> None:
    size, boxes = case
    assert _accepted(size, boxes) == _valid(size, boxes)


@pytest.mark.parametrize("count", [2, 64])
def test_an_overlap_names_both_chunks(count: int) -> None:
    boxes: list[Box] = [((4 * i,), (4,)) for i in range(count)]
    boxes[-1] = ((4 * count - 6,), (4,))  # overlaps the one before by two elements
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(e)) for o, e in boxes]
    md = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([4 * count]), chunks)
    with pytest.raises(CorruptCheckpointError, match="overlap") as info:
        check_metadata(Metadata(state_dict_metadata={"w": md}), "test")
    assert f"offsets ({4 * count - 8},)" in str(info.value)
    assert f"offsets ({4 * count - 6},)" in str(info.value)
