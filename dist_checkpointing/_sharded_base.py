"""The base of every sharded state dict leaf, and the state dict type names.

Re-exported by :mod:`dist_checkpointing.mapping` (Megatron-Core's path), which
is where users import them from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

ReplicaId = int | tuple[int, ...]
StateDict = dict[str, Any]
ShardedStateDict = dict[str, Any]
CommonStateDict = dict[str, Any]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the replica that is written (``replica_id`` 0 or all zeros)."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase(ABC):
    """A leaf of a sharded state dict: a key, the local data and a replica id."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise :class:`MappingError` if the metadata is inconsistent."""

    @abstractmethod
    def without_data(self) -> ShardedBase:
        """A copy of this object with ``data=None`` (metadata only)."""


__all__ = [
    "CommonStateDict",
    "ReplicaId",
    "ShardedBase",
    "ShardedStateDict",
    "StateDict",
    "is_main_replica",
]
