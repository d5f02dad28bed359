"""Property tests of the sharding-integrity check.

Random global tensors are split into random regular grids (optionally with prepended axes),
blocks are optionally split into 1-3 uneven flat ranges (distributed-optimizer style), pieces
and extra non-main replicas are spread over 1-6 simulated ranks. Exact covers must pass;
perturbed layouts must fail. An independent oracle (a numpy count array over the global
tensor) must agree with ``sharding_integrity_problems`` on every layout.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dist_checkpointing.engine.sharding_check import (
    _tensor_key_problems_full,
    _tiles_exactly,
    keyed_problems,
    shard_record,
)
from dist_checkpointing.errors import ShardingError
from dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica
from dist_checkpointing.validation import sharding_integrity_problems, validate_sharding_integrity

PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
MAX_BLOCKS = 24  # keeps every example small and fast
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
REPLICA_IDS = (1, (0, 1), (1, 0), 2)

Shards = list[tuple[int, ShardedBase]]  # (rank, data-less shard)


@dataclass
class Layout:
    world_size: int
    shards: Shards

    def metadata(self) -> list[list[ShardedBase]]:
        per_rank: list[list[ShardedBase]] = [[] for _ in range(self.world_size)]
        for rank, sh in self.shards:
            per_rank[rank].append(sh)
        return per_rank


# ------------------------------------------------------------------ the oracle


def _tensor_cover_is_exact(shards: list[ShardedTensor]) -> bool:
    if len({(tuple(sh.global_shape), sh.dtype) for sh in shards}) > 1:
        return False
    global_shape = tuple(shards[0].global_shape)
    counts = np.zeros(global_shape, dtype=np.int64)
    for sh in shards:
        if not is_main_replica(sh.replica_id):
            continue
        p = sh.prepend_axis_num
        block_shape = (1,) * p + tuple(sh.local_shape)
        if any(
            o + s > g for o, s, g in zip(sh.global_offset, block_shape, global_shape, strict=True)
        ):
            return False
        if sh.flattened_range is None:
            counts[
                tuple(slice(o, o + s) for o, s in zip(sh.global_offset, block_shape, strict=True))
            ] += 1
        else:
            flat = np.arange(sh.flattened_range.start, sh.flattened_range.stop)
            local = np.unravel_index(flat, sh.local_shape)
            index = tuple(np.full(flat.shape, o) for o in sh.global_offset[:p]) + tuple(
                c + o for c, o in zip(local, sh.global_offset[p:], strict=True)
            )
            np.add.at(counts, index, 1)
    return bool(np.all(counts == 1))


def _object_cover_is_exact(shards: list[ShardedObject]) -> bool:
    if len({tuple(sh.global_shape) for sh in shards}) > 1:
        return False
    counts = np.zeros(shards[0].global_shape, dtype=np.int64)
    for sh in shards:
        if is_main_replica(sh.replica_id):
            counts[tuple(sh.global_offset)] += 1
    return bool(np.all(counts == 1))


def oracle_is_valid(layout: Layout) -> bool:
    """Independent check: count, per global element, how many main replicas hold it."""
    by_key: dict[str, list[ShardedBase]] = defaultdict(list)
    for _, sh in layout.shards:
        by_key[sh.key].append(sh)
    for shards in by_key.values():
        if all(isinstance(sh, ShardedTensor) for sh in shards):
            if not _tensor_cover_is_exact(shards):  # type: ignore[arg-type]
                return False
        elif all(isinstance(sh, ShardedObject) for sh in shards):
            if not _object_cover_is_exact(shards):  # type: ignore[arg-type]
                return False
        else:
            return False
    return True


def _check(layout: Layout, expect_valid: bool | None) -> None:
    """The function, ``validate_sharding_integrity`` and the oracle agree (with expectation)."""
    metadata = layout.metadata()
    problems = sharding_integrity_problems(metadata)
    valid = problems == []
    assert valid == oracle_is_valid(layout), problems
    if expect_valid is not None:
        assert valid == expect_valid, problems
    if valid:
        validate_sharding_integrity(metadata)
    else:
        with pytest.raises(ShardingError):
            validate_sharding_integrity(metadata)


# ------------------------------------------------------------------ generating layouts


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def tensor_layouts(draw: st.DrawFn, key: str = "t", flat: bool | None = None) -> Layout:
    ndim = draw(st.integers(1, 4))
    prepend = draw(st.integers(0, ndim - 1))
    budget = MAX_BLOCKS
    global_shape, frags = [], []
    for axis in range(ndim):
        if axis < prepend:  # a prepended axis has blocks of size 1
            size = draw(st.integers(1, min(8, budget)))
            frag = size
        else:
            size = draw(st.integers(1, 8))
            frag = draw(st.sampled_from([d for d in _divisors(size) if d <= budget]))
        budget //= frag
        global_shape.append(size)
        frags.append(frag)
    block = tuple(s // f for s, f in zip(global_shape, frags, strict=True))
    local_shape = block[prepend:]
    numel = math.prod(local_shape)
    dtype = draw(st.sampled_from(DTYPES))
    if flat is None:
        flat = draw(st.booleans())
    world_size = draw(st.integers(1, 6))
    ranks = st.integers(0, world_size - 1)

    def make(offset: tuple[int, ...], replica_id: Any, fr: slice | None) -> ShardedTensor:
        return ShardedTensor(
            key,
            None,
            dtype,
            local_shape,
            tuple(global_shape),
            offset,
            tuple(frags),
            replica_id,
            prepend,
            False,
            fr,
        )

    shards: Shards = []
    for position in itertools.product(*(range(f) for f in frags)):
        offset = tuple(i * b for i, b in zip(position, block, strict=True))
        ranges: list[slice | None] = [None]
        if flat:
            pieces = draw(st.integers(1, min(3, numel)))
            cuts = draw(
                st.lists(
                    st.integers(1, max(1, numel - 1)),
                    min_size=pieces - 1,
                    max_size=pieces - 1,
                    unique=True,
                )
            )
            bounds = [0, *sorted(cuts), numel]
            ranges = [slice(a, b) for a, b in itertools.pairwise(bounds)]
        for fr in ranges:
            shards.append((draw(ranks), make(offset, 0, fr)))
            if draw(st.integers(0, 3)) == 0:
                replica_fr = fr if draw(st.booleans()) else None
                shards.append(
                    (draw(ranks), make(offset, draw(st.sampled_from(REPLICA_IDS)), replica_fr))
                )
    return Layout(world_size, shards)


@st.composite
def object_layouts(draw: st.DrawFn) -> Layout:
    grid = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=2)))
    world_size = draw(st.integers(1, 6))
    shards: Shards = []
    for offset in itertools.product(*(range(g) for g in grid)):
        shards.append(
            (draw(st.integers(0, world_size - 1)), ShardedObject("o", None, grid, offset))
        )
        if draw(st.booleans()):
            replica = ShardedObject("o", None, grid, offset, draw(st.sampled_from(REPLICA_IDS)))
            shards.append((draw(st.integers(0, world_size - 1)), replica))
    return Layout(world_size, shards)


# ------------------------------------------------------------------ perturbations
# Each takes (draw, layout) and returns the perturbed shards and whether the result must be
# invalid (None: depends, only oracle agreement is checked), or None if not applicable.

Perturbed = tuple[Shards, bool | None]


def _main_indices(shards: Shards, flat: bool | None = None) -> list[int]:
    return [
        i
        for i, (_, sh) in enumerate(shards)
        if is_main_replica(sh.replica_id)
        and (flat is None or (getattr(sh, "flattened_range", None) is not None) == flat)
    ]


def _drop(draw: st.DrawFn, layout: Layout) -> Perturbed | None:
    mains = _main_indices(layout.shards)
    if not mains:
        return None
    i = draw(st.sampled_from(mains))
    key = layout.shards[i][1].key
    shards = layout.shards[:i] + layout.shards[i + 1 :]
    # Dropping the only shard of a key removes the key: nothing is left to check.
    return shards, not any(sh.key == key for _, sh in shards)


def _duplicate(draw: st.DrawFn, layout: Layout) -> Perturbed | None:
    mains = _main_indices(layout.shards)
    if not mains:
        return None
    _, sh = layout.shards[draw(st.sampled_from(mains))]
    return [*layout.shards, (draw(st.integers(0, layout.world_size - 1)), sh)], False


def _shift(draw: st.DrawFn, layout: Layout) -> Perturbed | None:
    """Move one main piece to another position of its grid (still a valid ShardedTensor)."""
    candidates = []
    for i in _main_indices(layout.shards):
        sh = layout.shards[i][1]
        if not isinstance(sh, ShardedTensor):
            continue
        block = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
        for axis, (off, size, g) in enumerate(
            zip(sh.global_offset, block, sh.global_shape, strict=True)
        ):
            for target in range(0, g - size + 1, size) if size else ():
                if target != off:
                    candidates.append((i, axis, target))
    if not candidates:
        return None
    i, axis, target = draw(st.sampled_from(candidates))
    rank, sh = layout.shards[i]
    offset = list(sh.global_offset)
    offset[axis] = target
    moved = replace(sh, global_offset=tuple(offset))  # re-validated on construction
    shards = list(layout.shards)
    shards[i] = (rank, moved)
    return shards, False


def _resize_flat(draw: st.DrawFn, layout: Layout, grow: bool) -> Perturbed | None:
    candidates = []
    for i in _main_indices(layout.shards, flat=True):
        sh = layout.shards[i][1]
        assert isinstance(sh, ShardedTensor) and sh.flattened_range is not None
        start, stop = sh.flattened_range.start, sh.flattened_range.stop
        numel = math.prod(sh.local_shape)
        options = (
            [(start - 1, stop)] * (start > 0) + [(start, stop + 1)] * (stop < numel)
            if grow
            else [(start + 1, stop), (start, stop - 1)] * (stop > start)
        )
        candidates += [(i, new) for new in options]
    if not candidates:
        return None
    i, (start, stop) = draw(st.sampled_from(candidates))
    rank, sh = layout.shards[i]
    shards = list(layout.shards)
    shards[i] = (rank, replace(sh, flattened_range=slice(start, stop)))
    return shards, False


def _grow_global_shape(draw: st.DrawFn, layout: Layout) -> Perturbed | None:
    tensors = [i for i, (_, sh) in enumerate(layout.shards) if isinstance(sh, ShardedTensor)]
    if not tensors:
        return None
    i = draw(st.sampled_from(tensors))
    rank, sh = layout.shards[i]
    axis = draw(st.integers(0, len(sh.global_shape) - 1))
    shape = list(sh.global_shape)
    shape[axis] += draw(st.integers(1, 3))
    shards = list(layout.shards)
    shards[i] = (rank, replace(sh, global_shape=tuple(shape), axis_fragmentations=None))
    return shards, False


def _change_dtype(draw: st.DrawFn, layout: Layout) -> Perturbed | None:
    tensors = [i for i, (_, sh) in enumerate(layout.shards) if isinstance(sh, ShardedTensor)]
    if not tensors:
        return None
    i = draw(st.sampled_from(tensors))
    rank, sh = layout.shards[i]
    dtype = draw(st.sampled_from([d for d in DTYPES if d != sh.dtype]))
    shards = list(layout.shards)
    shards[i] = (rank, replace(sh, dtype=dtype))
    # The only shard of its key has nobody to disagree with.
    return shards, (False if len(shards) > 1 else None)


PERTURBATIONS: dict[str, Callable[[st.DrawFn, Layout], Perturbed | None]] = {
    "drop": _drop,
    "duplicate": _duplicate,
    "shift": _shift,
    "shrink_flat": lambda draw, layout: _resize_flat(draw, layout, grow=False),
    "grow_flat": lambda draw, layout: _resize_flat(draw, layout, grow=True),
    "global_shape": _grow_global_shape,
    "dtype": _change_dtype,
}


def _perturb(draw: st.DrawFn, layout: Layout, names: list[str]) -> tuple[str, Perturbed]:
    """Apply one perturbation among ``names``, chosen among those that apply."""
    name = draw(st.sampled_from([n for n in names if PERTURBATIONS[n](draw, layout) is not None]))
    result = PERTURBATIONS[name](draw, layout)
    assert result is not None
    return name, result


def _perturbed(data: st.DataObject, layout: Layout, count: int) -> Layout:
    """``layout`` after up to ``count`` random perturbations."""
    for _ in range(count):
        if not layout.shards:
            break
        _, (shards, _) = _perturb(data.draw, layout, list(PERTURBATIONS))
        layout = Layout(layout.world_size, shards)
    return layout


# ------------------------------------------------------------------ properties


@PROPERTY_SETTINGS
@given(layout=tensor_layouts())
def test_exact_covers_are_valid(layout: Layout) -> None:
    sample = layout.shards[0][1]
    assert isinstance(sample, ShardedTensor)
    event(f"ndim={len(sample.global_shape)}")
    event(f"prepend_axis_num={sample.prepend_axis_num}")
    event("flat" if sample.flattened_range is not None else "not flat")
    event(
        "with replicas" if len(_main_indices(layout.shards)) < len(layout.shards) else "no replicas"
    )
    assert sharding_integrity_problems(layout.metadata()) == []
    assert oracle_is_valid(layout)
    validate_sharding_integrity(layout.metadata())


@PROPERTY_SETTINGS
@given(layout=tensor_layouts(), data=st.data())
def test_single_perturbation_is_invalid(layout: Layout, data: st.DataObject) -> None:
    name, (shards, expect_valid) = _perturb(data.draw, layout, list(PERTURBATIONS))
    event(name)
    _check(Layout(layout.world_size, shards), expect_valid)


@PROPERTY_SETTINGS
@given(layout=tensor_layouts(flat=True), data=st.data())
def test_flat_range_perturbations_are_invalid(layout: Layout, data: st.DataObject) -> None:
    names = ["shrink_flat", "grow_flat", "shift", "duplicate"]
    name, (shards, expect_valid) = _perturb(data.draw, layout, names)
    event(name)
    _check(Layout(layout.world_size, shards), expect_valid)


@PROPERTY_SETTINGS
@given(layout=tensor_layouts(), data=st.data(), count=st.integers(1, 3))
def test_oracle_agrees_on_combined_perturbations(
    layout: Layout, data: st.DataObject, count: int
) -> None:
    # Combined perturbations may cancel out (drop a piece, then duplicate its twin): only
    # agreement with the oracle is required.
    _check(_perturbed(data, layout, count), None)


@PROPERTY_SETTINGS
@given(
    first=tensor_layouts("a"), second=tensor_layouts("b"), objects=object_layouts(), data=st.data()
)
def test_keys_are_checked_independently(
    first: Layout, second: Layout, objects: Layout, data: st.DataObject
) -> None:
    world_size = max(first.world_size, second.world_size, objects.world_size)
    combined = Layout(world_size, first.shards + second.shards + objects.shards)
    _check(combined, True)
    broken_name, (broken, _) = _perturb(data.draw, second, ["duplicate", "shift"])
    problems = sharding_integrity_problems(
        Layout(world_size, first.shards + broken + objects.shards).metadata()
    )
    assert problems and all(p.startswith("'b'") for p in problems), (broken_name, problems)


@PROPERTY_SETTINGS
@given(layout=object_layouts(), data=st.data())
def test_object_grids(layout: Layout, data: st.DataObject) -> None:
    _check(layout, True)
    _, (shards, expect_valid) = _perturb(data.draw, layout, ["drop", "duplicate"])
    _check(Layout(layout.world_size, shards), expect_valid)


def _fast_path_verdict(layout: Layout) -> bool:
    """Whether the check's fast path alone accepts the layout's single key."""
    records = [(rank, shard_record(sh)) for rank, sh in layout.shards]
    return _tiles_exactly(records)


@PROPERTY_SETTINGS
@given(layout=tensor_layouts(flat=False), data=st.data(), count=st.integers(0, 2))
def test_fast_path_accepts_only_exact_covers(
    layout: Layout, data: st.DataObject, count: int
) -> None:
    # The fast path may decline any layout (the full check then runs), but whatever it
    # accepts must be an exact cover by the oracle and by the full check.
    layout = _perturbed(data, layout, count)
    if not layout.shards:
        return
    fast = _fast_path_verdict(layout)
    event("fast path taken" if fast else "full check")
    if fast:
        assert oracle_is_valid(layout)
        records = [(rank, shard_record(sh)) for rank, sh in layout.shards]
        assert _tensor_key_problems_full("t", records) == []


@PROPERTY_SETTINGS
@given(
    first=tensor_layouts("a"),
    second=tensor_layouts("b"),
    objects=object_layouts(),
    data=st.data(),
    count=st.integers(0, 2),
)
def test_records_as_leaves_named_tuples_or_plain_tuples_give_one_report(
    first: Layout, second: Layout, objects: Layout, data: st.DataObject, count: int
) -> None:
    """The split check hands keyed_problems the wire's plain tuples: the report is the
    one the leaves and their ShardRecords give, word for word."""
    world_size = max(first.world_size, second.world_size, objects.world_size)
    layout = _perturbed(
        data, Layout(world_size, first.shards + second.shards + objects.shards), count
    )
    leaves = layout.metadata()
    named = [[shard_record(sh) for sh in rank] for rank in leaves]
    plain = [[tuple(r) for r in rank] for rank in named]
    report = keyed_problems(leaves)
    assert keyed_problems(named) == report
    assert keyed_problems(plain) == report


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
@pytest.mark.parametrize("axis", [0, 1])
def test_fast_path_taken_for_one_axis_tilings(parts: int, axis: int) -> None:
    global_shape = [6, 24] if axis == 0 else [24, 6]
    global_shape[axis] = 24
    size = 24 // parts
    shards: Shards = []
    for rank in range(parts):
        local = list(global_shape)
        local[axis] = size
        tensor = torch.empty(local)
        shards.append(
            (rank, ShardedTensor.from_rank_offsets("t", tensor, (axis, rank, parts)).without_data())
        )
        # A data-parallel copy on another rank is not a main replica.
        shards.append(
            (
                rank + parts,
                ShardedTensor.from_rank_offsets(
                    "t", tensor, (axis, rank, parts), replica_id=1
                ).without_data(),
            )
        )
    layout = Layout(2 * parts, shards)
    assert _fast_path_verdict(layout)
    assert oracle_is_valid(layout)
    # A missing row block is declined by the fast path and reported by the full check.
    gap = Layout(2 * parts, [s for s in shards if s[0] != 0])
    assert not _fast_path_verdict(gap)
    assert sharding_integrity_problems(gap.metadata())
