"""The ``torch_dist`` (version 1) sharded strategies: PyTorch DCP format.

Save (every rank): group the leaves by sharded key, plan collectively
(:mod:`..state_dict_saver`), stage the data, write one file per bucket
(``__<rank>_<n>.distcp``), then finalize: the coordinator writes ``.metadata``.
Load (every rank): read ``.metadata`` with the restricted unpickler, validate
the requested shapes, read only the byte ranges this rank needs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from ..._torch_compat import DATA_FILE_SUFFIX
from ...engine import knobs
from ...engine.async_save.request import AsyncRequest
from ...engine.checkpoint import commit
from ...engine.raw.index import is_raw_bytes_file
from ...engine.safety import object_loader
from ...engine.storage.bucketing import is_data_file_of
from ...engine.storage.location import CheckpointDir
from ...engine.storage.metadata_blob import metadata_bytes
from ...engine.storage.metadata_index import INDEX_NAME as METADATA_INDEX_NAME
from ...engine.storage.metadata_index import encode_index
from ...engine.storage.reader import FileSystemReader, metadata_source
from ...errors import UnsafeCheckpointError
from ...mapping import ShardedBase, ShardedObject, ShardedStateDict, ShardedTensor
from ..base import (
    AsyncSaveShardedStrategy,
    CachedStructureOption,
    StrategyAction,
    register_default_strategy,
)
from ..collective_load import CollectiveLoadStrategy
from ..filesystem_async import FileSystemWriterAsync
from ..state_dict_saver import (
    CachedStructure,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from .converter import group_by_key
from .layout import ND_REFORMULATED_SHAPE_KEY
from .planners import MCoreLoadPlanner, MCoreSavePlanner

logger = logging.getLogger(__name__)

BACKEND = "torch_dist"
VERSION = 1
METADATA_FNAME = ".metadata"


def register_default_torch_strategies() -> None:
    """Register the ``torch_dist`` v1 strategies (idempotent)."""
    register_default_strategy(
        StrategyAction.LOAD_SHARDED,
        BACKEND,
        VERSION,
        TorchDistLoadShardedStrategy(),
        if_absent=True,
    )
    register_default_strategy(
        StrategyAction.SAVE_SHARDED,
        BACKEND,
        VERSION,
        TorchDistSaveShardedStrategy(BACKEND, VERSION),
        if_absent=True,
    )


def _drop_empty_flat(by_key: dict[str, list[ShardedBase]]) -> dict[str, list[ShardedBase]]:
    """Flat ShardedTensors with an empty range hold nothing to write."""
    out: dict[str, list[ShardedBase]] = {}
    for key, shards in by_key.items():
        if not any(map(_empty_flat, shards)):  # the usual case: the same list, no copy
            out[key] = shards
            continue
        kept = [s for s in shards if not _empty_flat(s)]
        if kept:
            out[key] = kept
    return out


def _empty_flat(sh: ShardedBase) -> bool:
    return (
        isinstance(sh, ShardedTensor)
        and sh.flattened_range is not None
        and sh.flattened_range.stop <= sh.flattened_range.start
    )


class TorchDistSaveShardedStrategy(CachedStructureOption, AsyncSaveShardedStrategy):
    """Saves ShardedTensors and ShardedObjects in PyTorch DCP format.

    Args:
        backend: ``"torch_dist"``.
        version: ``1``.
        keep_only_main_replica: write only ``replica_id == 0`` shards (otherwise
            DCP's deduplication picks one writer per chunk).
        thread_count: data files (and writer processes) per rank (default: the
            ``SAVE_THREAD_COUNT`` knob, 2).
        cached_metadata: reuse the global plan and metadata of the previous save
            when every rank's local plan is unchanged (no plan exchange). A rank whose
            leaves have the same keys, dtypes, shapes, offsets and flat ranges as at
            the previous save reuses that save's write items and file grouping, bound
            to the new data, instead of building them again. (The sharding check is
            skipped while no rank's shard records change, with or without it: see
            ``validated_structure``.)
        separation_hint: key prefix whose items go to files of their own.
        cpu_shm_mode: Megatron-Core 0.19's choice of staging GPU tensors in CPU shared
            memory; accepted and kept (``self.cpu_shm_mode``): our writer always stages
            to host memory that its worker processes can read.
        process_group: the ranks that save together (default: the world).
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        keep_only_main_replica: bool = True,
        thread_count: int | None = None,
        cached_metadata: bool = False,
        separation_hint: str | None = None,
        cpu_shm_mode: bool = False,
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(backend, version)
        self.cpu_shm_mode = cpu_shm_mode
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = knobs.SAVE_THREAD_COUNT.get(thread_count)
        self.cached_metadata = cached_metadata
        self.separation_hint = separation_hint
        self.process_group = process_group
        self._cached_structure: CachedStructure | None = None

    commit_files = (METADATA_FNAME, METADATA_INDEX_NAME)

    @property
    def cached_structure(self) -> CachedStructure | None:
        """What the next save reuses with ``cached_metadata`` (None before the first save)."""
        return self._cached_structure

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def files_written_by(self, checkpoint_dir: str | os.PathLike[str], rank: int) -> list[str]:
        ckpt = CheckpointDir.of(checkpoint_dir)
        tag = ckpt.context.save_tag  # during an overwriting save: only this save's files
        return [
            n for n in ckpt.listdir() if is_data_file_of(n, rank) and (not tag or f".{tag}." in n)
        ]

    def owns_file(self, name: str) -> bool:
        # The raw_bytes layout's files too: a torch_dist save over a raw_bytes
        # checkpoint replaces them (and deletes them once committed).
        return (
            name in self.commit_files or name.endswith(DATA_FILE_SUFFIX) or is_raw_bytes_file(name)
        )

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> AsyncRequest:
        """Plan collectively and return the request that stages, writes and commits.

        The returned request's ``preload_fn`` stages the data (the blocking part),
        its ``async_fn`` writes the files (one worker process per file), and its
        finalize function writes ``.metadata`` once every rank succeeded.
        """
        return self._request(sharded_state_dict, checkpoint_dir, in_process=False)

    def save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> None:
        """Synchronous save: the same request, written by threads of this process."""
        request = self._request(sharded_state_dict, checkpoint_dir, in_process=True)
        request.execute_sync(self.process_group)

    def _request(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: str | os.PathLike[str],
        in_process: bool,
    ) -> AsyncRequest:
        by_key = group_by_key(sharded_state_dict, self.keep_only_main_replica)
        by_key = _drop_empty_flat(by_key)
        writer = FileSystemWriterAsync(
            CheckpointDir.of(checkpoint_dir),  # the caller's handle (its save context)
            thread_count=self.thread_count,
            separation_hint=self.separation_hint,
        )
        planner = MCoreSavePlanner(
            dedup_replicated_tensors=not self.keep_only_main_replica,
            track_structure=self.cached_metadata,
        )
        _, metadata, structure = save_state_dict_async_plan(
            by_key,
            writer,
            self.process_group,
            planner=planner,
            cached_ckpt_structure=self._cached_structure if self.cached_metadata else None,
        )
        if self.cached_metadata:
            self._cached_structure = structure
        save_fn, preload_fn, save_args = writer.get_save_function_and_args(in_process)
        finalize = partial(
            save_state_dict_async_finalize,
            writer,
            metadata,
            self.process_group,
            structure=structure,
            planner=planner,
            release_plan=not self.cached_metadata,
        )
        return AsyncRequest(save_fn, tuple(save_args), [finalize], preload_fn=preload_fn)


def _prepare_destination(sh: ShardedTensor) -> None:
    """Allocate the request's tensor on the CPU if it has none. With
    ``allow_shape_mismatch`` it starts from zeros: the part the checkpoint does not
    cover comes back as zeros, never as uninitialized memory (a tensor the caller
    passed keeps its own values there)."""
    if sh.data is None:
        sh.init_data("cpu", torch.zeros if sh.allow_shape_mismatch else torch.empty)


class TorchDistLoadShardedStrategy(CollectiveLoadStrategy):
    """Loads ShardedTensors and ShardedObjects from a PyTorch DCP checkpoint.

    Args:
        cache_metadata, stream_ckpt_dequant, checkpoint_name: Megatron-Core 0.19's
            parameters, accepted and kept as attributes. The parsed ``.metadata`` is
            cached per checkpoint directory anyway, and FP8 targets are always filled
            through a staging tensor one at a time (what streaming dequantization is
            for).
        process_group: the ranks that load together (errors are raised on all).
        trusted: load ShardedObject payloads with plain pickle (only for
            checkpoints you wrote).
        allowed_types: extra classes ShardedObject payloads may contain.
    """

    metadata_files = (METADATA_FNAME, METADATA_INDEX_NAME)
    backend = BACKEND
    version = VERSION

    def __init__(
        self,
        cache_metadata: bool = False,
        stream_ckpt_dequant: bool = True,
        checkpoint_name: str | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        trusted: bool = False,
        allowed_types: Sequence[type] = (),
    ) -> None:
        super().__init__(process_group=process_group, trusted=trusted, allowed_types=allowed_types)
        self.cache_metadata = cache_metadata
        self.stream_ckpt_dequant = stream_ckpt_dequant
        self.checkpoint_name = checkpoint_name

    def fill(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> None:
        """Read every ShardedTensor/ShardedObject of the request through DCP (tensors
        without data are allocated on the CPU)."""
        # Only the grouping: the paths would be held while reading (100,000 leaves: 15 MiB).
        by_key = group_by_key(sharded_state_dict)
        # Before dropping empty flat ranges: they too come back as (empty) tensors.
        for shards in by_key.values():
            for sh in shards:
                if isinstance(sh, ShardedTensor):
                    _prepare_destination(sh)
        self._read(_drop_empty_flat(by_key), checkpoint_dir)

    def _read(
        self, by_key: dict[str, list[ShardedBase]], checkpoint_dir: str | os.PathLike[str]
    ) -> None:
        reader = FileSystemReader(CheckpointDir.of(checkpoint_dir))
        metadata = reader.read_metadata_of(by_key)  # only these keys' parts
        is_coordinator = not dist.is_initialized() or dist.get_rank(self.process_group) == 0
        planner = MCoreLoadPlanner(
            object_loader(checkpoint_dir, trusted=self.trusted, allowed_types=self.allowed_types)
        )
        planner.set_up_planner(by_key, metadata, is_coordinator)
        reader.set_up_storage_reader(metadata, is_coordinator)
        plan = reader.prepare_local_plan(planner.create_local_plan())
        plan = planner.finish_plan(plan)
        reader.read_data(plan, planner).wait()
        planner.check_complete()

    def load_tensors_metadata(
        self, checkpoint_dir: str | os.PathLike[str], metadata: Metadata | None = None
    ) -> ShardedStateDict:
        """Data-less ShardedTensors (logical global shape and dtype) by key.

        Tensors stored in the N-D reformulated (flat) form are reported with their
        logical shape, as flat ShardedTensors covering the whole tensor.
        """
        if metadata is None:
            metadata = FileSystemReader(CheckpointDir.of(checkpoint_dir)).read_metadata()
        mcore_data = getattr(metadata, "mcore_data", None) or {}
        out: ShardedStateDict = {}
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            dtype = md.properties.dtype
            orig = mcore_data.get(key, {}).get(ND_REFORMULATED_SHAPE_KEY)
            if orig is None:
                meta = torch.empty(tuple(md.size), dtype=dtype, device="meta")
                out[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
            else:
                shape = tuple(orig)
                numel = int(torch.Size(shape).numel())
                flat = torch.empty(numel, dtype=dtype, device="meta")
                out[key] = ShardedTensor.from_rank_offsets_flat(
                    key, flat, shape, flattened_range=slice(0, numel)
                ).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike[str]) -> ShardedStateDict:
        """Tensors (see :meth:`load_tensors_metadata`) and ShardedObjects (by unique key)."""
        from ..common import COMMON_STATE_OBJECT_KEY

        metadata = FileSystemReader(CheckpointDir.of(checkpoint_dir)).read_metadata()
        out: ShardedStateDict = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata) and key != COMMON_STATE_OBJECT_KEY:
                obj = ShardedObject.empty_from_unique_key(key)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return out

    def remove_sharded_tensors(
        self, checkpoint_dir: str | os.PathLike[str], key_prefix: str
    ) -> None:
        """Remove the tensors whose key starts with ``key_prefix`` (run on one rank).

        Crash-safe: the new ``.metadata`` is durable before any data file is
        deleted, and a data file that still holds other items is kept.
        """
        ckpt = CheckpointDir.of(checkpoint_dir)
        old = FileSystemReader(ckpt).read_metadata()
        # Every name checked (and made canonical) before anything changes.
        names = _data_file_names(ckpt, old)
        keep_sd = {
            k: v
            for k, v in old.state_dict_metadata.items()
            if not (isinstance(v, TensorStorageMetadata) and k.startswith(key_prefix))
        }
        keep_storage = {i: v for i, v in (old.storage_data or {}).items() if i.fqn in keep_sd}
        new = Metadata(
            state_dict_metadata=keep_sd,
            planner_data=old.planner_data,
            storage_data=keep_storage,
            storage_meta=old.storage_meta,
            version=getattr(old, "version", None),
        )
        mcore_data = getattr(old, "mcore_data", None)
        if mcore_data is not None:
            new.mcore_data = {k: v for k, v in mcore_data.items() if k in keep_sd}  # type: ignore[attr-defined]
        used = {names[id(info)] for info in keep_storage.values()}
        unused = set(names.values()) - used
        # The new .metadata (and its index) is committed before any data file goes (see
        # replace_files). Without a new index, an old one no longer matches: ignored.
        blob = metadata_bytes(new)
        files = {METADATA_FNAME: blob}
        index = encode_index(new, blob)
        if index is not None:
            files[METADATA_INDEX_NAME] = index
        commit.replace_files(ckpt, files, unused)

    def files_holding(self, checkpoint_dir: str | os.PathLike[str], keys: set[str]) -> set[str]:
        """The data files holding the items of ``keys`` (from ``.metadata``)."""
        return FileSystemReader(CheckpointDir.of(checkpoint_dir)).files_of(keys)


def _data_file_names(ckpt: CheckpointDir, metadata: Metadata) -> dict[int, str]:
    """``{id(storage info): canonical file name}`` for every item of ``metadata``.

    Raises:
        UnsafeCheckpointError: a name leaves the directory or is not a data file
            (``*.distcp``): ``remove_sharded_tensors`` never deletes anything else.
    """
    source = metadata_source(ckpt)
    out: dict[int, str] = {}
    for index, info in (metadata.storage_data or {}).items():
        name = ckpt.entry(getattr(info, "relative_path", None), source=source)
        if not name.endswith(DATA_FILE_SUFFIX):
            raise UnsafeCheckpointError(
                f"{source}: item {str(getattr(index, 'fqn', index))[:200]!r} is stored in "
                f"{name[:200]!r}, which is not a data file (*{DATA_FILE_SUFFIX}); "
                f"refusing to remove tensors from this checkpoint"
            )
        out[id(info)] = name
    return out
