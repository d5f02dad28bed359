"""Tests of dist_checkpointing.mapping: construction checks, grid geometry, flat ranges,
narrowing, ShardedObject keys, factories and the small helpers."""

from __future__ import annotations

import dataclasses
import gc
import pickle
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing.dict_utils import dict_list_map_outplace, extract_matching_values
from dist_checkpointing.errors import CheckpointingException, MappingError
from dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
    is_sharded_base,
)

KEY = "decoder.layers.self_attention.linear_qkv.weight"


def _st(**overrides: Any) -> ShardedTensor:
    """A valid 2-D ShardedTensor (block (1, 0) of a 2x1 grid), with fields overridden."""
    fields: dict[str, Any] = dict(
        key=KEY,
        data=torch.zeros(2, 3),
        dtype=torch.float32,
        local_shape=(2, 3),
        global_shape=(4, 3),
        global_offset=(2, 0),
        axis_fragmentations=(2, 1),
    )
    fields.update(overrides)
    return ShardedTensor(**fields)


def _flat(**overrides: Any) -> ShardedTensor:
    """A valid flat ShardedTensor: range [1, 5) of the (2, 3) block, with fields overridden."""
    fields: dict[str, Any] = dict(data=torch.zeros(4), flattened_range=slice(1, 5))
    fields.update(overrides)
    return _st(**fields)


def _expect_mapping_error(fn: Any, *match: str) -> MappingError:
    with pytest.raises(MappingError) as info:
        fn()
    err = info.value
    assert isinstance(err, ValueError)
    assert isinstance(err, CheckpointingException)
    message = str(err)
    assert KEY in message, message
    for fragment in match:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return err


# ------------------------------------------------------------------ construction errors


def test_valid_construction_keeps_fields() -> None:
    sh = _st(local_shape=[2, 3], global_shape=[4, 3], global_offset=[2, 0])
    assert sh.local_shape == (2, 3)
    assert sh.global_shape == (4, 3)
    assert sh.global_offset == (2, 0)
    assert sh.axis_fragmentations == (2, 1)
    assert str(sh) == f"ShardedTensor(key='{KEY}')"


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        pytest.param({"dtype": torch.float16}, ("torch.float32", "torch.float16"), id="dtype"),
        pytest.param({"data": torch.zeros(3, 2)}, ("(3, 2)", "(2, 3)"), id="data-shape"),
        pytest.param({"data": [1.0]}, ("list",), id="data-not-tensor"),
        pytest.param({"global_offset": (2, 0, 0)}, ("(2, 0, 0)", "(4, 3)"), id="offset-len"),
        pytest.param(
            {"global_shape": (4, 3, 1), "global_offset": (2, 0, 0)},
            ("(2, 3)", "prepend_axis_num=0"),
            id="local-vs-ndim",
        ),
        pytest.param({"prepend_axis_num": 1}, ("prepend_axis_num=1",), id="prepend-vs-ndim"),
        pytest.param({"prepend_axis_num": -1}, ("prepend_axis_num",), id="prepend-negative"),
        pytest.param({"axis_fragmentations": (2,)}, ("(2,)",), id="fragmentations-len"),
        pytest.param(
            {"global_shape": (6, 3), "global_offset": (3, 0), "data": torch.zeros(2, 3)},
            ("offset 3", "local size 2"),
            id="offset-not-divisible",
        ),
        pytest.param(
            {"global_shape": (5, 3), "global_offset": (4, 0)},
            ("[4, 6)", "global size 5"),
            id="block-outside",
        ),
        pytest.param({"global_offset": (-2, 0)}, ("negative",), id="negative-offset"),
        pytest.param({"dtype": "float32"}, ("dtype",), id="dtype-not-torch"),
    ],
)
def test_construction_errors(overrides: dict[str, Any], fragments: tuple[str, ...]) -> None:
    _expect_mapping_error(lambda: _st(**overrides), *fragments)


def test_prepended_offset_outside_global_shape() -> None:
    _expect_mapping_error(
        lambda: _st(
            global_shape=(3, 4, 3),
            global_offset=(3, 2, 0),
            axis_fragmentations=None,
            prepend_axis_num=1,
        ),
        "prepended axis 0",
    )


def test_empty_key_is_rejected() -> None:
    with pytest.raises(MappingError, match="non-empty str"):
        _st(key="")


