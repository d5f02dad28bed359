"""The ``raw_bytes`` (version 1) sharded strategies: tensor bytes at aligned offsets.

A layout of our own, chosen with ``get_default_save_sharded_strategy("raw_bytes", 1)``
(``torch_dist`` stays the default): every main-replica chunk's bytes at an
aligned offset of a few data files per rank (``__<rank>_<n>.dcpraw``), described
by one binary index (``.raw_index``: a JSON header and numpy tables, no pickle)
that the coordinator writes at finalize. Load dispatches on ``metadata.json``
as for every backend. Megatron-Core and PyTorch DCP cannot read it: convert
with ``dist-checkpointing convert --to torch_dist``. The engine does the work
(:mod:`dist_checkpointing.engine.raw`); these classes are its Megatron-style face.

Call sequence of a save: see :mod:`dist_checkpointing.engine.raw.save`; of a
load: :mod:`dist_checkpointing.engine.raw.load`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch.distributed as dist

from .._torch_compat import DATA_FILE_SUFFIX
from ..dict_utils import nested_values
from ..engine import knobs
from ..engine.async_save.request import AsyncRequest
from ..engine.checkpoint import commit
from ..engine.collectives import RankGroup
from ..engine.raw import load as raw_load
from ..engine.raw.index import DATA_SUFFIX, INDEX_NAME, KIND_OBJECT, is_raw_bytes_file
from ..engine.raw.plan_reuse import LayoutCache
from ..engine.raw.save import save_request
from ..engine.safety import object_loader
from ..engine.storage.location import CheckpointDir
from ..engine.storage.metadata_index import INDEX_NAME as METADATA_INDEX_NAME
from ..mapping import ShardedStateDict, is_sharded_base
from .base import (
    AsyncSaveShardedStrategy,
    CachedStructureOption,
    StrategyAction,
    register_default_strategy,
)
from .collective_load import CollectiveLoadStrategy

BACKEND = "raw_bytes"
VERSION = 1

# The torch_dist layout's files: a raw_bytes save over a torch_dist checkpoint
# replaces them (and deletes them once committed), like its own.
_TORCH_DIST_METADATA = ".metadata"


def register_default_raw_bytes_strategies() -> None:
    """Register the ``raw_bytes`` v1 strategies (idempotent)."""
    register_default_strategy(
        StrategyAction.LOAD_SHARDED, BACKEND, VERSION, RawBytesLoadShardedStrategy(), if_absent=True
    )
    register_default_strategy(
        StrategyAction.SAVE_SHARDED,
        BACKEND,
        VERSION,
        RawBytesSaveShardedStrategy(BACKEND, VERSION),
        if_absent=True,
    )


class RawBytesSaveShardedStrategy(CachedStructureOption, AsyncSaveShardedStrategy):
    """Saves ShardedTensors (grid blocks and flat ranges) and ShardedObjects as raw bytes.

    Args:
        backend: ``"raw_bytes"``.
        version: ``1``.
        thread_count: data files (and writer threads) per rank (default: the
            ``SAVE_THREAD_COUNT`` knob, 2).
        cached_metadata: reuse the last save's layout (files, offsets, index
            entries) while the structure of the saved state stays the same, as
            ``torch_dist``'s option of that name reuses its plan (see
            :mod:`~dist_checkpointing.engine.raw.plan_reuse`).
        process_group: the ranks that save together (default: the world).
    """

    commit_files = (INDEX_NAME,)

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        thread_count: int | None = None,
        cached_metadata: bool = False,
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(backend, version)
        self.thread_count = knobs.SAVE_THREAD_COUNT.get(thread_count)
        self.cached_metadata = cached_metadata
        self.layout_cache = LayoutCache()  # used while cached_metadata is set
        self.process_group = process_group

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def owns_file(self, name: str) -> bool:
        return (
            is_raw_bytes_file(name)
            or name in (_TORCH_DIST_METADATA, METADATA_INDEX_NAME)
            or name.endswith(DATA_FILE_SUFFIX)
        )

    def files_written_by(self, checkpoint_dir: str | os.PathLike[str], rank: int) -> list[str]:
        ckpt = CheckpointDir.of(checkpoint_dir)
        tag = ckpt.context.save_tag  # during an overwriting save: only this save's files
        prefix = f"__{rank}_"
        return [
            n
            for n in ckpt.listdir()
            if n.startswith(prefix)
            and n.endswith(DATA_SUFFIX)
            and (n[len(prefix) :].split(".")[0].isdigit())
            and (not tag or f".{tag}." in n)
        ]

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> AsyncRequest:
        """Plan this rank's files and return the request that stages, writes, indexes."""
        return self._request(sharded_state_dict, checkpoint_dir, in_process=False)

    def save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> None:
        """Synchronous save: the same request, written by threads of this process."""
        self._request(sharded_state_dict, checkpoint_dir, in_process=True).execute_sync(
            self.process_group
        )

    def _request(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any, in_process: bool
    ) -> AsyncRequest:
        leaves = [x for x in nested_values(sharded_state_dict) if is_sharded_base(x)]
        group = RankGroup(self.process_group)
        ckpt = CheckpointDir.of(checkpoint_dir)
        cache = self.layout_cache if self.cached_metadata else None
        return save_request(leaves, ckpt, group, self.thread_count, in_process, cache)


