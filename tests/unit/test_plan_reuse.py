"""Reusing a save plan for an unchanged structure (``MCoreSavePlanner.structure_signature``
and ``reuse_local_plan``, ``bucketing.BucketLayout``): equal signatures mean equal
plans, and a reused plan resolves every item to this save's data."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.planner import SavePlan

from dist_checkpointing.engine.storage.bucketing import BucketLayout, build_buckets
from dist_checkpointing.errors import ShapeMismatchError
from dist_checkpointing.mapping import ShardedObject, ShardedTensor
from dist_checkpointing.strategies.torch.converter import _replace_state_dict_keys_with_sharded_keys
from dist_checkpointing.strategies.torch.planners import MCoreSavePlanner

_DTYPES = [torch.float32, torch.bfloat16, torch.int64]


@st.composite
def _leaf_params(draw: Any) -> tuple[Any, ...]:
    """A small domain, so that two draws are often equal in some fields and not others."""
    prepend = draw(st.integers(0, 1))
    local = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    grid = []
    for axis in range(prepend + len(local)):
        frags = draw(st.integers(1, 2))
        grid.append((axis, draw(st.integers(0, frags - 1)), frags))
    numel = 1
    for n in local:
        numel *= n
    flat = draw(st.none() | st.tuples(st.integers(0, numel - 1), st.integers(1, numel)))
    if flat is not None and flat[1] <= flat[0]:
        flat = (flat[0], flat[0] + 1)
    key = draw(st.sampled_from(["a", "b"]))
    return key, draw(st.sampled_from(_DTYPES)), prepend, local, tuple(grid), flat


def _leaf(params: tuple[Any, ...], fill: float = 1.0) -> ShardedTensor:
    key, dtype, prepend, local, grid, flat = params
    if flat is None:
        data = torch.full(local, fill).to(dtype)
        return ShardedTensor.from_rank_offsets(key, data, *grid, prepend_axis_num=prepend)
    data = torch.full((flat[1] - flat[0],), fill).to(dtype)
    return ShardedTensor.from_rank_offsets_flat(
        key,
        data,
        local,
        *grid,
        flattened_range=slice(*flat),
        prepend_axis_num=prepend,
    )


def _planner(leaves: list[Any]) -> MCoreSavePlanner:
    # Grouped by key as the strategy groups them.
    by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(dict(enumerate(leaves)))
    planner = MCoreSavePlanner(track_structure=True)
    planner.set_up_planner(by_key)
    return planner


def _resolved(planner: MCoreSavePlanner, plan: SavePlan) -> list[Any]:
    return [planner.resolve_data(item) for item in plan.items]


@settings(max_examples=300, deadline=None)
@given(st.lists(_leaf_params(), min_size=1, max_size=3), st.data())
def test_equal_signatures_mean_equal_plans(first: list[Any], data: Any) -> None:
    # The second state dict: each leaf kept or redrawn (often equal in most fields).
    second = [p if data.draw(st.booleans()) else data.draw(_leaf_params()) for p in first]
    old = _planner([_leaf(p) for p in first])
    new = _planner([_leaf(p, fill=2.0) for p in second])
    old_plan = old.create_local_plan()
    if old.structure_signature() != new.structure_signature():
        return
    built = _planner([_leaf(p, fill=2.0) for p in second])
    built_plan = built.create_local_plan()
    assert built_plan.items == old_plan.items
    assert built_plan.planner_data == old_plan.planner_data
    reused = new.reuse_local_plan(old_plan)
    assert reused.items is old_plan.items  # the same objects: one identity check each
    assert reused.planner_data == built_plan.planner_data
    for got, want in zip(_resolved(new, reused), _resolved(built, built_plan)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)  # this save's data (2.0), not the cached one's


def test_signature_sees_every_field_a_write_item_depends_on() -> None:
    base = ("w", torch.float32, 0, (2, 3), ((0, 0, 2), (1, 1, 2)), None)
    changed = [
        ("v",) + base[1:],  # key
        base[:1] + (torch.bfloat16,) + base[2:],  # dtype
        base[:2] + (1,) + base[3:4] + (((0, 0, 1), (1, 0, 2), (2, 1, 2)),) + base[5:],  # axes
        base[:3] + ((2, 2),) + base[4:],  # local shape
        base[:4] + (((0, 1, 2), (1, 1, 2)),) + base[5:],  # offset
        base[:5] + ((0, 4),),  # flattened range
        base[:5] + ((1, 5),),
    ]
    signature = _planner([_leaf(base)]).structure_signature()
    plan = _planner([_leaf(base)]).create_local_plan()
    for params in changed:
        other = _planner([_leaf(params)])
        assert other.structure_signature() != signature, params
        assert other.create_local_plan() != plan, params  # each of them changes the plan


def test_reused_plan_reshapes_data_with_prepended_axes_and_keeps_objects() -> None:
    def leaves(fill: float) -> list[Any]:
        return [
            ShardedTensor.from_rank_offsets(
                "layers.w", torch.full((2, 3), fill), (0, 1, 4), prepend_axis_num=1
            ),
            ShardedObject("rng", {"seed": fill}, (1,), (0,)),
        ]

    old = _planner(leaves(1.0))
    old_plan = old.create_local_plan()
    new = _planner(leaves(5.0))
    assert new.structure_signature() == old.structure_signature()
    plan = new.reuse_local_plan(old_plan)
    tensor_item, object_item = plan.items
    got = new.resolve_data(tensor_item)
    assert got.shape == (1, 2, 3) and torch.equal(got, torch.full((1, 2, 3), 5.0))
    assert got.data_ptr() == new.state_dict["layers.w"][0].data.data_ptr()  # a view, no copy
    payload = torch.load(new.resolve_data(object_item), weights_only=False)
    assert payload == [{"seed": 5.0}]


def test_reusing_a_plan_for_a_leaf_without_data_names_the_key() -> None:
    old = _planner([ShardedTensor.from_rank_offsets("emb", torch.ones(4))])
    old_plan = old.create_local_plan()
    empty = ShardedTensor.from_rank_offsets("emb", torch.ones(4))
    empty.data = None
    new = _planner([empty])
    with pytest.raises(ShapeMismatchError, match="'emb'"):
        new.reuse_local_plan(old_plan)


def test_bucket_layout_is_reused_only_for_the_same_items_and_options() -> None:
    planner = _planner(
        [ShardedTensor.from_rank_offsets(f"t{i}", torch.ones(i + 1)) for i in range(6)]
    )
    plan = planner.create_local_plan()

    def build(items: Any, threads: int, layout: BucketLayout | None) -> Any:
        return build_buckets(
            items, planner.resolve_data, lambda n: n, "__0_", threads, None, layout=layout
        )

    buckets, layout = build(plan.items, 2, None)
    assert [len(b.tensor_items) for b in buckets] == [len(g) for g in layout.groups]
    again, same = build(plan.items, 2, layout)
    assert same is layout
    assert [[it for it, _ in b.tensor_items] for b in again] == layout.groups
    _, other_threads = build(plan.items, 3, layout)
    assert other_threads is not layout and len(other_threads.groups) == 3
    _, other_list = build(list(plan.items), 2, layout)  # equal items, another list
    assert other_list is not layout and other_list.groups == layout.groups