def test_allow_shape_mismatch_accepts_block_outside_global_shape() -> None:
    sh = _st(global_shape=(5, 3), global_offset=(4, 0), allow_shape_mismatch=True)
    assert sh.global_slice() == (slice(4, 6), slice(0, 3))


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        pytest.param({"flattened_range": slice(0, 4, 2)}, ("step",), id="step"),
        pytest.param({"flattened_range": slice(3, 7)}, ("[3, 7)", "6 elements"), id="past-end"),
        pytest.param({"flattened_range": slice(4, 2)}, ("[4, 2)",), id="reversed"),
        pytest.param({"flattened_range": slice(None, 4)}, ("[None, 4)",), id="open-start"),
        pytest.param({"flattened_range": (1, 5)}, ("slice",), id="not-a-slice"),
        pytest.param({"data": torch.zeros(3)}, ("4 elements", "(3,)"), id="numel-mismatch"),
        pytest.param({"data": torch.zeros(2, 2)}, ("1-D", "(2, 2)"), id="not-1d"),
    ],
)
def test_flattened_range_errors(overrides: dict[str, Any], fragments: tuple[str, ...]) -> None:
    _expect_mapping_error(lambda: _flat(**overrides), *fragments)


def test_flat_range_step_one_is_accepted() -> None:
    assert _flat(flattened_range=slice(1, 5, 1)).flattened_range == slice(1, 5, 1)


@pytest.mark.parametrize(
    "rank_offsets",
    [
        pytest.param([(2, 0, 2)], id="axis-too-large"),
        pytest.param([(-1, 0, 2)], id="axis-negative"),
        pytest.param([(0, 2, 2)], id="offset-equals-fragmentations"),
        pytest.param([(0, 5, 2)], id="offset-above-fragmentations"),
        pytest.param([(0, -1, 2)], id="offset-negative"),
        pytest.param([(0, 0, 0)], id="fragmentations-zero"),
        pytest.param([(0, 0, 2), (0, 1, 2)], id="repeated-axis"),
        pytest.param([(0, 0)], id="wrong-arity"),
    ],
)
def test_invalid_rank_offsets(rank_offsets: list[tuple[int, ...]]) -> None:
    data = torch.zeros(2, 3)
    _expect_mapping_error(lambda: ShardedTensor.from_rank_offsets(KEY, data, *rank_offsets))


def test_rank_offsets_axis_range_counts_prepended_axes() -> None:
    data = torch.zeros(2, 3)
    # Axis 2 exists only with one prepended axis.
    sh = ShardedTensor.from_rank_offsets(KEY, data, (2, 1, 2), prepend_axis_num=1)
    assert sh.global_shape == (1, 2, 6)
    _expect_mapping_error(
        lambda: ShardedTensor.from_rank_offsets(KEY, data, (3, 0, 2), prepend_axis_num=1)
    )


def test_from_rank_offsets_rejects_flattened_range() -> None:
    _expect_mapping_error(
        lambda: ShardedTensor.from_rank_offsets(
            KEY, torch.zeros(4), (0, 0, 1), flattened_range=slice(0, 4)
        ),
        "from_rank_offsets_flat",
    )


def test_from_rank_offsets_flat_requires_range() -> None:
    _expect_mapping_error(
        lambda: ShardedTensor.from_rank_offsets_flat(KEY, torch.zeros(4), (2, 2), (0, 0, 1)),
        "flattened_range",
    )
    _expect_mapping_error(
        lambda: ShardedTensor.from_rank_offsets_flat(
            KEY, torch.zeros(4), (2, 2), (0, 0, 1), flattened_range=(0, 4)
        ),
        "slice",
    )


def test_from_rank_offsets_flat_checks_the_data() -> None:
    _expect_mapping_error(
        lambda: ShardedTensor.from_rank_offsets_flat(
            KEY, torch.zeros(3), (2, 2), (0, 0, 1), flattened_range=slice(0, 4)
        ),
        "4 elements",
    )
    _expect_mapping_error(
        lambda: ShardedTensor.from_rank_offsets_flat(
            KEY, torch.zeros(2, 2), (2, 2), (0, 0, 1), flattened_range=slice(0, 4)
        ),
        "1-D",
    )


# ------------------------------------------------------------------ grid geometry


