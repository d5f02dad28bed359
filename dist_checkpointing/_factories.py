"""Sharded tensor factories: tensors saved in another form.

A :class:`ShardedTensorFactory` builds the sharded state dict that represents a
tensor in the checkpoint (:func:`apply_factories`, before save and before
load) and merges what was loaded back into the tensor
(:func:`apply_factory_merges`, after load). Re-exported by
:mod:`dist_checkpointing.mapping` (Megatron-Core's path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ._sharded_base import ReplicaId, ShardedBase, ShardedStateDict, StateDict
from .dict_utils import dict_list_map_inplace
from .errors import MappingError

FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, slice | None], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor saved in another form: ``build_fn`` makes the sharded state dict to
    save, ``merge_fn`` turns the loaded form back into the tensor.

    Args:
        key: a name used for logging and errors.
        data: the tensor to transform.
        build_fn: ``(key, data, replica_id, flattened_range) -> ShardedStateDict``.
        merge_fn: ``(loaded state dict of what build_fn made) -> torch.Tensor``.
        replica_id: passed to ``build_fn``.
        flattened_range: passed to ``build_fn``.
    """

    key: str
    data: torch.Tensor | None
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> ShardedStateDict:
        """The sharded state dict that represents ``data`` in the checkpoint."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)  # type: ignore[arg-type]

    def validate_metadata_integrity(self) -> None:
        if not callable(self.build_fn) or not callable(self.merge_fn):
            raise MappingError(
                f"ShardedTensorFactory '{self.key}': build_fn and merge_fn must be callable"
            )

    def without_data(self) -> ShardedTensorFactory:
        return replace(self, data=None)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every :class:`ShardedTensorFactory` by what it builds, in place."""

    def _build(x: Any) -> Any:
        if isinstance(x, ShardedTensorFactory):
            x = x.build()
            # A factory may build containers holding further factories.
            x = dict_list_map_inplace(_build, x)
        return x

    dict_list_map_inplace(_build, sharded_state_dict)


def apply_factory_merges(x1: Any, x2: Any, key: tuple[Any, ...] = ()) -> Any:
    """Merge loaded factory products ``x1`` back with the factories in ``x2``.

    ``x2`` is the part of the original sharded state dict that holds the
    factories (dicts, lists, or dicts keyed by list index); ``x1`` is the loaded
    state dict. Each factory's ``merge_fn`` receives what its ``build_fn`` made,
    loaded. Returns ``x1`` with the merged tensors in place.
    """
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise MappingError(
                    f"apply_factory_merges: key {key + (k,)} of a factory is missing from the "
                    f"loaded state dict (loaded keys: {sorted(map(str, x1))})"
                )
            x1[k] = apply_factory_merges(x1[k], v2, key=key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise MappingError(
                f"apply_factory_merges: lists of different lengths at {key}: {len(x1)} vs {len(x2)}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key=key + (i,))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if not isinstance(k, int) or not 0 <= k < len(x1):
                raise MappingError(
                    f"apply_factory_merges: index {k!r} at {key} is not valid for a list of "
                    f"length {len(x1)}"
                )
            x1[k] = apply_factory_merges(x1[k], v2, key=key + (k,))
    else:
        raise MappingError(
            f"apply_factory_merges: cannot merge {type(x1).__name__} with "
            f"{type(x2).__name__} at {key}"
        )
    return x1


__all__ = [
    "FactoryBuildFn",
    "FactoryMergeFn",
    "ShardedTensorFactory",
    "apply_factories",
    "apply_factory_merges",
]
