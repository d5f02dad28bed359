"""Helpers for sharded state dicts (Megatron-Core's ``dist_checkpointing.utils`` path).

Splitting a state dict by leaf kind (ShardedTensors, factories, other sharded
leaves, non-persistent values, the common rest) and renaming the keys of its
sharded leaves.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ._debug import debug_msg, debug_time, logger_stack, zip_strict
from .dict_utils import dict_list_map_inplace, extract_matching_values
from .errors import MappingError
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,  # noqa: F401 - a name of Megatron-Core's utils module
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    is_sharded_base,
)

# Megatron-Core's name for this module's logger (used when no logger is passed).
fallback_logger = logging.getLogger(__name__)

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


def extract_sharded_tensors(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """``(sharded tensors, rest)``: the ShardedTensor leaves and every other leaf."""
    return extract_matching_values(  # type: ignore[return-value]
        sharded_state_dict, lambda v: isinstance(v, ShardedTensor)
    )


def extract_sharded_tensors_and_factories(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """``(tensors and factories, rest)``: ShardedTensor and ShardedTensorFactory leaves."""
    return extract_matching_values(  # type: ignore[return-value]
        sharded_state_dict, lambda v: isinstance(v, ShardedTensor | ShardedTensorFactory)
    )


def extract_sharded_tensors_or_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """``(tensors, factories and non-persistent values, rest)``."""
    return extract_matching_values(  # type: ignore[return-value]
        sharded_state_dict,
        lambda v: isinstance(v, ShardedTensor | ShardedTensorFactory | LocalNonpersistentObject),
    )


def extract_sharded_base(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """``(sharded, rest)``: the ShardedBase leaves and every other leaf."""
    return extract_matching_values(  # type: ignore[return-value]
        sharded_state_dict, is_sharded_base
    )


def extract_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """``(nonpersistent, rest)``: the LocalNonpersistentObject leaves and the others."""
    return extract_matching_values(  # type: ignore[return-value]
        sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
    )


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every sharded leaf (in place)."""

    def rename(x: Any) -> Any:
        if is_sharded_base(x):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(rename, sharded_state_dict)


def replace_prefix_for_sharding(
    sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str
) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in the key of every sharded leaf (in place).

    Raises:
        MappingError: a leaf's key does not start with ``old_prefix`` (naming it).
    """

    def rename(x: Any) -> Any:
        if is_sharded_base(x):
            if not x.key.startswith(old_prefix):
                raise MappingError(f"key {x.key!r} does not start with the prefix {old_prefix!r}")
            x.key = f"{new_prefix}{x.key[len(old_prefix) :]}"
        return x

    dict_list_map_inplace(rename, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: dict[str, str]) -> None:
    """Rename sharded leaves by the first matching prefix of ``prefix_map`` (old -> new;
    keys matching none are kept), in place."""

    def rename(x: Any) -> Any:
        if is_sharded_base(x):
            for old_prefix, new_prefix in prefix_map.items():
                if x.key.startswith(old_prefix):
                    x.key = f"{new_prefix}{x.key[len(old_prefix) :]}"
                    break
        return x

    dict_list_map_inplace(rename, sharded_state_dict)


def force_all_tensors_to_non_fp8(sharded_state_dict: ShardedStateDict) -> None:
    """Replace quantized tensor subclasses (Transformer Engine's FP8 tensors) in the
    ShardedTensors' data by their dequantized values, in place. Plain tensors, float8
    dtypes included, are stored as they are and left alone."""

    def to_plain(x: Any) -> Any:
        data = getattr(x, "data", None) if isinstance(x, ShardedTensor) else None
        if isinstance(data, torch.Tensor) and type(data) is not torch.Tensor:
            for method in ("from_float8", "dequantize"):
                if callable(getattr(data, method, None)):
                    x.data = getattr(data, method)()
                    break
        return x

    dict_list_map_inplace(to_plain, sharded_state_dict)


__all__ = [
    "add_prefix_for_sharding",
    "debug_msg",
    "debug_time",
    "force_all_tensors_to_non_fp8",
    "logger_stack",
    "zip_strict",
    "apply_prefix_mapping",
    "extract_nonpersistent",
    "extract_sharded_base",
    "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories",
    "extract_sharded_tensors_or_nonpersistent",
    "replace_prefix_for_sharding",
]
