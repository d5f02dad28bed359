"""The tensor-aware state dict: Megatron-Core's form of a local (non-persistent) checkpoint.

Megatron-Core's ``dist_checkpointing.tensor_aware_state_dict`` module path.
:class:`MCoreTensorAwareStateDict` holds one rank's part of a sharded state dict
split into the *common* state and the *sharded* leaves, and lets a checkpoint
manager take the tensors out (leaving a *hollow* state dict that pickles small),
move them between devices, send them to other ranks and put them back.
nvidia-resiliency-ext's ``LocalCheckpointManager`` saves one such object per
rank to local storage (SSD, RAM disk) and loads it back after a restart.

The lifecycle (every rank makes every call, with the same arguments):

1. ``tasd, distribution = MCoreTensorAwareStateDict.from_state_dict(sharded_sd,
   algo, parallelization_group, cached_metadata)``: collective (sharding
   validation unless ``cached_metadata`` is given; with ``algo="fully_parallel"``
   one metadata exchange, then each shard replicated in the group keeps its data
   on one rank only);
2. the manager saves it: ``copy_tensors_to_cpu()``, then pickling; with
   replication, ``pop_tensors()`` / ``insert_tensors()`` on the sender and
   ``init_tensors()`` on the receiver;
3. the manager loads it: unpickling, then ``restore_tensor_device()``;
4. ``tasd.to_state_dict(sharded_sd, algo, exchange_algo, ...)``: collective
   (validation, strict key handling; with ``fully_parallel`` the shards other
   ranks kept are exchanged): returns the state dict, as :func:`dist_checkpointing.load` does.

nvidia-resiliency-ext is optional (``pip install "dist_checkpointing[nvrx]"``).
When it is installed, :data:`TensorAwareStateDict` is its base class; otherwise
it is our own class with the same interface, so this module always imports,
and :meth:`MCoreTensorAwareStateDict.from_state_dict` raises
:class:`~dist_checkpointing.errors.MissingDependencyError` saying what to install.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ._tensor_aware_base import HAVE_NVRX, NVRX_INSTALL_HINT, TensorAwareStateDict
from .dict_utils import dict_list_map_inplace, dict_list_map_outplace, merge, nested_values
from .engine.collectives import ProcessGroup, RankGroup
from .errors import (
    CheckpointingException,
    InvalidArgumentError,
    KeyMismatchError,
    MissingDependencyError,
)
from .exchange_utils import (
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
)
from .mapping import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    apply_factory_merges,
)
from .state_dict_utils import load_preprocess, save_preprocess
from .utils import _sharded_object_id, _sharded_tensor_shard_id, _ShardId, extract_sharded_base
from .validation import (
    StrictHandling,
    determine_global_metadata,
    parse_strict_flag,
    validate_integrity_and_strict_load,
)

logger = logging.getLogger(__name__)

_ALGOS = ("atomic", "fully_parallel")


def _check_algo(algo: str) -> bool:
    """Whether ``algo`` is ``"fully_parallel"`` (else ``"atomic"``)."""
    if algo not in _ALGOS:
        raise InvalidArgumentError(
            f"Only {' and '.join(repr(a) for a in _ALGOS)} sharding algorithms are supported, "
            f"got {algo!r}"
        )
    return algo == "fully_parallel"


def _copy_leaf(x: Any) -> Any:
    return copy.copy(x) if isinstance(x, ShardedBase) else x


def _describe_shard(shard_id: _ShardId) -> str:
    key, offset, flat = shard_id
    return f"'{key}' at offset {offset}" + (f" (flat range {flat})" if flat else "")


@dataclass
class MCoreTensorAwareStateDict(TensorAwareStateDict):
    """One rank's part of a sharded state dict, as a local checkpoint manager handles it.

    Args:
        common: the common (non-sharded) state.
        sharded_state_dict: the sharded leaves (ShardedTensors and ShardedObjects).
        _is_hollow: whether the tensors are popped out (see :meth:`pop_tensors`).

    Each ShardedTensor is in one of three states: it holds data; it is popped
    (hollow: no data, its device remembered); or it was left out by a fully
    parallel :meth:`from_state_dict` (no data; another rank holds the shard).
    """

    common: StateDict
    sharded_state_dict: ShardedStateDict
    _is_hollow: bool = False
    # Position among the ShardedTensor leaves -> device type: of each popped tensor, and
    # where restore_tensor_device moves a tensor back to (after a copy to the CPU, or an
    # insert on another device).
    _popped_devices: dict[int, str] = field(default_factory=dict)
    _orig_devices: dict[int, str] = field(default_factory=dict)

    @classmethod
    def from_state_dict(
        cls,
        sharded_state_dict: ShardedStateDict,
        algo: str = "fully_parallel",
        parallelization_group: ProcessGroup = None,
        cached_metadata: ShardDistribution | None = None,
    ) -> tuple[MCoreTensorAwareStateDict, ShardDistribution | None]:
        """Build this rank's tensor-aware state dict (collective: every rank calls it).

        Steps: apply factories and split the sharded part from the common part
        (``save_preprocess``, validating the sharding unless ``cached_metadata``
        is given); with ``algo="fully_parallel"``, distribute the shards held in
        ``parallelization_group`` over its ranks (or reuse ``cached_metadata``)
        and keep the data of this rank's shards only. The caller's state dict
        keeps its data (the sharded leaves are copied).

        Args:
            sharded_state_dict: the state to checkpoint.
            algo: ``"fully_parallel"`` (each replicated shard stored by one rank
                of the group) or ``"atomic"`` (every rank keeps all its data).
            parallelization_group: the ranks that share replicated shards (default: world).
            cached_metadata: the distribution a previous call returned, for the same
                sharding: skips validation and the metadata exchange.

        Returns:
            The state dict and the distribution to pass back as ``cached_metadata``
            (None for ``"atomic"`` or a group of one rank).

        Raises:
            MissingDependencyError: nvidia-resiliency-ext is not installed.
            InvalidArgumentError: an unknown ``algo``, or ``cached_metadata`` that
                does not describe a shard of the state dict (on every rank).
        """
        if not HAVE_NVRX:
            raise MissingDependencyError(
                f"MCoreTensorAwareStateDict is the local checkpoint form of "
                f"nvidia-resiliency-ext's checkpoint managers; {NVRX_INSTALL_HINT}"
            )
        fully_parallel = _check_algo(algo)
        sharded_part, common = save_preprocess(
            sharded_state_dict, validate_access_integrity=cached_metadata is None
        )
        sharded_part = dict_list_map_outplace(_copy_leaf, sharded_part)
        distribution = None
        if fully_parallel:
            distribution = cached_metadata
            if distribution is None:
                distribution = determine_main_replica_uniform_distribution(
                    sharded_part, parallelization_group, ignore_groups=True
                )
            if distribution is not None:
                cls._remove_redundant_data(sharded_part, distribution, parallelization_group)
        return cls(common=common, sharded_state_dict=sharded_part), distribution

    @staticmethod
    def _remove_redundant_data(
        sharded_part: ShardedStateDict,
        distribution: ShardDistribution,
        parallelization_group: ProcessGroup,
    ) -> None:
        """Drop the data of the shards another rank of the group stores (collective)."""
        group = RankGroup(parallelization_group)
        error: Exception | None = None
        dropped = 0
        try:
            for sh in nested_values(sharded_part):
                if not isinstance(sh, ShardedTensor):
                    continue
                shard_id = _sharded_tensor_shard_id(sh)
                if shard_id not in distribution.main_rank_for_shard:
                    raise InvalidArgumentError(
                        f"cached_metadata does not describe shard {_describe_shard(shard_id)}; "
                        "compute the distribution again (cached_metadata=None)"
                    )
                if distribution.main_rank_for_shard[shard_id] != group.rank:
                    sh.data = None
                    dropped += 1
        except Exception as e:  # noqa: BLE001 - every rank must raise, none may hang later
            error = e
        group.fail_together(error, "MCoreTensorAwareStateDict.from_state_dict")
        logger.debug("fully parallel: %d shard(s) left to other ranks of the group", dropped)

    # ------------------------------------------------------------------ tensors

    @property
    def is_hollow(self) -> bool:
        """True iff the tensors were popped and not inserted back yet."""
        return self._is_hollow

    @property
    def common_state_dict(self) -> StateDict:
        """The common (non-sharded) state."""
        return self.common

    def _require(self, hollow: bool, what: str) -> None:
        if self._is_hollow != hollow:
            state = "hollow (its tensors were popped)" if self._is_hollow else "not hollow"
            raise CheckpointingException(f"MCoreTensorAwareStateDict.{what}: it is {state}")

    def _tensor_leaves(self) -> Iterator[tuple[int, ShardedTensor]]:
        """``(position, leaf)`` of every ShardedTensor leaf, in a fixed order."""
        leaves = (x for x in nested_values(self.sharded_state_dict) if isinstance(x, ShardedTensor))
        return enumerate(leaves)

    def _held(self) -> list[tuple[int, ShardedTensor, torch.Tensor]]:
        """``(position, leaf, data)`` of the leaves that hold data."""
        return [(pos, sh, sh.data) for pos, sh in self._tensor_leaves() if sh.data is not None]

    def _popped(self) -> list[tuple[int, ShardedTensor]]:
        """``(position, leaf)`` of the leaves whose data :meth:`pop_tensors` took."""
        return [(pos, sh) for pos, sh in self._tensor_leaves() if pos in self._popped_devices]

    @property
    def tensors(self) -> Iterator[torch.Tensor]:
        """The tensors held, in a fixed order (that of :meth:`pop_tensors`)."""
        self._require(False, "tensors")
        return (data for _, _, data in self._held())

    def pop_tensors(self) -> list[torch.Tensor]:
        """Take every tensor out, remembering its device; the object becomes hollow."""
        self._require(False, "pop_tensors")
        popped = []
        for position, sh, data in self._held():
            popped.append(data)
            self._popped_devices[position] = data.device.type
            sh.data = None
        self._is_hollow = True
        return popped

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put back the tensors :meth:`pop_tensors` returned (same order).

        ``self.insert_tensors(self.pop_tensors())`` leaves the object unchanged. A
        tensor inserted on another device than it was popped from goes back there
        on :meth:`restore_tensor_device`.
        """
        self._require(True, "insert_tensors")
        slots = self._popped()
        tensors = list(tensor_data)
        if len(tensors) != len(slots):
            raise InvalidArgumentError(
                f"MCoreTensorAwareStateDict.insert_tensors: got {len(tensors)} tensors "
                f"for {len(slots)} popped ones"
            )
        for (position, sh), tensor in zip(slots, tensors):
            popped_from = self._popped_devices.pop(position)
            if tensor.device.type != popped_from:
                self._orig_devices.setdefault(position, popped_from)
            sh.data = tensor
        self._is_hollow = False

    def init_tensors(self) -> None:
        """Allocate uninitialized tensors where the popped ones were (shape, dtype, device)."""
        self._require(True, "init_tensors")
        for position, sh in self._popped():
            sh.init_data(self._popped_devices.pop(position))
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace every tensor by a CPU copy; the originals are not modified.

        Devices are remembered for :meth:`restore_tensor_device`. A CPU tensor is
        cloned (so that training does not change the checkpoint), unless it is
        already a copy made by an earlier call.
        """
        self._require(False, "copy_tensors_to_cpu")
        for position, sh, data in self._held():
            if data.is_cpu:
                if position not in self._orig_devices:
                    sh.data = data.clone()
            else:
                self._orig_devices.setdefault(position, data.device.type)
                sh.data = data.detach().to("cpu", non_blocking=non_blocking)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move every tensor back to its remembered device (if it was moved)."""
        self._require(False, "restore_tensor_device")
        for position, sh, data in self._held():
            device = self._orig_devices.pop(position, None)
            if device is not None:
                sh.data = data.to(device, non_blocking=non_blocking)

    # ------------------------------------------------------------------ back to a state dict

    def to_state_dict(
        self,
        sharded_state_dict: ShardedStateDict,
        algo: str = "atomic",
        exchange_algo: str = "broadcast",
        validate_access_integrity: bool = True,
        parallelization_group: ProcessGroup = None,
        strict: StrictHandling | str = StrictHandling.ASSUME_OK_UNEXPECTED,
        return_mismatch_keys: bool = False,
    ) -> StateDict | tuple[StateDict, set[str], set[str]]:
        """The state dict that ``sharded_state_dict`` requests, filled from this object.

        Collective (every rank calls it). Steps:

        1. start from a copy of the common state; apply factories to the request
           and merge its non-persistent values;
        2. compare the request with this object's keys per ``strict`` and, with
           ``validate_access_integrity``, check the request's sharding (both as
           :func:`dist_checkpointing.load` does);
        3. fill each requested ShardedTensor/ShardedObject from this object; with
           ``algo="fully_parallel"`` the shards kept by other ranks of
           ``parallelization_group`` are exchanged first (``exchange_algo``:
           ``broadcast``, ``gather_object`` or ``gather_rounds``);
        4. merge the factories back and the result into the common state.

        Returns:
            The state dict, plus the missing and unexpected keys when
            ``return_mismatch_keys``.

        Raises:
            KeyMismatchError: a requested shard is in no rank's local checkpoint
                (naming the keys; :class:`~dist_checkpointing.errors.RankFailureError`
                on the other ranks).
        """
        self._require(False, "to_state_dict")
        fully_parallel = _check_algo(algo)
        recreated: StateDict = dict_list_map_outplace(lambda x: x, self.common)
        if not sharded_state_dict:
            return (recreated, set(), set()) if return_mismatch_keys else recreated
        request, nonpersistent, factories = load_preprocess(sharded_state_dict)
        merge(recreated, nonpersistent)
        sharded_part, _ = extract_sharded_base(request)
        sharded_part, missing, unexpected = self._check_request(
            sharded_part, parse_strict_flag(strict), validate_access_integrity
        )
        tensors = {_sharded_tensor_shard_id(sh): data for _, sh, data in self._held()}
        if fully_parallel:
            tensors = self._exchange(tensors, sharded_part, parallelization_group, exchange_algo)
        self._fill(sharded_part, tensors)
        merge(recreated, apply_factory_merges(sharded_part, factories))
        return (recreated, missing, unexpected) if return_mismatch_keys else recreated

    def _check_request(
        self, sharded_part: ShardedStateDict, strict: StrictHandling, validate: bool
    ) -> tuple[ShardedStateDict, set[str], set[str]]:
        """Strict key handling against this object's keys, and the sharding check."""
        ckpt_metadata = None
        if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
            ckpt_metadata = {
                sh.key: sh.without_data()
                for sh in nested_values(self.sharded_state_dict)
                if isinstance(sh, ShardedBase)
            }
        local_metadata, global_metadata = None, None
        if validate or StrictHandling.requires_global_app_metadata(strict):
            local_metadata, global_metadata = determine_global_metadata(sharded_part)
        return validate_integrity_and_strict_load(
            sharded_part, strict, validate, local_metadata, global_metadata, ckpt_metadata
        )

    @staticmethod
    def _exchange(
        loaded: dict[_ShardId, torch.Tensor],
        sharded_part: ShardedStateDict,
        parallelization_group: ProcessGroup,
        exchange_algo: str,
    ) -> dict[_ShardId, torch.Tensor]:
        """Receive the requested shards that other ranks of the group kept (collective)."""
        distribution = determine_main_replica_uniform_distribution(
            sharded_part, parallelization_group, ignore_groups=True
        )
        if distribution is None:
            return loaded
        group = RankGroup(parallelization_group)
        lacking = sorted(
            shard_id
            for shard_id, rank in distribution.main_rank_for_shard.items()
            if rank == group.rank and shard_id not in loaded
        )
        error = None
        if lacking:
            error = KeyMismatchError(
                f"fully parallel exchange: rank {group.global_rank()} should send shards its "
                "local checkpoint does not hold (was it saved with another sharding?): "
                + ", ".join(_describe_shard(s) for s in lacking)
            )
        group.fail_together(error, "MCoreTensorAwareStateDict.to_state_dict")
        unloaded = {
            _sharded_tensor_shard_id(sh): sh
            for sh in nested_values(sharded_part)
            if isinstance(sh, ShardedTensor) and _sharded_tensor_shard_id(sh) not in loaded
        }
        return exchange_by_distribution(
            loaded, unloaded, distribution, parallelization_group, exchange_algo
        )

    def _fill(self, sharded_part: ShardedStateDict, tensors: dict[_ShardId, torch.Tensor]) -> None:
        """Replace every requested leaf by its tensor or object, in place (collective:
        a shard missing on one rank raises on every rank)."""
        objects = {
            _sharded_object_id(sh): sh.data
            for sh in nested_values(self.sharded_state_dict)
            if isinstance(sh, ShardedObject)
        }
        absent: list[str] = []

        def fill(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                shard_id = _sharded_tensor_shard_id(x)
                if shard_id in tensors:
                    return tensors[shard_id]
                absent.append(_describe_shard(shard_id))
            elif isinstance(x, ShardedObject):
                if _sharded_object_id(x) in objects:
                    return objects[_sharded_object_id(x)]
                absent.append(f"object '{x.unique_key}'")
            return x

        dict_list_map_inplace(fill, sharded_part)
        error = None
        if absent:
            error = KeyMismatchError(
                f"rank {RankGroup().global_rank()}: the local checkpoint holds no data for the "
                "requested " + ", ".join(absent)
            )
        RankGroup().fail_together(error, "MCoreTensorAwareStateDict.to_state_dict")


__all__ = [
    "HAVE_NVRX",
    "MCoreTensorAwareStateDict",
    "NVRX_INSTALL_HINT",
    "TensorAwareStateDict",
]