def _check_block_of_reference(sh: ShardedTensor, reference: torch.Tensor) -> None:
    """The local data is the block of ``reference`` at ``global_slice``."""
    assert sh.data is not None
    assert torch.equal(reference[sh.global_slice()], sh.data)


@pytest.mark.parametrize(
    ("local_shape", "rank_offsets", "expected"),
    [
        pytest.param(
            (3,),
            [(0, 2, 4)],
            dict(
                global_shape=(12,),
                global_offset=(6,),
                fragmentations=(4,),
                global_slice=(slice(6, 9),),
                chunk=(2,),
                max_chunks=(3,),
            ),
            id="1d",
        ),
        pytest.param(
            (2, 5),
            [(0, 1, 3), (1, 2, 4)],
            dict(
                global_shape=(6, 20),
                global_offset=(2, 10),
                fragmentations=(3, 4),
                global_slice=(slice(2, 4), slice(10, 15)),
                chunk=(1, 2),
                max_chunks=(2, 5),
            ),
            id="2d",
        ),
        pytest.param(
            (2, 3, 4),
            [(2, 3, 4), (0, 1, 2)],
            dict(
                global_shape=(4, 3, 16),
                global_offset=(2, 0, 12),
                fragmentations=(2, 1, 4),
                global_slice=(slice(2, 4), slice(0, 3), slice(12, 16)),
                chunk=(1, 0, 3),
                max_chunks=(2, 3, 4),
            ),
            id="3d",
        ),
    ],
)
def test_grid_geometry(
    local_shape: tuple[int, ...], rank_offsets: list[tuple[int, int, int]], expected: dict
) -> None:
    reference = torch.arange(int(np.prod(expected["global_shape"])), dtype=torch.float64)
    reference = reference.reshape(expected["global_shape"])
    index = tuple(
        slice(o, o + s) for o, s in zip(expected["global_offset"], local_shape, strict=True)
    )
    data = reference[index].clone()
    sh = ShardedTensor.from_rank_offsets(KEY, data, *rank_offsets, replica_id=(0, 1))
    assert sh.dtype == torch.float64
    assert sh.local_shape == local_shape
    assert sh.global_shape == expected["global_shape"]
    assert sh.global_offset == expected["global_offset"]
    assert sh.axis_fragmentations == expected["fragmentations"]
    assert sh.global_slice() == expected["global_slice"]
    assert sh.local_chunk_offset_in_global() == expected["chunk"]
    assert sh.max_allowed_chunks() == expected["max_chunks"]
    assert sh.replica_id == (0, 1)
    _check_block_of_reference(sh, reference)


def test_every_block_of_a_grid_tiles_the_reference() -> None:
    reference = torch.arange(6 * 8 * 4, dtype=torch.int32).reshape(6, 8, 4)
    counts = torch.zeros_like(reference)
    for i in range(3):
        for j in range(4):
            block = reference[2 * i : 2 * i + 2, 2 * j : 2 * j + 2, :].clone()
            sh = ShardedTensor.from_rank_offsets(KEY, block, (0, i, 3), (1, j, 4))
            assert sh.local_chunk_offset_in_global() == (i, j, 0)
            _check_block_of_reference(sh, reference)
            counts[sh.global_slice()] += 1
    assert torch.all(counts == 1)


def test_prepend_axis_num() -> None:
    num_layers, layer = 5, 3
    reference = torch.randn(num_layers, 4, 12)
    data = reference[layer, :, 6:12].clone()
    sh = ShardedTensor.from_rank_offsets(
        KEY, data, (0, layer, num_layers), (2, 1, 2), prepend_axis_num=1
    )
    assert sh.prepend_axis_num == 1
    assert sh.local_shape == (4, 6)
    assert sh.global_shape == (5, 4, 12)
    assert sh.global_offset == (3, 0, 6)
    assert sh.axis_fragmentations == (5, 1, 2)
    # An int (not a slice) on the prepended axis: indexing drops that axis.
    assert sh.global_slice() == (3, slice(0, 4), slice(6, 12))
    assert sh.local_chunk_offset_in_global() == (3, 0, 1)
    assert sh.max_allowed_chunks() == (1, 4, 6)
    _check_block_of_reference(sh, reference)


