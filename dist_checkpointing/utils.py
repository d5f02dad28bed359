"""Helpers for sharded state dicts (Megatron-Core's ``dist_checkpointing.utils`` path).

Splitting a state dict by leaf kind: the persistent sharded leaves, the
non-persistent ones, and the common (non-sharded) rest.
"""

from __future__ import annotations

from typing import Any

from .dict_utils import extract_matching_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
)

# What identifies one shard across ranks: (key, global offset, flat range or ()).
_ShardId = tuple[Any, ...]


def _sharded_tensor_shard_id(sharded_tensor: ShardedTensor) -> _ShardId:
    """The id of a ShardedTensor's shard, equal on every rank that holds a replica."""
    fr = sharded_tensor.flattened_range
    flat = () if fr is None else (fr.start, fr.stop)
    return (sharded_tensor.key, tuple(sharded_tensor.global_offset), flat)


def _sharded_object_id(sharded_object: ShardedObject) -> _ShardId:
    """The id of a ShardedObject's shard (its unique key)."""
    return (sharded_object.unique_key,)


def extract_sharded_base(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """``(sharded, rest)``: the ShardedBase leaves and every other leaf."""
    return extract_matching_values(  # type: ignore[return-value]
        sharded_state_dict, lambda v: isinstance(v, ShardedBase)
    )


def extract_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """``(nonpersistent, rest)``: the LocalNonpersistentObject leaves and the others."""
    return extract_matching_values(  # type: ignore[return-value]
        sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
    )


__all__ = ["extract_nonpersistent", "extract_sharded_base"]
