"""``.metadata`` bytes reused across saves (engine/storage/metadata_blob).

The spliced pickle must unpickle to exactly what ``pickle.dumps`` of the same object
gives, for any path and save id; a template is made from an object's second pickle on
(its first where the save expects to write it again) and never reused once the
object's other fields changed; anything unusual falls back
to a whole pickle.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dist_checkpointing._torch_compat import StorageInfo
from dist_checkpointing.engine.safety.metadata import FORK_MIN_BYTES, load_metadata
from dist_checkpointing.engine.storage import metadata_blob, metadata_pickle
from dist_checkpointing.engine.storage.metadata_blob import metadata_bytes


def _metadata(entries: int) -> Metadata:
    sd_meta = {}
    storage = {}
    for i in range(entries):
        key = f"decoder.layers.{i}.weight"
        chunk = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 8]))
        sd_meta[key] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([4, 8]), [chunk]
        )
        storage[MetadataIndex(key, torch.Size([0, 0]))] = StorageInfo(
            f"__0_{i % 2}.distcp", 128 * i, 128
        )
    return Metadata(sd_meta, planner_data={"k": ("a", "b")}, storage_data=storage)


def _same_objects(blob: bytes, metadata: Metadata) -> bool:
    return pickle.loads(blob) == pickle.loads(pickle.dumps(metadata, protocol=4))


TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=400)


@settings(max_examples=40, deadline=None)
@given(
    entries=st.sampled_from([1, 40, 1500]),
    paths=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=4),
    plain_up_to=st.sampled_from(["0", "100000"]),  # the library's writer / pickle.dumps
)
def test_spliced_pickle_unpickles_to_the_plain_pickle(
    entries: int, paths: list[tuple[str, str]], plain_up_to: str
) -> None:
    with _knob("DIST_CKPT_METADATA_PLAIN_PICKLE_ENTRIES", plain_up_to):
        metadata = _metadata(entries)  # 1500 entries: several protocol-4 frames
        for checkpoint_id, save_id in paths:
            metadata.storage_meta = StorageMeta(checkpoint_id, save_id)
            blob = metadata_bytes(metadata)
            assert _same_objects(blob, metadata)
            if len(blob) < FORK_MIN_BYTES:  # our loader's opcode scan reads the frames too
                assert load_metadata(io.BytesIO(blob)).storage_meta == metadata.storage_meta
        assert id(metadata) in metadata_blob._templates or len(paths) == 1


@contextlib.contextmanager
def _knob(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def test_small_metadata_is_pickled_by_pickle_and_large_by_the_writer() -> None:
    metadata = _metadata(300)
    assert metadata_blob._pickled(metadata) == pickle.dumps(metadata, protocol=4)
    with _knob("DIST_CKPT_METADATA_PLAIN_PICKLE_ENTRIES", "299"):
        assert metadata_blob._pickled(metadata) == metadata_pickle.dumps(metadata)


def test_later_pickles_reuse_the_template_and_load_safely(tmp_path: Path) -> None:
    metadata = _metadata(2000)
    metadata.storage_meta = StorageMeta(str(tmp_path / "iter_0"), "0" * 32)
    metadata_bytes(metadata)
    assert id(metadata) not in metadata_blob._templates  # a first pickle makes none
    metadata.storage_meta = StorageMeta(str(tmp_path / "iter_1"), "a" * 32)
    first = metadata_bytes(metadata)
    template = metadata_blob._templates[id(metadata)]
    metadata.storage_meta = StorageMeta(str(tmp_path / "iter_0000002"), "b" * 32)
    second = metadata_bytes(metadata)
    assert metadata_blob._templates[id(metadata)] is template  # no new pickle made
    assert len(second) - len(first) == len("iter_0000002") - len("iter_1")
    parsed = load_metadata(io.BytesIO(second))  # our restricted loader accepts it
    assert parsed == pickle.loads(pickle.dumps(metadata, protocol=4))
    assert parsed.storage_meta.save_id == "b" * 32


def test_a_save_that_expects_reuse_makes_the_template_at_its_first_pickle() -> None:
    metadata = _metadata(2000)
    metadata.storage_meta = StorageMeta("/ckpt/iter_0", "0" * 32)
    metadata_blob.expect_reuse(metadata)
    first = metadata_bytes(metadata)
    template = metadata_blob._templates[id(metadata)]  # made by the first pickle
    assert _same_objects(first, metadata)
    metadata.storage_meta = StorageMeta("/ckpt/iter_1", "1" * 32)
    second = metadata_bytes(metadata)
    assert metadata_blob._templates[id(metadata)] is template  # spliced, no new pickle
    assert _same_objects(second, metadata)
    other = _metadata(20)  # an object nobody said anything about: a plain first pickle
    other.storage_meta = StorageMeta("/ckpt/other", "2" * 32)
    assert metadata_bytes(other) == metadata_blob._pickled(other)
    assert id(other) not in metadata_blob._templates


@pytest.mark.parametrize("change", ["storage_data", "state_dict_metadata", "version", "modules"])
def test_a_changed_field_is_never_served_from_the_template(change: str) -> None:
    metadata = _metadata(50)
    metadata.storage_meta = StorageMeta("/ckpt/a", "1" * 32)
    metadata_bytes(metadata)
    metadata_bytes(metadata)
    assert id(metadata) in metadata_blob._templates
    if change == "storage_data":
        metadata.storage_data = {
            k: StorageInfo("__9_9.distcp", v.offset, v.length)
            for k, v in metadata.storage_data.items()
        }
    elif change == "state_dict_metadata":
        metadata.state_dict_metadata = dict(list(metadata.state_dict_metadata.items())[:3])
    elif change == "version":
        metadata.version = "9.9.9"
    else:
        metadata.storage_meta = StorageMeta("/ckpt/b", "2" * 32, modules=["x"])
    if change != "modules":
        metadata.storage_meta = StorageMeta("/ckpt/b", "2" * 32)
    assert _same_objects(metadata_bytes(metadata), metadata)


@pytest.mark.parametrize(
    "meta",
    [None, StorageMeta(Path("/ckpt/p"), "x"), StorageMeta("/ckpt/p", None)],
    ids=["no storage_meta", "path object", "no save id"],
)
def test_unusual_storage_meta_falls_back_to_a_whole_pickle(meta: StorageMeta | None) -> None:
    metadata = _metadata(10)
    metadata.storage_meta = meta
    assert metadata_bytes(metadata) == metadata_blob._pickled(metadata)
    assert id(metadata) not in metadata_blob._templates
    assert _same_objects(metadata_bytes(metadata), metadata)


def test_templates_go_with_their_metadata() -> None:
    for i in range(3 * metadata_blob._MAX_TEMPLATES):
        metadata = _metadata(5)
        metadata.storage_meta = StorageMeta(f"/ckpt/{i}", "s")
        metadata_bytes(metadata)
        metadata_bytes(metadata)
        assert id(metadata) in metadata_blob._templates
    assert len(metadata_blob._templates) <= metadata_blob._MAX_TEMPLATES
    assert len(metadata_blob._pickled_once) <= metadata_blob._MAX_TEMPLATES
    key = id(metadata)
    del metadata  # the last one: its template (as large as the file) is dropped with it
    assert key not in metadata_blob._templates
    kept = [_metadata(5) for _ in range(metadata_blob._MAX_TEMPLATES + 2)]
    first: weakref.ref[Any] | None = None
    for i, metadata in enumerate(kept):
        metadata.storage_meta = StorageMeta(f"/ckpt/{i}", "s")
        metadata_bytes(metadata)
        metadata_bytes(metadata)
        if first is None:
            first = weakref.ref(metadata_blob._templates[id(metadata)])
    assert len(metadata_blob._templates) == metadata_blob._MAX_TEMPLATES  # bounded
    assert first is not None and first() is None  # evicted and freed: no finalizer holds it
