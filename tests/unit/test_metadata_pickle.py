"""``.metadata`` written without ``pickle.dumps`` (engine/storage/metadata_pickle).

The bytes need not equal ``pickle.dumps``'s, but they must unpickle, with pickle and
with our checked loader, to the same objects: same classes, same instance attributes
(``vars``, so a field dropped or added shows), the same index hints (which
``MetadataIndex.__eq__`` ignores) and ``mcore_data``. Anything unusual must still
unpickle the same (pickled by pickle itself, or the whole object falls back).
"""

from __future__ import annotations

import io
import pickle
import pickletools
import tracemalloc
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dist_checkpointing._torch_compat import StorageInfo
from dist_checkpointing.engine.safety.metadata import load_metadata
from dist_checkpointing.engine.storage import metadata_pickle, pickle_writer
from dist_checkpointing.engine.storage.metadata_parts import SharedParts, index_at


def _tree(obj: Any) -> Any:
    """What an object is, all the way down: type, attributes, items in order."""
    if isinstance(obj, torch.Size):
        return ("Size", tuple(obj))
    if isinstance(obj, dict):
        return ("dict", [(_tree(k), _tree(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_tree(v) for v in obj])
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return (type(obj).__qualname__, _tree(dict(sorted(vars(obj).items()))))
    return (type(obj).__name__, obj)


def _same_as_pickle(metadata: Metadata, blob: bytes, checked: bool = True) -> None:
    """``blob`` unpickles (with pickle, and with our checked loader where the values
    are valid) to what pickle's own pickle of ``metadata`` does."""
    want = _tree(pickle.loads(pickle.dumps(metadata, protocol=4)))
    assert _tree(pickle.loads(blob)) == want
    if checked:
        assert _tree(load_metadata(io.BytesIO(blob), source="ours")) == want


DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
KEYS = st.text(min_size=1, max_size=30)  # surrogates included: pickle passes them
DIMS = st.integers(0, 2**40)
OFFSETS = st.sampled_from([None, -1, 0, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**70])


@st.composite
def metadata_objects(draw: Any) -> Metadata:
    parts = SharedParts()
    shape = parts.size if draw(st.booleans()) else torch.Size  # shared or not
    keys = draw(st.lists(KEYS, max_size=12, unique=True))
    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for key in keys:
        if draw(st.integers(0, 5)) == 0:
            entries[key] = BytesStorageMetadata()
            storage[index_at(key, None)] = StorageInfo("__0_0.distcp", draw(DIMS), 9)
            continue
        ndim = draw(st.integers(0, 4))
        size = draw(st.lists(st.integers(1, 2**33), min_size=ndim, max_size=ndim))
        props = TensorProperties(dtype=draw(st.sampled_from(DTYPES)))
        if draw(st.integers(0, 4)) == 0:  # unusual properties: pickled by pickle
            props = TensorProperties(
                dtype=props.dtype, requires_grad=True, memory_format=torch.channels_last
            )
        # Chunks that tile the tensor along dim 0 (the checked loader checks that).
        cuts = []
        if size and size[0] > 1:
            cuts = draw(st.lists(st.integers(1, size[0] - 1), max_size=2, unique=True))
        rows = [0, *sorted(cuts), *size[:1]]
        chunks = []
        for start, end in zip(rows, rows[1:]) if size else [(0, 0)]:
            offsets = [start] + [0] * (ndim - 1) if size else []
            extent = [end - start, *size[1:]] if size else []
            chunks.append(ChunkStorageMetadata(shape(offsets), shape(extent)))
            hint = draw(st.one_of(st.none(), st.integers(0, 300)))
            info = StorageInfo(
                draw(st.sampled_from(["__0_0.distcp", "__1_0.distcp", "é.distcp"])),
                draw(DIMS),
                draw(DIMS),
                draw(st.sampled_from([None, ["zstd"], []])),
            )
            storage[index_at(key, shape(offsets), hint)] = info
        entries[key] = TensorStorageMetadata(props, shape(size), chunks)
    metadata = Metadata(
        entries,
        planner_data=draw(st.sampled_from([None, {"k": ("a", 1)}, {"x": [1.5, None, True]}])),
        storage_data=storage,
        storage_meta=draw(
            st.sampled_from([None, StorageMeta("/c/p", "s1"), StorageMeta("/c", None, "l", ["m"])])
        ),
        version=draw(st.sampled_from([None, "1.0.0"])),
    )
    if draw(st.booleans()):
        metadata.mcore_data = {  # type: ignore[attr-defined]
            k: draw(st.sampled_from([{}, {"nd_reformulated_orig_global_shape": (4, 2**40)}]))
            for k in keys
        }
    return metadata


@settings(max_examples=200, deadline=None)
@given(metadata=metadata_objects(), offset=OFFSETS)
def test_unpickles_to_what_pickle_writes(metadata: Metadata, offset: int | None) -> None:
    if offset is not None and metadata.storage_data:  # any int pickle writes
        first = next(iter(metadata.storage_data))
        metadata.storage_data[first] = StorageInfo("__0_0.distcp", offset, offset)
    blob = metadata_pickle.dumps(metadata)
    # The checked loader also refuses what no save writes (a negative offset, a shape
    # that is no reformulation); pickle's unpickler takes anything.
    reshaped = any(getattr(metadata, "mcore_data", {}).values())
    _same_as_pickle(metadata, blob, checked=(offset is None or offset >= 0) and not reshaped)
    hints = [k.index for k in pickle.loads(blob).storage_data]
    assert hints == [k.index for k in metadata.storage_data]


def _many(n: int) -> Metadata:
    parts = SharedParts()
    props, size, zero = TensorProperties(torch.float32), parts.size((256,)), parts.size((0,))
    entries = {
        f"t{i}": TensorStorageMetadata(props, size, [ChunkStorageMetadata(zero, size)])
        for i in range(n)
    }
    storage = {
        index_at(f"t{i}", zero, 0): StorageInfo("__0_0.distcp", 1100 * i, 1100) for i in range(n)
    }
    metadata = Metadata(entries, storage_data=storage, storage_meta=StorageMeta("/c", "s"))
    metadata.mcore_data = {f"t{i}": {} for i in range(n)}  # type: ignore[attr-defined]
    return metadata


def test_shared_parts_are_written_once_in_frames() -> None:
    metadata = _many(3000)
    blob = metadata_pickle.dumps(metadata)
    _same_as_pickle(metadata, blob)
    ops = [op.name for op, _, _ in pickletools.genops(blob)]
    few = [op.name for op, _, _ in pickletools.genops(metadata_pickle.dumps(_many(2)))]
    # Classes, the TensorProperties and the two shapes are written once, however many
    # entries: 7 classes and 4 globals inside the properties' own pickle.
    assert ops.count("STACK_GLOBAL") == few.count("STACK_GLOBAL") == 11
    assert ops.count("REDUCE") == few.count("REDUCE")
    assert ops.count("FRAME") > 1 and ops[1] == "FRAME"
    assert "PUT" not in ops and "BINPUT" not in ops  # only MEMOIZE: no index to clash
    loaded = pickle.loads(blob)
    sizes = {id(md.size) for md in loaded.state_dict_metadata.values()}
    assert len(sizes) == 1  # shared once unpickled, as with pickle
    assert len(blob) < len(pickle.dumps(metadata, protocol=4))


def test_holds_less_than_pickle() -> None:
    metadata = _many(20000)

    def peak(dump: Any) -> int:
        tracemalloc.start()
        blob = dump()
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top - len(blob)

    ours = peak(lambda: metadata_pickle.dumps(metadata))
    theirs = peak(lambda: pickle.dumps(metadata, protocol=4))  # makes each __dict__
    assert ours < theirs / 2


class _Cycle(list[Any]):
    pass


@pytest.mark.parametrize(
    "planner_data",
    [_Cycle(), {"deep": [[[[[[[[[[1]]]]]]]]]]}],
    ids=["cycle (pickle must memoize)", "nested lists"],
)
def test_values_pickle_cannot_write_without_a_memo_fall_back(planner_data: Any) -> None:
    if isinstance(planner_data, _Cycle):
        planner_data.append(planner_data)
    metadata = _many(3)
    metadata.planner_data = planner_data
    blob = metadata_pickle.dumps(metadata)
    loaded = pickle.loads(blob)
    if isinstance(planner_data, _Cycle):
        assert blob == pickle.dumps(metadata, protocol=4)  # the whole object: pickle's
        assert loaded.planner_data[0] is loaded.planner_data
    else:
        _same_as_pickle(metadata, blob)


class _SubMetadata(Metadata):
    pass


def test_other_classes_get_pickle() -> None:
    metadata = _SubMetadata({"a": BytesStorageMetadata()})
    assert metadata_pickle.dumps(metadata) == pickle.dumps(metadata, protocol=4)


@pytest.mark.parametrize(
    "value", [0, 255, 256, 65535, 65536, -1, -(2**31), 2**31, -(2**63), 2**2000]
)
def test_int_ops_read_back(value: int) -> None:
    blob = b"\x80\x04" + pickle_writer.int_op(value) + b"."
    assert pickle.loads(blob) == value
    assert len(blob) <= len(pickle.dumps(value, protocol=4))
