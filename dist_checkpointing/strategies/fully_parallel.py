"""Fully parallel save and load: spread the work over the replicas in a group.

Megatron-Core's ``strategies.fully_parallel`` module path. A state replicated over
a data-parallel group is, by default, written and read entirely by the ranks
that hold the main replicas. The wrappers share that work:

- :class:`FullyParallelSaveStrategyWrapper`: every shard held by several ranks of
  ``parallelization_group`` is written once, by the rank a deterministic,
  size-balanced assignment picks (:mod:`dist_checkpointing.exchange_utils`);
- :class:`FullyParallelLoadStrategyWrapper`: every shard needed by several ranks of
  the group is read from storage by one of them and sent to the others
  (``exchange_algo``: ``broadcast``, ``gather_object`` or ``gather_rounds``);
  ShardedObjects too. Works for any load layout, on gloo (CPU) and NCCL (CUDA).

Call sequence (every rank of the world, since the wrapped strategies are
collective): ``save``/``async_save``/``load`` compute the distribution (one
``all_gather_object`` in the group, or the cached one with
``do_cache_distribution``), then call the wrapped strategy; a load then
exchanges within the group.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..dict_utils import dict_list_map_outplace, nested_values
from ..engine.async_save.request import AsyncRequest
from ..engine.collectives import RankGroup
from ..engine.shard_distribution import distribute
from ..errors import CheckpointingException
from ..exchange_utils import (
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
    exchange_loaded_objects_gather_object,
)
from ..mapping import ShardedBase, ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from ..utils import _sharded_object_id, _sharded_tensor_shard_id, _ShardId
from .base import AsyncSaveShardedStrategy, LoadShardedStrategy, SaveShardedStrategy

logger = logging.getLogger(__name__)

T = TypeVar("T")

Path = str | os.PathLike[str]


def distribute_main_replicas_with_precomputed_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group: dist.ProcessGroup | None,
    precomputed_distribution: ShardDistribution | None,
) -> None:
    """Make the assigned rank the main replica of each shard of this group (in place).

    Shards whose main replica is in another group are left alone.
    """
    if not RankGroup(parallelization_group).distributed:
        return
    if precomputed_distribution is None:
        raise CheckpointingException("a group of several ranks needs a precomputed distribution")
    rank = RankGroup(parallelization_group).rank
    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, ShardedTensor):
            continue
        shard_id = _sharded_tensor_shard_id(sh)
        if shard_id in precomputed_distribution.shards_in_this_group:
            main = precomputed_distribution.main_rank_for_shard[shard_id] == rank
            sh.replica_id = 0 if main else 1


def _local_shard_keys(sharded_state_dict: ShardedStateDict) -> list[tuple[Any, ...]]:
    """What a distribution depends on, per local ShardedTensor: its shard id, local shape
    and dtype (the sizes balanced and exchanged) and replica id (which group holds the
    main replica). A cached distribution is reused only while none of it changed."""
    return sorted(
        (_sharded_tensor_shard_id(sh), tuple(sh.local_shape), str(sh.dtype), repr(sh.replica_id))
        for sh in nested_values(sharded_state_dict)
        if isinstance(sh, ShardedTensor)
    )


class _CachedDistribution:
    """A distribution reused while every rank of the group has the same shards."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.shard_keys: list[tuple[Any, ...]] | None = None
        self.distribution: ShardDistribution | None = None

    def get(
        self,
        sharded_state_dict: ShardedStateDict,
        group: dist.ProcessGroup | None,
        compute: Callable[[], ShardDistribution | None],
    ) -> ShardDistribution | None:
        if not self.enabled:
            return compute()
        keys = _local_shard_keys(sharded_state_dict)
        changed = int(self.shard_keys != keys)
        (any_changed,) = RankGroup(group).all_reduce_ints([changed], op=dist.ReduceOp.MAX)
        if any_changed:
            self.shard_keys, self.distribution = keys, compute()
        return self.distribution