def test_prepend_axis_without_rank_offset_on_it() -> None:
    sh = ShardedTensor.from_rank_offsets(KEY, torch.zeros(2, 3), (1, 1, 2), prepend_axis_num=1)
    assert sh.global_shape == (1, 4, 3)
    assert sh.global_offset == (0, 2, 0)
    assert sh.global_slice() == (0, slice(2, 4), slice(0, 3))


def test_max_allowed_chunks_errors() -> None:
    sh = _st(axis_fragmentations=None)
    _expect_mapping_error(sh.max_allowed_chunks, "axis_fragmentations")
    uneven = _st(axis_fragmentations=(3, 1))
    _expect_mapping_error(uneven.max_allowed_chunks, "not divisible", "fragmentation 3")


def test_from_rank_offsets_flat_coordinates() -> None:
    reference = torch.arange(6 * 12, dtype=torch.int64).reshape(6, 12)
    block = reference[3:6, 4:8]
    flat_range = slice(5, 10)
    data = block.flatten()[flat_range].clone()
    sh = ShardedTensor.from_rank_offsets_flat(
        KEY, data, (3, 4), (0, 1, 2), (1, 1, 3), flattened_range=flat_range, replica_id=1
    )
    assert sh.flattened_range == flat_range
    assert sh.local_shape == (3, 4)
    assert sh.global_shape == (6, 12)
    assert sh.global_offset == (3, 4)
    assert sh.replica_id == 1
    assert sh.data is data

    expected_local = np.unravel_index(np.arange(5, 10), (3, 4))
    local = sh.local_coordinates()
    assert len(local) == 2
    for got, want in zip(local, expected_local, strict=True):
        np.testing.assert_array_equal(got, want)
    expected_global = (expected_local[0] + 3, expected_local[1] + 4)
    global_coords = sh.global_coordinates()
    for got, want in zip(global_coords, expected_global, strict=True):
        np.testing.assert_array_equal(got, want)
    assert torch.equal(reference[global_coords], data)


def test_flat_coordinates_with_prepended_axis() -> None:
    reference = torch.arange(3 * 2 * 6, dtype=torch.int64).reshape(3, 2, 6)
    layer = 2
    block = reference[layer, :, 3:6]
    flat_range = slice(2, 6)
    data = block.flatten()[flat_range].clone()
    sh = ShardedTensor.from_rank_offsets_flat(
        KEY,
        data,
        (2, 3),
        (0, layer, 3),
        (2, 1, 2),
        flattened_range=flat_range,
        prepend_axis_num=1,
    )
    assert sh.global_offset == (2, 0, 3)
    coords = sh.global_coordinates()
    assert len(coords) == 3
    np.testing.assert_array_equal(coords[0], np.full(4, layer))
    assert torch.equal(reference[coords], data)


def test_coordinates_need_a_flat_tensor() -> None:
    sh = _st()
    _expect_mapping_error(sh.local_coordinates, "flattened")
    _expect_mapping_error(sh.global_coordinates, "flattened")


# ------------------------------------------------------------------ narrow


def test_narrow_non_flat_matches_narrowed_reference() -> None:
    # Global (8, 18) split 2 x 3 into (4, 6) blocks; every block keeps its rows [1, 3).
    reference = torch.arange(8 * 18, dtype=torch.float32).reshape(8, 18)
    narrowed_reference = reference.reshape(2, 4, 18)[:, 1:3, :].reshape(4, 18)
    for i in range(2):
        for j in range(3):
            data = reference[4 * i : 4 * i + 4, 6 * j : 6 * j + 6].clone()
            sh = ShardedTensor.from_rank_offsets(KEY, data, (0, i, 2), (1, j, 3))
            (narrowed,) = sh.narrow(0, 1, 2)
            assert narrowed.local_shape == (2, 6)
            assert narrowed.global_shape == (4, 18)
            assert narrowed.global_offset == (2 * i, 6 * j)
            assert narrowed.axis_fragmentations == (2, 3)
            _check_block_of_reference(narrowed, narrowed_reference)
            # The original is unchanged.
            assert sh.local_shape == (4, 6) and sh.global_shape == (8, 18)


