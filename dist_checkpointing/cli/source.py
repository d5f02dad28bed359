"""A checkpoint opened by the CLI, in one process, through the public API.

Checkpoints with a ``metadata.json`` (ours in either layout, Megatron-Core's) are read with
:func:`dist_checkpointing.load` and friends; a plain PyTorch DCP checkpoint
(``.metadata`` only) is read with the ``torch_dist`` load strategy directly.
Nothing is unpickled except through the library's restricted loaders, and a
tensor (or a flat byte range of it) is read alone: memory stays bounded by
the largest tensor.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch

from .. import serialization
from .._torch_compat import METADATA_FILE_NAME
from ..core import CheckpointingConfig, maybe_load_config
from ..engine.raw.index import DATA_SUFFIX as RAW_DATA_SUFFIX
from ..engine.raw.index import INDEX_NAME as RAW_INDEX
from ..engine.raw.load import read_index as read_raw_index
from ..engine.storage.location import CheckpointDir
from ..engine.storage.reader import FileSystemReader
from ..engine.storage.resolve import is_url
from ..errors import CheckpointingException
from ..mapping import ShardedObject, ShardedTensor
from ..strategies.common import COMMON_STATE_OBJECT_KEY
from ..strategies.torch import TorchDistLoadShardedStrategy
from .ui import CliError

CONFIG_FNAME = "metadata.json"
RAW_BACKEND = "raw_bytes"


@dataclass
class TensorInfo:
    """What the checkpoint stores of one tensor."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    shards: int = 0
    stored_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


