"""Reading JSON a value at a time (engine/storage/json_stream) and the metadata index read
that way (engine/storage/metadata_index_reader).

A walk of any document, compact or indented, gives what ``json.loads`` gives; text that
is not JSON fails as ``json.loads`` fails. The index of a checkpoint is read without
parsing it whole; an index laid out another way (keys reordered, indented) is parsed
whole and gives the same ``Metadata``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dist_checkpointing._torch_compat import StorageInfo
from dist_checkpointing.engine.storage import metadata_index_reader
from dist_checkpointing.engine.storage.json_stream import JsonCursor, json_text
from dist_checkpointing.engine.storage.metadata_index import decode_index, encode_index

BLOB = b"the pickled metadata"


def _many(count: int) -> Metadata:
    """``count`` one-chunk entries and a byte entry, with hints and ``mcore_data``."""
    entries: dict[str, Any] = {"obj": BytesStorageMetadata()}
    storage: dict[MetadataIndex, Any] = {MetadataIndex("obj"): StorageInfo("o.distcp", 0, 9)}
    for i in range(count):
        chunk = ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 4]))
        props = TensorProperties(dtype=torch.bfloat16 if i % 2 else torch.float32)
        entries[f"w{i}"] = TensorStorageMetadata(props, torch.Size([count, 4]), [chunk])
        storage[MetadataIndex(f"w{i}", chunk.offsets, i % 3)] = StorageInfo(
            f"__0_{i % 2}.distcp", 64 * i, 64
        )
    md = Metadata(entries, storage_data=storage, storage_meta=StorageMeta("/c", "s"))
    md.mcore_data = {  # type: ignore[attr-defined]
        k: {"nd_reformulated_orig_global_shape": (2, 2)} if k == "w1" else {} for k in entries
    }
    return md


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def _walk(cursor: JsonCursor) -> Any:
    """The value at ``cursor``, rebuilt from members and elements all the way down."""
    char = cursor.peek()
    if char == "{":
        return {key: _walk(cursor) for key in cursor.members()}
    if char == "[":
        return list(cursor.elements())
    return cursor.value()


@settings(max_examples=300, deadline=None)
@given(doc=JSON, indent=st.sampled_from([None, 0, 2]), skip=st.booleans())
def test_a_walk_gives_what_json_loads_gives(doc: Any, indent: int | None, skip: bool) -> None:
    text = json.dumps(doc, indent=indent) + (" \n" if indent is not None else "")
    cursor = JsonCursor(text)
    if skip and isinstance(doc, dict):  # values the caller does not read are skipped
        assert list(cursor.members()) == list(doc)
    else:
        assert _walk(cursor) == doc
    cursor.end()


@pytest.mark.parametrize(
    "text", ['{"a" 1}', '{"a": 1 "b": 2}', "[1 2]", "[1,]", '{"a": 1} x', "[", "{1: 2}", ""]
)
def test_what_is_not_json_fails_as_json_loads_does(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(json.JSONDecodeError):
        cursor = JsonCursor(text)
        _walk(cursor)
        cursor.end()


def test_text_in_any_json_encoding() -> None:
    assert json_text('{"é": 1}'.encode("utf-16")) == '{"é": 1}'


def test_an_index_is_read_a_value_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    md = _many(50)
    data = encode_index(md, BLOB)
    assert data is not None

    def whole(*args: Any) -> Any:
        raise AssertionError("parsed whole")

    monkeypatch.setattr(metadata_index_reader.json, "loads", whole)
    streamed = decode_index(data, BLOB, "idx")
    assert streamed == md and streamed.mcore_data == md.mcore_data  # type: ignore[attr-defined]


@pytest.mark.parametrize("layout", ["indented", "reordered", "body first"])
def test_an_index_laid_out_otherwise_is_parsed_whole_the_same(layout: str) -> None:
    md = _many(30)
    data = encode_index(md, BLOB)
    assert data is not None
    doc = json.loads(data)
    if layout == "indented":
        text = json.dumps(doc, indent=1)
    elif layout == "reordered":
        text = json.dumps({k: doc[k] for k in sorted(doc, reverse=True)})
    else:
        text = json.dumps({"entries": doc.pop("entries"), **doc})
    got = decode_index(text.encode(), BLOB, "idx")
    assert got == md and got.mcore_data == md.mcore_data  # type: ignore[attr-defined]
    assert [k.index for k in got.storage_data] == [k.index for k in md.storage_data]