def test_narrow_along_second_axis_with_prepended_axis() -> None:
    reference = torch.arange(2 * 4 * 12, dtype=torch.float32).reshape(2, 4, 12)
    narrowed_reference = reference.reshape(2, 4, 2, 6)[:, :, :, 0:4].reshape(2, 4, 8)
    data = reference[1, :, 6:12].clone()
    sh = ShardedTensor.from_rank_offsets(KEY, data, (0, 1, 2), (2, 1, 2), prepend_axis_num=1)
    (narrowed,) = sh.narrow(1, 0, 4)
    assert narrowed.global_shape == (2, 4, 8)
    assert narrowed.global_offset == (1, 0, 4)
    _check_block_of_reference(narrowed, narrowed_reference)


def _flat_block(start: int, stop: int) -> tuple[torch.Tensor, ShardedTensor]:
    """Block (1, 0) of shape (4, 3) of an (8, 3) reference, flat range [start, stop)."""
    reference = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    data = reference[4:8].flatten()[start:stop].clone()
    sh = ShardedTensor.from_rank_offsets_flat(
        KEY, data, (4, 3), (0, 1, 2), flattened_range=slice(start, stop)
    )
    return reference, sh


@pytest.mark.parametrize(
    ("start", "length", "expected_range", "expected_data_slice"),
    [
        pytest.param(2, 1, slice(0, 3), slice(2, 5), id="inside"),
        pytest.param(3, 1, slice(0, 1), slice(5, 6), id="cut-at-end"),
        pytest.param(1, 2, slice(1, 6), slice(0, 5), id="cut-at-start"),
        pytest.param(0, 4, slice(4, 10), slice(0, 6), id="whole"),
    ],
)
def test_narrow_flat(
    start: int, length: int, expected_range: slice, expected_data_slice: slice
) -> None:
    reference, sh = _flat_block(4, 10)
    assert sh.data is not None
    (narrowed,) = sh.narrow(0, start, length)
    assert narrowed.flattened_range == expected_range
    assert narrowed.local_shape == (length, 3)
    assert narrowed.global_shape == (2 * length, 3)
    assert narrowed.global_offset == (length, 0)
    assert narrowed.data is not None
    assert torch.equal(narrowed.data, sh.data[expected_data_slice])
    # The narrowed data is the flat range of the narrowed reference block.
    narrowed_block = reference[4:8][start : start + length].flatten()
    assert torch.equal(narrowed.data, narrowed_block[expected_range])


def test_narrow_flat_without_intersection_is_empty() -> None:
    _, sh = _flat_block(4, 10)
    assert sh.narrow(0, 0, 1) == []  # rows [0, 1) are flat [0, 3)
    _, tail = _flat_block(0, 3)
    assert tail.narrow(0, 1, 3) == []


def test_narrow_flat_on_other_dim_and_irregular_grid() -> None:
    _, sh = _flat_block(4, 10)
    _expect_mapping_error(lambda: sh.narrow(1, 0, 1), "dim 0")
    irregular = _st(global_shape=(5, 3), global_offset=(2, 0), axis_fragmentations=None)
    _expect_mapping_error(lambda: irregular.narrow(0, 0, 1), "regular grid")


def test_narrow_without_data() -> None:
    _, sh = _flat_block(4, 10)
    (narrowed,) = sh.without_data().narrow(0, 2, 1)
    assert narrowed.data is None
    assert narrowed.flattened_range == slice(0, 3)
    (plain,) = _st(data=None).narrow(1, 1, 2)
    assert plain.data is None and plain.global_shape == (4, 2)


# ------------------------------------------------------------------ data handling


def test_init_data_non_flat() -> None:
    sh = _st(data=None, dtype=torch.bfloat16)
    sh.init_data("cpu", init_fn=torch.ones)
    assert sh.data is not None
    assert sh.data.shape == (2, 3) and sh.data.dtype == torch.bfloat16
    assert torch.all(sh.data == 1)
    existing = sh.data
    sh.init_data("cpu")  # no-op once data is set
    assert sh.data is existing