@dataclass
class Checkpoint:
    """An opened, complete checkpoint."""

    path: str
    config: CheckpointingConfig | None  # None: plain DCP (no metadata.json)
    metadata: Any  # torch.distributed.checkpoint.metadata.Metadata (None for raw_bytes)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    objects: list[str] = field(default_factory=list)

    @property
    def backend(self) -> str:
        if self.config is None:
            return "plain DCP (no metadata.json)"
        return f"{self.config.sharded_backend} v{self.config.sharded_backend_version}"

    def files(self) -> dict[str, int]:
        """Every file of the checkpoint directory and its size."""
        return file_sizes(self.path)

    def select(self, pattern: str | None) -> list[str]:
        """Tensor keys matching a glob ``pattern`` (all if None), sorted."""
        return sorted(k for k in self.tensors if pattern is None or fnmatchcase(k, pattern))

    def info(self, key: str) -> TensorInfo:
        if key not in self.tensors:
            raise CliError(f"{self.path}: no tensor {key!r} (see `inspect` for the keys)")
        return self.tensors[key]

    def _load(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.config is not None:
            out = serialization.load(request, self.path, validate_access_integrity=False)
            assert isinstance(out, dict)
            return out
        return TorchDistLoadShardedStrategy().load(request, self.path)

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole tensor ``key`` (read into ``out`` when given)."""
        info = self.info(key)
        data = torch.empty(info.shape, dtype=info.dtype) if out is None else out
        result = self._load({key: ShardedTensor.from_rank_offsets(key, data)})
        tensor: torch.Tensor = result[key]
        return tensor

    def read_flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the C-order flattened tensor (only those bytes)."""
        info = self.info(key)
        data = torch.empty(stop - start, dtype=info.dtype)
        request = ShardedTensor.from_rank_offsets_flat(
            key, data, info.shape, flattened_range=slice(start, stop)
        )
        tensor: torch.Tensor = self._load({key: request})[key]
        return tensor

    def common(self) -> dict[str, Any]:
        """The common (non-sharded) state; empty for plain DCP."""
        if self.config is None:
            return {}
        return serialization.load_common_state_dict(self.path)


def _describe(metadata: Any, ckpt: Checkpoint) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    logical = serialization.load_tensors_metadata if ckpt.config else None
    shapes: dict[str, Any] = {}
    if logical is not None:
        shapes = logical(ckpt.path)
    else:
        shapes = TorchDistLoadShardedStrategy().load_tensors_metadata(ckpt.path, metadata)
    stored: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(info.length)
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            sh = shapes[key]
            ckpt.tensors[key] = TensorInfo(
                key, tuple(sh.global_shape), sh.dtype, len(md.chunks), stored.get(key, 0)
            )
        elif key != COMMON_STATE_OBJECT_KEY:
            ckpt.objects.append(ShardedObject.empty_from_unique_key(key).unique_key)
    ckpt.objects.sort()


def is_checkpoint_dir(path: str) -> bool:
    """Whether ``path`` is a directory (an ``msc://`` URL: a prefix that holds objects)."""
    if not is_url(path):
        return os.path.isdir(path)
    try:
        return CheckpointDir.of(path).is_dir()
    except (CheckpointingException, OSError) as e:
        raise CliError(f"{path}: {one_line(e)}") from e


def _describe_raw(ckpt: Checkpoint) -> None:
    """Tensors and objects of a ``raw_bytes`` checkpoint, from its index."""
    index = read_raw_index(CheckpointDir.of(ckpt.path))
    lengths = index.columns["length"]
    shapes = serialization.load_tensors_metadata(ckpt.path)
    for key, rows in index.rows_by_key.items():
        if key in shapes:
            sh = shapes[key]
            stored = sum(lengths[r] for r in rows)
            ckpt.tensors[key] = TensorInfo(key, tuple(sh.global_shape), sh.dtype, len(rows), stored)
        else:
            ckpt.objects.append(key)
    ckpt.objects.sort()


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a complete checkpoint; :class:`CliError` (one line) otherwise."""
    path = os.fspath(path)
    if not is_checkpoint_dir(path):
        raise CliError(f"{path}: not a directory")
    ckpt_dir = CheckpointDir.of(path)
    try:
        config = maybe_load_config(path)
        if config is not None:
            serialization.verify_checkpoint_and_load_strategy(path)
        if config is not None and config.sharded_backend == RAW_BACKEND:
            ckpt = Checkpoint(path, config, None)
            _describe_raw(ckpt)
            return ckpt
        if config is None and not ckpt_dir.has(METADATA_FILE_NAME):
            raise CliError(f"{path}: {incomplete_reason(path)}")
        metadata = FileSystemReader(ckpt_dir).read_metadata()
        ckpt = Checkpoint(path, config, metadata)
        _describe(metadata, ckpt)
    except CheckpointingException as e:
        raise CliError(one_line(e)) from e
    return ckpt


def incomplete_reason(path: str) -> str:
    """Why ``path`` is not a complete checkpoint (or "" if it has both markers)."""
    names = set(os.listdir(path) if not is_url(path) else CheckpointDir.of(path).listdir())
    has_data = any(
        n.endswith(".distcp") or n.endswith(RAW_DATA_SUFFIX) or n == "common.pt" for n in names
    )
    if CONFIG_FNAME not in names and METADATA_FILE_NAME not in names:
        if has_data:
            return "incomplete checkpoint: metadata.json and .metadata are missing (the save never finished)"
        return "not a checkpoint (no metadata.json, no .metadata)"
    if RAW_INDEX in names or any(n.endswith(RAW_DATA_SUFFIX) for n in names):
        if RAW_INDEX not in names:
            return f"incomplete checkpoint: {RAW_INDEX} is missing"
        return ""
    if METADATA_FILE_NAME not in names:
        return "incomplete checkpoint: .metadata is missing"
    return ""


def file_sizes(path: str) -> dict[str, int]:
    """``{name: size}`` of the regular files directly in ``path``."""
    if is_url(path):  # the objects of the prefix (their sizes came with the listing)
        ckpt = CheckpointDir.of(path)
        sizes = {}
        for name in ckpt.listdir():
            try:
                sizes[name] = ckpt.size(name)
            except (IsADirectoryError, FileNotFoundError):
                continue  # a deeper prefix, not an object
        return dict(sorted(sizes.items()))
    out = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            out[name] = os.path.getsize(full)
    return out


def one_line(error: BaseException) -> str:
    """The first line of an exception's message, whitespace collapsed."""
    text = str(error).strip().splitlines()
    return re.sub(r"\s+", " ", text[0]) if text else type(error).__name__


__all__ = [
    "Checkpoint",
    "is_checkpoint_dir",
    "TensorInfo",
    "file_sizes",
    "incomplete_reason",
    "one_line",
    "open_checkpoint",
]
