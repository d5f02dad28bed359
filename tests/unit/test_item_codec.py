"""Write buckets pickled for another process (``WriteBucket.__reduce__``,
``engine/storage/item_codec``): tensor items travel as plain tuples and come back equal
to the originals; a bucket with an item the tuples do not express travels as it is."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem

from dist_checkpointing.engine.storage import item_codec
from dist_checkpointing.engine.storage.write_workers import WriteBucket
from dist_checkpointing.mapping import ShardedObject, ShardedTensor
from dist_checkpointing.strategies.torch.converter import _replace_state_dict_keys_with_sharded_keys
from dist_checkpointing.strategies.torch.planners import MCoreSavePlanner


def _bucket() -> tuple[WriteBucket, MCoreSavePlanner]:
    leaves: list[Any] = [
        ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3), (0, 1, 2)),
        ShardedTensor.from_rank_offsets(
            "layers", torch.ones(4, dtype=torch.bfloat16), (0, 2, 3), prepend_axis_num=1
        ),
        ShardedTensor.from_rank_offsets_flat(
            "exp_avg", torch.arange(3.0), (6,), (0, 1, 2), flattened_range=slice(3, 6)
        ),
        ShardedTensor.from_rank_offsets("step", torch.tensor(7, dtype=torch.int64)),
        ShardedObject("rng", {"seed": 1}, (1,), (0,)),
    ]
    planner = MCoreSavePlanner()
    planner.set_up_planner(_replace_state_dict_keys_with_sharded_keys(dict(enumerate(leaves)))[0])
    plan = planner.create_local_plan()
    tensors = [(it, planner.resolve_data(it)) for it in plan.items if it.tensor_data is not None]
    objects = [(it, planner.resolve_data(it)) for it in plan.items if it.tensor_data is None]
    return WriteBucket("/ckpt/__0_0.distcp", "__0_0.distcp", objects, tensors, 1 << 20), planner


def _same(got: WriteBucket, want: WriteBucket) -> None:
    assert (got.path, got.relative_path, got.checksum_block_bytes) == (
        want.path,
        want.relative_path,
        want.checksum_block_bytes,
    )
    assert [i for i, _ in got.tensor_items] == [i for i, _ in want.tensor_items]
    for (a, x), (b, y) in zip(got.tensor_items, want.tensor_items):
        assert a.index.index == b.index.index  # the hint, which equality ignores
        assert type(a.index.offset) is torch.Size
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert [i for i, _ in got.byte_items] == [i for i, _ in want.byte_items]


def test_tensor_items_travel_as_tuples_and_come_back_equal() -> None:
    bucket, _ = _bucket()
    records = item_codec.encode_tensor_items([it for it, _ in bucket.tensor_items])
    assert records is not None and all(type(r) is tuple for r in records)
    blob = pickle.dumps(bucket, protocol=4)
    assert b"TensorWriteData" not in blob  # no item pickled as its tree of objects
    _same(pickle.loads(blob), bucket)


@pytest.mark.parametrize("field", ["requires_grad", "pin_memory", "memory_format"])
def test_an_item_the_tuples_do_not_express_travels_as_it_is(field: str) -> None:
    bucket, _ = _bucket()
    item, tensor = bucket.tensor_items[0]
    assert item.tensor_data is not None
    value = torch.channels_last if field == "memory_format" else True
    props = TensorProperties(dtype=item.tensor_data.properties.dtype, **{field: value})
    data = TensorWriteData(item.tensor_data.chunk, props, item.tensor_data.size)
    odd = WriteItem(index=item.index, type=item.type, tensor_data=data)
    bucket.tensor_items[0] = (odd, tensor)
    assert item_codec.encode_tensor_items([odd]) is None
    blob = pickle.dumps(bucket, protocol=4)
    assert b"TensorWriteData" in blob
    got = pickle.loads(blob)
    _same(got, bucket)
    assert getattr(got.tensor_items[0][0].tensor_data.properties, field) == value
