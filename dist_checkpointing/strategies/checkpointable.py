"""Megatron-Core 0.19's ``strategies.checkpointable`` module path.

There, tensor subclasses implement DCP's private ``_Checkpointable`` protocol so that
plain ``torch.distributed.checkpoint.save`` can write ShardedTensors. This library
converts ShardedTensors for DCP itself (:mod:`dist_checkpointing.strategies.torch`)
and builds on no private torch protocol, so constructing these raises
:class:`UnsupportedFeatureError` saying what to use instead.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from ..errors import UnsupportedFeatureError
from ..mapping import ShardedTensor

_WHY = (
    "implements DCP's private _Checkpointable protocol, which dist_checkpointing does not "
    "build on; save ShardedTensors with dist_checkpointing.save (the torch_dist strategy "
    "converts them for DCP) instead"
)


def _unsupported(name: str) -> NoReturn:
    raise UnsupportedFeatureError(f"{name} {_WHY}")


class CheckpointableShardedTensor(torch.Tensor):
    """Not supported here (see the module docstring)."""

    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor) -> CheckpointableShardedTensor:
        _unsupported("CheckpointableShardedTensor")

    def __init__(self, data: torch.Tensor, sh_ten: ShardedTensor) -> None:
        _unsupported("CheckpointableShardedTensor")

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> CheckpointableShardedTensor:
        _unsupported("CheckpointableShardedTensor")


class LocalShardsContainer(torch.Tensor):
    """Not supported here (see the module docstring)."""

    def __new__(cls, local_shards: list[torch.Tensor]) -> LocalShardsContainer:
        _unsupported("LocalShardsContainer")

    def __init__(self, local_shards: list[torch.Tensor]) -> None:
        _unsupported("LocalShardsContainer")


__all__ = ["CheckpointableShardedTensor", "LocalShardsContainer"]
