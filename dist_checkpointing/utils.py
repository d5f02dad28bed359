"""Helpers for sharded state dicts (Megatron-Core's ``dist_checkpointing.utils`` path).

Splitting a state dict by leaf kind: the persistent sharded leaves, the
non-persistent ones, and the common (non-sharded) rest.
"""

from __future__ import annotations

from .dict_utils import extract_matching_values
from .mapping import LocalNonpersistentObject, ShardedBase, ShardedStateDict, StateDict


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