class _Wrapper:
    """What both wrappers share: the wrapped strategy, its process group, the cache."""

    base_strategy: Any
    _cache: _CachedDistribution

    @property
    def cached_distribution(self) -> ShardDistribution | None:
        """The assignment the next call reuses (with ``do_cache_distribution``)."""
        return self._cache.distribution

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The ranks that save or load together (the wrapped strategy's)."""
        return getattr(self.base_strategy, "process_group", None)

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        self.base_strategy = copy.copy(self.base_strategy)
        self.base_strategy.process_group = group

    @property
    def can_handle_sharded_objects(self) -> bool:
        handles: bool = self.base_strategy.can_handle_sharded_objects
        return handles


class FullyParallelSaveStrategyWrapper(_Wrapper, AsyncSaveShardedStrategy):
    """Writes each shard replicated in ``parallelization_group`` once, on the rank a
    size-balanced assignment picks, through ``strategy``.

    Args:
        strategy: the save strategy that writes (e.g. ``TorchDistSaveShardedStrategy``).
        parallelization_group: the ranks that share the writes (default: the world).
        do_cache_distribution: reuse the assignment while the shards stay the same.
        backend, version: Megatron-Core 0.19's parameters naming the format written;
            by default (None) those of ``strategy``, and they must agree with it (the
            wrapped strategy decides what is written).
    """

    base_strategy: SaveShardedStrategy

    def __init__(
        self,
        strategy: SaveShardedStrategy,
        parallelization_group: dist.ProcessGroup | None = None,
        do_cache_distribution: bool = False,
        backend: str | None = None,
        version: int | None = None,
    ) -> None:
        for name, given, actual in (
            ("backend", backend, strategy.backend),
            ("version", version, strategy.version),
        ):
            if given is not None and given != actual:
                raise CheckpointingException(
                    f"FullyParallelSaveStrategyWrapper({name}={given!r}) does not match the "
                    f"wrapped strategy's {name} {actual!r}: the wrapped strategy writes the format"
                )
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.commit_files = strategy.commit_files
        self._cache = _CachedDistribution(do_cache_distribution)

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Rewrite ``replica_id`` of the (copied) leaves so that exactly the assigned
        rank holds the main replica of each shard of the group."""
        distribution = self._cache.get(
            sharded_state_dict,
            self.parallelization_group,
            lambda: determine_main_replica_uniform_distribution(
                sharded_state_dict, self.parallelization_group
            ),
        )
        distribute_main_replicas_with_precomputed_distribution(
            sharded_state_dict, self.parallelization_group, distribution
        )

    def _parallelized(self, sharded_state_dict: ShardedStateDict) -> ShardedStateDict:
        # Shallow copies of the leaves: the caller's replica ids stay as they were.
        copied: ShardedStateDict = dict_list_map_outplace(
            lambda x: copy.copy(x) if isinstance(x, ShardedTensor) else x, sharded_state_dict
        )
        self.apply_saving_parallelization(copied)
        return copied

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        self.base_strategy.save(self._parallelized(sharded_state_dict), checkpoint_dir)

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path
    ) -> AsyncRequest:
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(f"{self.base_strategy} does not support async saves")
        return self.base_strategy.async_save(self._parallelized(sharded_state_dict), checkpoint_dir)

    def files_written_by(self, checkpoint_dir: Path, rank: int) -> list[str]:
        return self.base_strategy.files_written_by(checkpoint_dir, rank)

    def owns_file(self, name: str) -> bool:
        return self.base_strategy.owns_file(name)


class FullyParallelLoadStrategyWrapper(_Wrapper, LoadShardedStrategy):
    """Reads each shard needed by several ranks of ``parallelization_group`` once,
    then exchanges it within the group.

    Args:
        strategy: the load strategy that reads (e.g. ``TorchDistLoadShardedStrategy``).
        parallelization_group: the ranks that share the reads (default: the world).
        do_cache_distribution: reuse the assignment while the request stays the same.
        exchange_algo: ``"broadcast"`` (default), ``"gather_object"`` or ``"gather_rounds"``.
    """

    base_strategy: LoadShardedStrategy

    def __init__(
        self,
        strategy: LoadShardedStrategy,
        parallelization_group: dist.ProcessGroup | None = None,
        do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
    ) -> None:
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
        self._cache = _CachedDistribution(do_cache_distribution)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.base_strategy.check_version_compatibility(loaded_version)

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: Path, key_prefix: str) -> None:
        self.base_strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)

    def files_holding(self, checkpoint_dir: Path, keys: set[str]) -> set[str]:
        return self.base_strategy.files_holding(checkpoint_dir, keys)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        """Read this rank's share, exchange, and return the filled state dict."""
        group = RankGroup(self.parallelization_group)
        if not group.distributed:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        distribution = self._cache.get(
            sharded_state_dict,
            self.parallelization_group,
            lambda: determine_main_replica_uniform_distribution(
                sharded_state_dict, self.parallelization_group, ignore_groups=True
            ),
        )
        assert distribution is not None
        plan = _LoadShare(sharded_state_dict, distribution, group)
        loaded = self.base_strategy.load(plan.to_read(), checkpoint_dir)
        tensors, objects = plan.split_loaded(loaded)
        tensors = exchange_by_distribution(
            tensors,
            plan.unloaded,
            distribution,
            self.parallelization_group,
            self.exchange_algo,
        )
        objects = plan.exchange_objects(objects, self.parallelization_group)
        return plan.fill(tensors, objects)


class _LoadShare:
    """This rank's part of a fully parallel load: what it reads, what it receives."""

    def __init__(
        self,
        sharded_state_dict: ShardedStateDict,
        distribution: ShardDistribution,
        group: RankGroup,
    ) -> None:
        self.sharded_state_dict = sharded_state_dict
        self.reads: dict[_ShardId, ShardedBase] = {}
        self.unloaded: dict[_ShardId, ShardedTensor] = {}
        self.shared_objects: set[_ShardId] = set()  # objects several ranks need
        objects: dict[_ShardId, ShardedObject] = {}
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedTensor):
                shard_id = _sharded_tensor_shard_id(sh)
                if distribution.main_rank_for_shard.get(shard_id, group.rank) == group.rank:
                    self.reads.setdefault(shard_id, sh)
                else:
                    self.unloaded.setdefault(shard_id, sh)
            elif isinstance(sh, ShardedObject):
                objects.setdefault(_sharded_object_id(sh), sh)
        self._assign_objects(objects, group)

    def _assign_objects(self, objects: dict[_ShardId, ShardedObject], group: RankGroup) -> None:
        """Each object needed in the group is read by one of the ranks needing it (the
        shards' distribution, every object counted as one byte)."""
        rows = [(object_id, 1, True) for object_id in objects]
        found = distribute(rows, group, ignore_groups=True)
        self.shared_objects = found.shared
        for object_id, sh in objects.items():
            if found.main_rank[object_id] == group.rank:
                self.reads[object_id] = sh

    def exchange_objects(
        self, loaded: dict[_ShardId, Any], parallelization_group: dist.ProcessGroup | None
    ) -> dict[_ShardId, Any]:
        """Every object several ranks need, from the rank that read it, to every rank of
        the group (one ``all_gather_object``, skipped by every rank alike where there is
        none); an object only this rank needs (its own RNG state, say) stays here."""
        shared = self.shared_objects
        if not shared:
            return loaded
        sent = {k: v for k, v in loaded.items() if k in shared}
        received = exchange_loaded_objects_gather_object(
            sent, parallelization_group=parallelization_group
        )
        received.update((k, v) for k, v in loaded.items() if k not in shared)
        return received

    def to_read(self) -> ShardedStateDict:
        """The request for the wrapped strategy: this rank's share, keyed by position."""
        return {str(i): sh for i, sh in enumerate(self.reads.values())}

    def split_loaded(
        self, loaded: StateDict
    ) -> tuple[dict[_ShardId, torch.Tensor], dict[_ShardId, Any]]:
        tensors: dict[_ShardId, torch.Tensor] = {}
        objects: dict[_ShardId, Any] = {}
        for i, (shard_id, sh) in enumerate(self.reads.items()):
            target = tensors if isinstance(sh, ShardedTensor) else objects
            target[shard_id] = loaded[str(i)]
        return tensors, objects

    def fill(
        self, tensors: dict[_ShardId, torch.Tensor], objects: dict[_ShardId, Any]
    ) -> StateDict:
        """The state dict with every leaf replaced by its loaded tensor or object."""
        handed_out: set[_ShardId] = set()

        def value(sh: Any) -> Any:
            if isinstance(sh, ShardedObject):
                return objects[_sharded_object_id(sh)]
            if not isinstance(sh, ShardedTensor):
                return sh
            shard_id = _sharded_tensor_shard_id(sh)
            tensor = tensors[shard_id]
            if sh.data is not None and sh.data is not tensor:
                sh.data.copy_(tensor)
                return sh.data
            # The same shard requested twice on this rank: the second gets a copy.
            result = tensor.clone() if shard_id in handed_out else tensor
            handed_out.add(shard_id)
            return result

        result: StateDict = dict_list_map_outplace(value, self.sharded_state_dict)
        return result


__all__ = [
    "FullyParallelLoadStrategyWrapper",
    "FullyParallelSaveStrategyWrapper",
    "distribute_main_replicas_with_precomputed_distribution",
]
