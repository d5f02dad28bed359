"""dist_checkpointing._torch_compat: every private torch name we use still exists and
behaves as the storage layer relies on. A failure here means torch moved something:
update _torch_compat.py (and only it)."""

from __future__ import annotations

import dataclasses
import io
import pickle
import zipfile

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

from dist_checkpointing import _torch_compat as compat


def test_storage_info_fields_and_pickle_name() -> None:
    fields = [f.name for f in dataclasses.fields(compat.StorageInfo)]
    assert fields[:3] == ["relative_path", "offset", "length"]
    info = compat.StorageInfo("__0_0.distcp", 12, 34)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 12, 34)
    data = pickle.dumps(info)
    # .metadata refers to the class by torch's own name, so plain DCP can read it.
    assert b"torch.distributed.checkpoint.filesystem" in data and b"_StorageInfo" in data
    assert pickle.loads(data) == info
    # Without transform descriptors the pickled state has only the three fields
    # (as in checkpoints written by Megatron-Core and older torch).
    assert info.__getstate__() == {"relative_path": "__0_0.distcp", "offset": 12, "length": 34}


def test_storage_prefix() -> None:
    assert [f.name for f in dataclasses.fields(compat.StoragePrefix)] == ["prefix"]
    assert compat.StoragePrefix("__3_").prefix == "__3_"
    assert compat.StoragePrefix is dcp_fs._StoragePrefix


def test_layout_constants() -> None:
    assert compat.DCP_VERSION == "1.0.0"
    assert compat.DATA_FILE_SUFFIX == ".distcp"
    assert compat.METADATA_FILE_NAME == ".metadata"


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (torch.float32, "FloatStorage"),
        (torch.bfloat16, "BFloat16Storage"),
        (torch.float16, "HalfStorage"),
        (torch.int64, "LongStorage"),
        (torch.bool, "BoolStorage"),
        (torch.uint8, "ByteStorage"),
        (torch.float8_e4m3fn, None),
        (torch.float8_e5m2, None),
        (torch.uint16, None),
    ],
)
def test_legacy_storage_name_matches_torch_save(dtype: torch.dtype, name: str | None) -> None:
    assert compat.legacy_storage_name(dtype) == name
    buf = io.BytesIO()
    torch.save(torch.zeros(2, dtype=dtype), buf)
    pkl = zipfile.ZipFile(buf).read("archive/data.pkl")
    if name is None:
        assert b"torch.storage\nUntypedStorage" in pkl and b"_rebuild_tensor_v3" in pkl
    else:
        assert f"torch\n{name}\n".encode() in pkl and b"_rebuild_tensor_v2" in pkl


def test_rebuild_functions_are_torch_utils() -> None:
    assert compat.rebuild_tensor_v2.__module__ == "torch._utils"
    assert compat.rebuild_tensor_v2.__name__ == "_rebuild_tensor_v2"
    assert compat.rebuild_tensor_v3.__name__ == "_rebuild_tensor_v3"


def test_sharded_tensor_classes() -> None:
    assert [f.name for f in dataclasses.fields(compat.TorchShardMetadata)] == [
        "shard_offsets",
        "shard_sizes",
        "placement",
    ]
    assert [f.name for f in dataclasses.fields(compat.TorchShard)] == ["tensor", "metadata"]
    assert [f.name for f in dataclasses.fields(compat.TorchShardedTensorMetadata)] == [
        "shards_metadata",
        "size",
        "tensor_properties",
    ]
    assert "dtype" in [f.name for f in dataclasses.fields(compat.TorchShardTensorProperties)]
    assert hasattr(compat.TorchShardedTensor, "_init_from_local_shards_and_global_metadata")


def test_new_shared_tensor_like_is_shared_and_shaped() -> None:
    src = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    t = compat.new_shared_tensor_like(src)
    assert t.is_shared() and t.shape == src.shape and t.dtype == src.dtype
    t.copy_(src)
    assert torch.equal(t, src)
