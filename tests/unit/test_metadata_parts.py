"""Equal shapes and dtypes of a saved ``Metadata`` as one object each
(engine/storage/metadata_parts): the same values, a smaller and faster pickle, and a
file that our restricted loader, plain ``pickle`` and therefore DCP read back equal."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from dist_checkpointing.engine.safety.metadata import load_metadata
from dist_checkpointing.engine.storage.metadata_parts import SharedParts
from dist_checkpointing.strategies.torch.planners import MCoreSavePlanner


def _records(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Plan records of one rank: row blocks of 2-D weights, whole biases, one object."""
    out: list[tuple[Any, ...]] = [(f"obj.{rank}",)]
    for i in range(40):
        dtype = torch.bfloat16 if i % 3 else torch.float32
        out.append((f"w{i}", (rank * 4, 0), (4, 8), (4 * world, 8), dtype))
        if rank == 0:
            out.append((f"b{i}", (0,), (8,), (8,), dtype))
    return out


def _reference(all_records: list[tuple[list[tuple[Any, ...]], dict[str, Any]]]) -> Metadata:
    """The same Metadata built with new objects everywhere (as before the sharing)."""
    md: dict[str, Any] = {}
    for records, _ in all_records:
        for rec in records:
            if len(rec) == 1:
                continue
            fqn, offsets, sizes, size, dtype = rec
            if fqn not in md:
                md[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), [])
            md[fqn].chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
    return Metadata(state_dict_metadata=md)


def test_built_metadata_shares_equal_shapes_and_dtypes() -> None:
    world = 3
    all_records = [(_records(r, world), {}) for r in range(world)]
    built = MCoreSavePlanner.metadata_from_records(all_records)
    reference = _reference(all_records)
    tensors = {
        k: v for k, v in built.state_dict_metadata.items() if k in reference.state_dict_metadata
    }
    assert tensors == reference.state_dict_metadata  # the same values
    w0, w1, b0 = (built.state_dict_metadata[k] for k in ("w0", "w3", "b0"))
    assert w0.size is w1.size  # (12, 8), once
    assert w0.chunks[0].sizes is w1.chunks[0].sizes is w0.chunks[1].sizes  # (4, 8), once
    assert w0.properties is w1.properties  # float32, once
    assert b0.chunks[0].offsets is not None and b0.size is b0.chunks[0].sizes  # (8,), once
    assert built.state_dict_metadata["w1"].properties.dtype == torch.bfloat16
    # The pickle is smaller; our restricted loader and plain pickle read it back equal.
    shared_blob = pickle.dumps(built, protocol=4)
    reference.state_dict_metadata.update(
        {k: v for k, v in built.state_dict_metadata.items() if k not in tensors}
    )
    assert len(shared_blob) < len(pickle.dumps(reference, protocol=4))
    for parsed in (pickle.loads(shared_blob), load_metadata(io.BytesIO(shared_blob))):
        assert parsed.state_dict_metadata == reference.state_dict_metadata


def test_parts_are_the_same_object_for_equal_values_only() -> None:
    parts = SharedParts()
    assert parts.size([2, 3]) is parts.size((2, 3)) is parts.size(torch.Size([2, 3]))
    assert parts.size((2, 3)) == torch.Size([2, 3]) and type(parts.size(())) is torch.Size
    assert parts.size((3, 2)) is not parts.size((2, 3))
    assert parts.properties(torch.float16) is parts.properties(torch.float16)
    assert parts.properties(torch.float16) is not parts.properties(torch.float32)
    assert parts.properties(torch.int8) == TensorProperties(dtype=torch.int8)


def test_chunks_are_shared_where_both_shapes_are() -> None:
    parts = SharedParts()
    a = parts.chunk([0, 0], (4, 8))
    assert a is parts.chunk((0, 0), torch.Size([4, 8]))
    assert a == ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 8]))
    assert a.offsets is parts.size((0, 0)) and a.sizes is parts.size((4, 8))
    assert parts.chunk((4, 0), (4, 8)) is not a and parts.chunk((4, 0), (4, 8)).sizes is a.sizes
    assert parts.chunk((0, 0), (8, 4)) is not a

    # Bounded (shapes from a file): past the limit, shapes and chunks are new objects.
    bounded = SharedParts(max_shapes=2)
    first = bounded.chunk((0,), (5,))
    assert bounded.chunk((0,), (5,)) is first
    other = bounded.chunk((0,), (6,))  # (6,) is the third shape: not shared
    assert other == ChunkStorageMetadata(torch.Size([0]), torch.Size([6]))
    assert bounded.chunk((0,), (6,)) is not other and other.offsets is first.offsets