class RawBytesLoadShardedStrategy(CollectiveLoadStrategy):
    """Loads a ``raw_bytes`` checkpoint into any layout (resharding on load); the
    arguments are those of :class:`~.collective_load.CollectiveLoadStrategy`."""

    metadata_files = (INDEX_NAME,)
    backend = BACKEND
    version = VERSION

    def fill(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> None:
        """Read every ShardedTensor/ShardedObject of the request from the index's
        entries (tensors without data are allocated on the CPU)."""
        ckpt = CheckpointDir.of(checkpoint_dir)
        leaves = [x for x in nested_values(sharded_state_dict) if is_sharded_base(x)]
        load_object = object_loader(ckpt, trusted=self.trusted, allowed_types=self.allowed_types)
        raw_load.load_leaves(leaves, ckpt, load_object)

    def load_tensors_metadata(self, checkpoint_dir: str | os.PathLike[str]) -> ShardedStateDict:
        """Data-less ShardedTensors (global shape and dtype) by key; tensors stored as
        flat ranges are reported as flat ShardedTensors covering the whole tensor."""
        return raw_load.tensors_metadata(raw_load.key_heads(CheckpointDir.of(checkpoint_dir)))

    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike[str]) -> ShardedStateDict:
        """Tensors (see :meth:`load_tensors_metadata`) and ShardedObjects (by unique key)."""
        index = raw_load.key_heads(CheckpointDir.of(checkpoint_dir))
        out = raw_load.objects_metadata(index)
        out.update(raw_load.tensors_metadata(index))
        return out

    def remove_sharded_tensors(
        self, checkpoint_dir: str | os.PathLike[str], key_prefix: str
    ) -> None:
        """Remove the tensors whose key starts with ``key_prefix`` (run on one rank).

        Crash-safe: the new index is committed before any data file is deleted; a
        data file still holding kept entries stays.
        """
        ckpt = CheckpointDir.of(checkpoint_dir)
        index = raw_load.read_index(ckpt)
        kinds = index.columns["kind"]
        drop = np.array(
            [
                k.startswith(key_prefix) and kind != KIND_OBJECT
                for k, kind in zip(index.key_list, kinds)
            ],
            dtype=bool,
        )
        new, unused = index.without_rows(drop)
        commit.replace_files(ckpt, {INDEX_NAME: new.to_bytes()}, unused)
        ckpt.forget(INDEX_NAME)

    def files_holding(self, checkpoint_dir: str | os.PathLike[str], keys: set[str]) -> set[str]:
        """The data files holding the entries of ``keys`` (from the index)."""
        return raw_load.files_holding(CheckpointDir.of(checkpoint_dir), keys)


__all__ = [
    "BACKEND",
    "VERSION",
    "RawBytesLoadShardedStrategy",
    "RawBytesSaveShardedStrategy",
    "is_raw_bytes_file",
    "register_default_raw_bytes_strategies",
]