def test_init_data_flat() -> None:
    sh = _flat(data=None)
    sh.init_data(torch.device("cpu"), init_fn=lambda shape, **kw: torch.arange(6.0).reshape(shape))
    assert sh.data is not None
    assert torch.equal(sh.data, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    sh.validate_metadata_integrity()


def test_without_data() -> None:
    sh = _flat(replica_id=(0, 2), allow_shape_mismatch=True)
    meta = sh.without_data()
    assert meta.data is None
    assert sh.data is not None  # the original keeps its data
    names = [f.name for f in dataclasses.fields(ShardedTensor) if f.name != "data"]
    assert len(names) == 10
    for name in names:
        assert getattr(meta, name) == getattr(sh, name), name
    # Metadata-only copies pickle small and compare equal.
    assert pickle.loads(pickle.dumps(meta)) == meta
    obj = ShardedObject("rng", {"seed": 1}, (2,), (1,), replica_id=3)
    assert obj.without_data() == ShardedObject("rng", None, (2,), (1,), replica_id=3)
    assert obj.data == {"seed": 1}


def test_shallow_copy_copies_every_field() -> None:
    # _shallow_copy names the fields of each leaf class: a field added to the class
    # must be added there too.
    from dist_checkpointing import mapping

    for cls, getter in (
        (ShardedTensor, mapping._tensor_fields),
        (ShardedObject, mapping._object_fields),
    ):
        names = [f.name for f in dataclasses.fields(cls)]
        probe = types.SimpleNamespace(**{n: n for n in names})
        assert list(getter(probe)) == names, cls.__name__


@pytest.mark.skipif(sys.version_info < (3, 11), reason="CPython keeps values inline from 3.11")
def test_fast_leaves_are_one_object_for_the_collector() -> None:
    # from_rank_offsets and without_data store fields as attributes: no instance dict is
    # built, so the collector tracks one object per leaf, not two (a model builds one
    # leaf per parameter on every save).
    data = torch.zeros(4, 2)
    leaves = [ShardedTensor.from_rank_offsets("w", data, (0, 1, 2)) for _ in range(3)]
    leaves += [leaf.without_data() for leaf in leaves]
    leaves.append(ShardedObject("rng", 1, (2,), (1,)).without_data())
    gc.collect()
    tracked = {id(o) for o in gc.get_objects()}
    for leaf in leaves:
        assert id(leaf) in tracked
        assert not any(type(r) is dict for r in gc.get_referents(leaf)), leaf
    assert leaves[0].global_shape == (8, 2) and leaves[3].data is None


# ------------------------------------------------------------------ ShardedObject


@pytest.mark.parametrize(
    ("key", "shape", "offset", "unique_key"),
    [
        ("rng_state", (4,), (2,), "rng_state/shard_2_4"),
        ("optimizer/rng_state", (2, 4), (1, 3), "optimizer/rng_state/shard_1.3_2.4"),
        ("a/b/c_d", (1, 1, 12), (0, 0, 11), "a/b/c_d/shard_0.0.11_1.1.12"),
        ("scalar_obj", (), (), "scalar_obj/shard__"),
    ],
)
def test_sharded_object_unique_key_round_trip(
    key: str, shape: tuple[int, ...], offset: tuple[int, ...], unique_key: str
) -> None:
    obj = ShardedObject(key, object(), shape, offset, replica_id=1)
    assert obj.unique_key == unique_key
    assert str(obj) == f"ShardedObject(key='{key}')"
    back = ShardedObject.empty_from_unique_key(unique_key, replica_id=(0, 1))
    assert back.key == key
    assert back.data is None
    assert back.global_shape == shape
    assert back.global_offset == offset
    assert back.replica_id == (0, 1)
    assert back.unique_key == unique_key


@pytest.mark.parametrize(
    "unique_key", ["no_shard_part", "k/shard_1_2_3", "k/piece_0_1", "k/shard_a_2", "k/shard_2_2"]
)
def test_empty_from_unique_key_rejects_malformed_keys(unique_key: str) -> None:
    with pytest.raises(MappingError) as info:
        ShardedObject.empty_from_unique_key(unique_key)
    assert unique_key.split("/")[-1] in str(info.value) or "outside" in str(info.value)


@pytest.mark.parametrize(
    ("shape", "offset", "fragment"),
    [((2,), (0, 0), "different lengths"), ((2,), (2,), "outside"), ((2, 3), (1, -1), "outside")],
)
def test_sharded_object_construction_errors(
    shape: tuple[int, ...], offset: tuple[int, ...], fragment: str
) -> None:
    with pytest.raises(MappingError) as info:
        ShardedObject(KEY, None, shape, offset)
    assert isinstance(info.value, ValueError)
    assert KEY in str(info.value) and fragment in str(info.value)
    with pytest.raises(MappingError, match="non-empty str"):
        ShardedObject("", None, (1,), (0,))


# ------------------------------------------------------------------ factories


def _split_build_fn(
    key: str, tensor: torch.Tensor, replica_id: Any, flattened_range: slice | None
) -> dict[str, ShardedTensor]:
    """Save a (2n, m) tensor as two ShardedTensors: its top and bottom halves."""
    assert flattened_range is None
    half = tensor.shape[0] // 2
    return {
        "top": ShardedTensor.from_rank_offsets(
            f"{key}.top", tensor[:half].clone(), replica_id=replica_id
        ),
        "bottom": ShardedTensor.from_rank_offsets(
            f"{key}.bottom", tensor[half:].clone(), replica_id=replica_id
        ),
    }


def _cat_merge_fn(loaded: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([loaded["top"], loaded["bottom"]])


def _simulate_load(sharded_state_dict: dict) -> dict:
    """What load returns: every ShardedTensor replaced by its (copied) data."""
    return dict_list_map_outplace(
        lambda x: x.data.clone() if isinstance(x, ShardedTensor) else x, sharded_state_dict
    )


def test_factory_round_trip() -> None:
    weight = torch.randn(4, 3)
    extra = torch.arange(6.0).reshape(2, 3)
    bias = ShardedTensor.from_rank_offsets("layer.bias", torch.randn(3))
    sharded_sd: dict[str, Any] = {
        "layer": {
            "weight": ShardedTensorFactory("layer.weight", weight, _split_build_fn, _cat_merge_fn),
            "bias": bias,
        },
        "extras": [
            "not a tensor",
            ShardedTensorFactory("extras.1", extra, _split_build_fn, _cat_merge_fn, replica_id=1),
        ],
    }
    factories, _ = extract_matching_values(
        sharded_sd, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    assert set(factories) == {"layer", "extras"} and list(factories["extras"]) == [1]

    apply_factories(sharded_sd)
    built = sharded_sd["layer"]["weight"]
    assert set(built) == {"top", "bottom"}
    assert built["top"].key == "layer.weight.top"
    assert torch.equal(built["top"].data, weight[:2])
    assert sharded_sd["extras"][1]["bottom"].replica_id == 1
    assert sharded_sd["layer"]["bias"] is bias

    loaded = _simulate_load(sharded_sd)
    merged = apply_factory_merges(loaded, factories)
    assert merged is loaded
    assert torch.equal(merged["layer"]["weight"], weight)
    assert torch.equal(merged["extras"][1], extra)
    assert merged["extras"][0] == "not a tensor"
    assert torch.equal(merged["layer"]["bias"], bias.data)


def test_factory_merge_with_list_of_factories() -> None:
    tensors = [torch.randn(2, 2), torch.randn(4, 1)]
    sharded_sd = {
        "list": [
            ShardedTensorFactory(f"f{i}", t, _split_build_fn, _cat_merge_fn)
            for i, t in enumerate(tensors)
        ]
    }
    factories, _ = extract_matching_values(
        sharded_sd, lambda x: isinstance(x, ShardedTensorFactory)
    )
    apply_factories(sharded_sd)
    loaded = apply_factory_merges(_simulate_load(sharded_sd), factories)
    assert all(torch.equal(a, b) for a, b in zip(loaded["list"], tensors, strict=True))


def test_factory_build_passes_its_fields() -> None:
    calls = []

    def build_fn(key: str, data: Any, replica_id: Any, flattened_range: Any) -> dict:
        calls.append((key, data, replica_id, flattened_range))
        return {}

    fac = ShardedTensorFactory("k", None, build_fn, lambda x: x, (0, 1), slice(0, 2))
    assert fac.build() == {}
    assert calls == [("k", None, (0, 1), slice(0, 2))]
    fac.validate_metadata_integrity()
    assert fac.without_data().data is None
    bad = ShardedTensorFactory("bad.factory", None, build_fn, "not callable")  # type: ignore[arg-type]
    with pytest.raises(MappingError, match=r"bad\.factory"):
        bad.validate_metadata_integrity()


def test_apply_factory_merges_errors_name_the_path() -> None:
    fac = ShardedTensorFactory("k", None, _split_build_fn, _cat_merge_fn)
    with pytest.raises(MappingError, match=r"\('a', 'missing'\)"):
        apply_factory_merges({"a": {}}, {"a": {"missing": fac}})
    with pytest.raises(ValueError, match="different lengths"):
        apply_factory_merges({"a": [1, 2]}, {"a": [fac]})
    with pytest.raises(MappingError, match="index 5"):
        apply_factory_merges({"a": [1, 2]}, {"a": {5: fac}})
    with pytest.raises(MappingError, match="cannot merge"):
        apply_factory_merges({"a": 1}, {"a": {"b": fac}})


# ------------------------------------------------------------------ small helpers


def test_local_nonpersistent_object() -> None:
    value = {"step": 3}
    wrapped = LocalNonpersistentObject(value)
    assert wrapped.unwrap() is value
    assert "step" in repr(wrapped)


@pytest.mark.parametrize(
    ("replica_id", "main"),
    [
        (0, True),
        (1, False),
        (7, False),
        ((0,), True),
        ((0, 0, 0), True),
        ((0, 1, 0), False),
        ((2, 0), False),
        ((), True),
    ],
)
def test_is_main_replica(replica_id: Any, main: bool) -> None:
    assert is_main_replica(replica_id) is main


@st.composite
def _grid_blocks(draw: Any) -> tuple[tuple[int, ...], list[tuple[int, int, int]], int]:
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    prepend = draw(st.integers(0, 2))
    ndim = len(shape) + prepend
    axes = draw(st.lists(st.integers(0, max(ndim - 1, 0)), unique=True, max_size=ndim))
    offsets = []
    for axis in axes if ndim else []:
        frag = draw(st.integers(1, 4))
        offsets.append((axis, draw(st.integers(0, frag - 1)), frag))
    return shape, offsets, prepend


@settings(max_examples=200, deadline=None)
@given(_grid_blocks(), st.sampled_from([0, 1, (0, 2)]))
def test_from_rank_offsets_builds_what_the_checked_constructor_builds(
    block: tuple[tuple[int, ...], list[tuple[int, int, int]], int], replica_id: Any
) -> None:
    """from_rank_offsets skips __post_init__'s checks (the grid makes them hold): the
    object must be the one the checked constructor builds, and pass those checks."""
    shape, offsets, prepend = block
    data = torch.zeros(shape, dtype=torch.bfloat16)
    fast = ShardedTensor.from_rank_offsets(
        "k", data, *offsets, replica_id=replica_id, prepend_axis_num=prepend
    )
    checked = ShardedTensor(
        "k",
        data,
        data.dtype,
        fast.local_shape,
        fast.global_shape,
        fast.global_offset,
        fast.axis_fragmentations,
        replica_id,
        prepend,
    )
    assert fast.__dict__.keys() == checked.__dict__.keys()
    for name, value in checked.__dict__.items():
        got = fast.__dict__[name]
        assert got is value if name == "data" else (got == value and type(got) is type(value))
    fast.validate_metadata_integrity()
    assert fast.local_shape == tuple(shape)
    for axis, rank_offset, frag in offsets:
        local = 1 if axis < prepend else shape[axis - prepend]
        assert fast.global_shape[axis] == frag * local
        assert fast.global_offset[axis] == rank_offset * local


def test_from_rank_offsets_still_refuses_a_bad_key() -> None:
    with pytest.raises(MappingError, match="non-empty str"):
        ShardedTensor.from_rank_offsets("", torch.zeros(2), (0, 0, 1))


class _CustomLeaf(ShardedBase):
    """A user's own leaf class: a ShardedBase the fast type comparison does not know."""

    key = "custom"
    data = None
    replica_id = 0

    def validate_metadata_integrity(self) -> None:
        pass

    def without_data(self) -> _CustomLeaf:
        return self


class _TensorSubclass(ShardedTensor):
    pass


def test_is_sharded_base_agrees_with_isinstance() -> None:
    st = ShardedTensor.from_rank_offsets("a", torch.zeros(4))
    sub = _TensorSubclass.from_rank_offsets("b", torch.zeros(4))
    factory = ShardedTensorFactory("f", torch.zeros(2), lambda *a: {}, lambda x: x)
    leaves: list[Any] = [st, sub, ShardedObject("o", 1, (1,), (0,)), _CustomLeaf(), factory]
    others: list[Any] = [torch.zeros(1), {"a": st}, [st], None, 3, "a", ShardedTensor]
    for x in leaves + others:
        assert is_sharded_base(x) == isinstance(x, ShardedBase), x
    assert all(map(is_sharded_base, leaves)) and not any(map(is_sharded_base, others))
