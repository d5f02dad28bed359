"""The one place that imports private or undocumented torch names.

The checkpoint format is PyTorch DCP's, and a few pieces of it are only reachable
through private torch names. They are re-exported here under stable names so that
a torch upgrade touches one file; ``tests/test_torch_compat.py`` checks that every
one still exists with the fields and behaviour we rely on.

Re-exported:

- :data:`StorageInfo` (``filesystem._StorageInfo``): where one item lives
  (``relative_path``, ``offset``, ``length``, optional ``transform_descriptors``).
  Pickled into ``.metadata`` by its torch name, so readers need no class of ours.
- :data:`StoragePrefix` (``filesystem._StoragePrefix``): per-rank file name prefix
  (``prefix``), carried in ``SavePlan.storage_data``.
- :data:`DCP_VERSION`, :data:`DATA_FILE_SUFFIX`, :data:`METADATA_FILE_NAME`:
  constants of torch's filesystem layout (``"1.0.0"``, ``".distcp"``, ``".metadata"``).
- :func:`rebuild_tensor_v2`, :func:`rebuild_tensor_v3`: the functions that a
  ``torch.save`` pickle of a tensor references (``torch._utils``).
- :func:`legacy_storage_name`: the typed-storage class name (``"FloatStorage"``)
  that ``torch.save`` writes for a dtype, or ``None`` when the dtype is saved with
  an untyped storage and ``_rebuild_tensor_v3``.
- :data:`TorchShardedTensor`, :data:`TorchShard`, :data:`TorchShardMetadata`,
  :data:`TorchShardedTensorMetadata`, :data:`TorchShardTensorProperties`: PyTorch's
  (``torch.distributed._shard``) sharded tensor and its metadata, for Megatron-Core's
  converter API (``sharded_tensor_to_torch_sharded_tensor``); DCP's default planners
  turn it into per-chunk write and read items.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.storage
from torch._utils import _rebuild_tensor_v2, _rebuild_tensor_v3
from torch.distributed._shard.metadata import ShardMetadata as _ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor as _ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata as _STMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as _STProperties
from torch.distributed._shard.sharded_tensor.shard import Shard as _Shard
from torch.distributed.checkpoint import filesystem as _dcp_filesystem

StorageInfo = _dcp_filesystem._StorageInfo
StoragePrefix = _dcp_filesystem._StoragePrefix

DCP_VERSION: str = _dcp_filesystem.CURRENT_DCP_VERSION
DATA_FILE_SUFFIX: str = _dcp_filesystem.DEFAULT_SUFFIX
METADATA_FILE_NAME: str = _dcp_filesystem._metadata_fn

TorchShardedTensor = _ShardedTensor
TorchShard = _Shard
TorchShardMetadata = _ShardMetadata
TorchShardedTensorMetadata = _STMetadata
TorchShardTensorProperties = _STProperties

rebuild_tensor_v2: Callable[..., torch.Tensor] = _rebuild_tensor_v2
rebuild_tensor_v3: Callable[..., torch.Tensor] = _rebuild_tensor_v3


def legacy_storage_name(dtype: torch.dtype) -> str | None:
    """The ``torch.<Name>Storage`` class name ``torch.save`` uses for ``dtype``.

    ``None`` means torch saves tensors of this dtype with ``torch.storage.UntypedStorage``
    and ``torch._utils._rebuild_tensor_v3`` (float8, uint16/32/64, ...).
    """
    if dtype in torch.storage._new_dtypes():
        return None
    names: dict[Any, str] = torch.storage._dtype_to_storage_type_map()
    return names.get(dtype)


def new_shared_tensor_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized CPU tensor like ``t`` whose storage is in shared memory from
    the start (``share_memory_()`` on a fresh tensor would copy it once more)."""
    nbytes = t.numel() * t.element_size()
    # ``_new_shared`` is untyped in torch's stubs.
    storage = cast(Any, torch.UntypedStorage)._new_shared(nbytes)
    return torch.empty(0, dtype=t.dtype).set_(storage).view(t.shape)


__all__ = [
    "new_shared_tensor_like",
    "DATA_FILE_SUFFIX",
    "DCP_VERSION",
    "METADATA_FILE_NAME",
    "StorageInfo",
    "StoragePrefix",
    "TorchShard",
    "TorchShardMetadata",
    "TorchShardTensorProperties",
    "TorchShardedTensor",
    "TorchShardedTensorMetadata",
    "legacy_storage_name",
    "rebuild_tensor_v2",
    "rebuild_tensor_v3",
]