def test_built_metadata_shares_equal_chunks() -> None:
    world = 2
    built = MCoreSavePlanner.metadata_from_records([(_records(r, world), {}) for r in range(world)])
    md = built.state_dict_metadata
    assert md["w0"].chunks[0] is md["w5"].chunks[0]  # rank 0's block of each weight
    assert md["w0"].chunks[1] is md["w5"].chunks[1] and md["w0"].chunks[0] is not md["w0"].chunks[1]
    assert md["b0"].chunks[0] is md["b1"].chunks[0]


def test_storage_data_shares_equal_offsets_and_pickles_to_the_same_values() -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from dist_checkpointing._torch_compat import StorageInfo
    from dist_checkpointing.strategies.state_dict_saver import storage_data_from_records

    records = [
        (f"w{i}", (4 * (i % 3), 0), 64, f"__0_{i % 2}.distcp", 100 * i, 64, None, None)
        for i in range(12)
    ] + [("obj", None, 5, "__0_0.distcp", 2000, 5, None, None)]
    built = storage_data_from_records(records)
    reference = {
        MetadataIndex(fqn, None if off is None else torch.Size(off)): StorageInfo(p, o, n, t)
        for fqn, off, _, p, o, n, t, _ in records
    }
    assert built == reference and list(built) == list(reference)
    offsets = {}
    for index in built:
        if index.offset is not None:
            assert type(index.offset) is torch.Size
            assert offsets.setdefault(tuple(index.offset), index.offset) is index.offset
    assert len(offsets) == 3  # three distinct offsets, one object each
    md = Metadata(state_dict_metadata={}, storage_data=built)
    blob = pickle.dumps(md, protocol=4)
    unshared = pickle.dumps(Metadata(state_dict_metadata={}, storage_data=reference), protocol=4)
    assert len(blob) < len(unshared)
    for loaded in (pickle.loads(blob), load_metadata(io.BytesIO(blob))):
        assert loaded.storage_data == reference


def test_plan_records_send_equal_shapes_once_and_only_the_extras() -> None:
    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.strategies.torch.layout import ND_REFORMULATED_SHAPE_KEY

    planner = MCoreSavePlanner()
    planner.set_up_planner(
        {k: [ShardedTensor.from_rank_offsets(k, torch.zeros(4, 8))] for k in ("a", "b", "c")}
    )
    plan = planner.create_local_plan()
    assert plan.planner_data == {"a": {}, "b": {}, "c": {}}  # the planner's own, unchanged
    plan.planner_data["c"] = {ND_REFORMULATED_SHAPE_KEY: (8, 8)}
    records, extras = MCoreSavePlanner.plan_records(plan)
    assert extras == {"c": {ND_REFORMULATED_SHAPE_KEY: (8, 8)}}
    assert [r[0] for r in records] == ["a", "b", "c"] and records[0][1:4] == (
        (0, 0),
        (4, 8),
        (4, 8),
    )
    sent = pickle.loads(pickle.dumps((records, extras), protocol=4))[0]
    assert sent[0][1] is sent[1][1] is sent[2][1] and sent[0][2] is sent[2][2]  # one tuple each
    built = MCoreSavePlanner.metadata_from_records([(sent, extras)])
    mcore = built.mcore_data  # type: ignore[attr-defined]
    assert mcore == {"a": {}, "b": {}, "c": {ND_REFORMULATED_SHAPE_KEY: (8, 8)}}
    assert list(mcore) == ["a", "b", "c"] and mcore["a"] is mcore["b"]  # one empty dict
    assert pickle.loads(pickle.dumps(built, protocol=4)).mcore_data == mcore
