"""Read items of a load planned straight onto stored chunks (``read_planning.read_items``):
equal to what DCP's general planner makes, with their shapes shared (a load of many
tensors holds one object per distinct shape, not four per item)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dist_checkpointing.strategies.torch.read_planning import read_items


def _chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


def test_exact_read_items_equal_dcps_and_share_their_shapes() -> None:
    stored = [_chunk((0, 0), (2, 4)), _chunk((2, 0), (2, 4)), _chunk((4, 0), (2, 4))]
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([6, 4]), stored)
    wanted = [_chunk((4, 0), (2, 4)), _chunk((0, 0), (2, 4))]
    got = read_items("w", md, wanted)

    def order(item: ReadItem) -> tuple[int, ...]:
        return tuple(item.dest_index.offset or ())

    dcp = create_read_items_for_chunk_list("w", md, wanted)
    assert sorted(got, key=order) == sorted(dcp, key=order)  # DCP orders them its own way
    assert [i.storage_index.index for i in got] == [2, 0]
    for item, chunk in zip(got, wanted):
        assert item.dest_index.offset is chunk.offsets is item.storage_index.offset
        assert type(item.dest_index.offset) is torch.Size
        assert item.lengths is chunk.sizes
    assert got[0].dest_offsets is got[0].storage_offsets is got[1].dest_offsets
    one = read_items("v", md, [_chunk((0, 0), (2, 4))])  # another load: the same zeros
    assert one[0].storage_offsets is got[0].storage_offsets == torch.Size([0, 0])


def test_reads_land_in_the_destination_itself_or_in_a_staging_buffer() -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.strategies.torch.read_planning import ReadLayout

    props = TensorProperties(dtype=torch.float32)
    md = Metadata(
        state_dict_metadata={
            k: TensorStorageMetadata(props, torch.Size([4, 4]), [_chunk((0, 0), (4, 4))])
            for k in ("a", "b", "c")
        }
    )
    layout = ReadLayout(md)
    a, b = torch.zeros(4, 4), torch.zeros(4, 4)
    c = torch.zeros(4, 4, dtype=torch.float64)  # another dtype: read through a staging buffer
    for key, data in (("a", a), ("b", b), ("c", c)):
        layout.plan_tensor(key, ShardedTensor.from_rank_offsets(key, data))
    items = {}
    for key, chunk_targets in layout.chunks.items():
        items[key] = read_items(key, md.state_dict_metadata[key], [c for c, _ in chunk_targets])
        layout.count_reads(key, items[key], chunk_targets, False)
    (a_chunk, _), (b_chunk, _) = layout.chunks["a"][0], layout.chunks["b"][0]
    assert a_chunk is b_chunk  # equal requests: one chunk object
    assert layout.dest(items["a"][0]) is a and layout.staging(items["a"][0]) is None
    assert layout.dest(items["b"][0]) is b
    staging = layout.staging(items["c"][0])
    assert staging is not None and staging.pending == 1
    assert layout.dest(items["c"][0]) is staging.buffer and staging.buffer.dtype == torch.float32
    staging.buffer.copy_(torch.arange(16.0).view(4, 4))
    staging.pending -= 1
    layout.finish_staging(staging)
    assert torch.equal(c, torch.arange(16.0, dtype=torch.float64).view(4, 4))
    assert layout.incomplete() == []
