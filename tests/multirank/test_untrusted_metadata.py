"""Crafted ``.metadata`` and ``metadata.json`` contents: refused with our error, naming
the file and the key, never a bare TypeError, wrong values or unread memory."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.safety.metadata_check import (
    ND_REFORMULATED_SHAPE_KEY,
    first_overlap,
)
from dist_checkpointing.engine.storage.reader import FileSystemReader
from dist_checkpointing.errors import CorruptCheckpointError
from dist_checkpointing.strategies.torch.layout import (
    ND_REFORMULATED_SHAPE_KEY as LAYOUT_KEY,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    dcp.save(
        {
            "v": ShardedTensor.from_rank_offsets("v", torch.arange(4.0)),
            "w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 6)),
        },
        d,
    )
    return d


def _rewrite(ckpt_dir: Path, change: Callable[[Metadata], None]) -> None:
    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    metadata.storage_meta = None
    change(metadata)
    (ckpt_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    # A crafted file comes with the commit record deleted (it would refuse the file first).
    (ckpt_dir / "commit.json").unlink(missing_ok=True)


def _load(ckpt_dir: Path) -> dict[str, Any]:
    return dcp.load(
        {
            "v": ShardedTensor.from_rank_offsets("v", torch.full((4,), -7.0)),
            "w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6)),
        },
        ckpt_dir,
    )


def test_the_key_names_agree() -> None:
    assert ND_REFORMULATED_SHAPE_KEY == LAYOUT_KEY


def _overlapping_chunks(md: Metadata) -> None:
    # [0:2] and [1:3] of a size-4 tensor: four elements by count, element 3 unread.
    tensor = md.state_dict_metadata["v"]
    tensor.chunks = [  # type: ignore[union-attr]
        ChunkStorageMetadata(torch.Size((0,)), torch.Size((2,))),
        ChunkStorageMetadata(torch.Size((1,)), torch.Size((2,))),
    ]
    assert md.storage_data is not None
    info = md.storage_data[MetadataIndex("v", (0,))]
    md.storage_data[MetadataIndex("v", (1,))] = info


def test_overlapping_chunks_are_detected_by_region(ckpt: Path) -> None:
    _rewrite(ckpt, _overlapping_chunks)
    with pytest.raises(
        CorruptCheckpointError, match=r"\.metadata: tensor 'v': stored chunks overlap"
    ):
        _load(ckpt)


def test_first_overlap() -> None:
    assert first_overlap([((0,), (2,)), ((1,), (2,))]) == (0, 1)
    assert first_overlap([((0,), (2,)), ((2,), (2,))]) is None
    grid = [((i, j), (2, 3)) for i in (0, 2, 4) for j in (0, 3)]
    assert first_overlap(grid) is None
    assert first_overlap([*grid, ((3, 2), (1, 2))]) is not None
    assert first_overlap([((0, 0), (0, 5)), ((0, 0), (4, 4))]) is None  # empty box
    assert first_overlap([((), ()), ((), ())]) == (0, 1)  # a scalar stored twice
    assert first_overlap([((0, 0), (2, 2)), ((0, 0), (2, 2))]) == (0, 1)  # a repeated box
    irregular = [((0, 0), (2, 4)), ((0, 2), (2, 2)), ((0, 1), (2, 2))]
    assert first_overlap(irregular) is not None
    flat = [((0, 0, i * 100), (1, 1, 100)) for i in range(4096)]  # one block, 4096 ranks
    assert first_overlap(flat) is None


def _reformulated_regular(md: Metadata) -> None:
    md.mcore_data = {"w": {ND_REFORMULATED_SHAPE_KEY: (4, 6)}}  # type: ignore[attr-defined]


def _grid_bomb(md: Metadata) -> None:
    tensor = md.state_dict_metadata["w"]
    tensor.size = torch.Size((700, 700, 1))  # type: ignore[union-attr]
    tensor.chunks = [ChunkStorageMetadata(torch.Size((0, 0, 0)), torch.Size((1, 1, 1)))]  # type: ignore[union-attr]
    md.mcore_data = {"w": {ND_REFORMULATED_SHAPE_KEY: (700, 700)}}  # type: ignore[attr-defined]


def _set(path: str, value: object) -> Callable[[Metadata], None]:
    def change(md: Metadata) -> None:
        obj: Any = md
        *parents, last = path.split(".")
        for name in parents:
            obj = obj.state_dict_metadata["w"] if name == "W" else getattr(obj, name)
        if last == "storage":
            assert md.storage_data is not None
            index = next(i for i in md.storage_data if i.fqn == "w")
            md.storage_data[index] = value  # type: ignore[assignment]
        else:
            setattr(obj, last, value)

    return change


CRAFTED = {
    "reformulated_regular": (_reformulated_regular, "not an N-D reformulation"),
    "grid_bomb": (_grid_bomb, "declares 490000 blocks"),
    "size_str": (
        _set("W.size", "abcd"),
        "tensor 'w': size must be a sequence of dimensions, found str 'abcd'",
    ),
    "size_none": (_set("W.size", None), "tensor 'w': size must be"),
    "size_bool": (_set("W.size", (True, 6)), "size holds bool True"),
    "dtype_str": (_set("W.properties.dtype", "float32"), "properties must name a dtype"),
    "chunks_none": (_set("W.chunks", None), "chunks must be a list"),
    "chunk_outside": (
        _set("W.chunks", [ChunkStorageMetadata(torch.Size((3, 0)), torch.Size((4, 6)))]),
        "exceeds shape",
    ),
    "storage_entry": (
        _set("storage", "x"),
        "storage of 'w': found str 'x', not a storage location",
    ),
    "mcore_list": (_set("mcore_data", [1]), "mcore_data: expected a dict"),
    "entry_int": (_set("state_dict_metadata", {"w": 3}), "key 'w': entry is int 3"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_type_confused_metadata_raises_our_error(ckpt: Path, case: str) -> None:
    change, message = CRAFTED[case]
    _rewrite(ckpt, change)
    with pytest.raises(CorruptCheckpointError) as info:
        _load(ckpt)
    text = str(info.value)
    assert ".metadata" in text and message in text, text


def test_storage_info_fields_are_checked(ckpt: Path) -> None:
    def change(md: Metadata) -> None:
        assert md.storage_data is not None
        for index, info in md.storage_data.items():
            if index.fqn == "w":
                info.offset = "0"  # type: ignore[assignment]

    _rewrite(ckpt, change)
    with pytest.raises(CorruptCheckpointError, match="storage of 'w': offset is str '0'"):
        _load(ckpt)


@pytest.mark.parametrize(
    "field,value",
    [("sharded_backend_version", True), ("common_backend_version", "1"), ("sharded_backend", 3)],
)
def test_metadata_json_fields_have_their_types(ckpt: Path, field: str, value: object) -> None:
    config = json.loads((ckpt / "metadata.json").read_text())
    config[field] = value
    (ckpt / "metadata.json").write_text(json.dumps(config))
    # A crafted file comes with the commit record deleted (it would refuse the file first).
    (ckpt / "commit.json").unlink(missing_ok=True)
    with pytest.raises(CorruptCheckpointError, match=f"metadata.json: field '{field}'"):
        _load(ckpt)
