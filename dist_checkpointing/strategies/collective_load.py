"""What our sharded load strategies share, whatever their layout.

:class:`CollectiveLoadStrategy` holds the arguments every one of them takes (the
process group, and how ShardedObject payloads are unpickled), accepts only its own
backend and version, and runs a load as one collective step: a subclass fills the
request's leaves in :meth:`~CollectiveLoadStrategy.fill`, a failure on any rank is
raised on every rank, and each leaf is replaced by what it now holds.

Call sequence of ``load`` (every rank of ``process_group``):

1. ``fill(sharded_state_dict, checkpoint_dir)``: the layout's own reading; its
   exception is kept, not raised;
2. one all-reduce (:func:`~dist_checkpointing.engine.collectives.raise_on_all_ranks`):
   every rank raises if any rank failed, with that rank's cause;
3. the result: the request with every ShardedBase leaf replaced by its data.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch.distributed as dist

from ..dict_utils import dict_list_map_outplace
from ..engine.collectives import raise_on_all_ranks
from ..mapping import ShardedStateDict, StateDict, is_sharded_base
from .base import LoadShardedStrategy, check_compatibility


class CollectiveLoadStrategy(LoadShardedStrategy):
    """A sharded load strategy for one ``(backend, version)``, loading collectively.

    Args:
        process_group: the ranks that load together (errors are raised on all).
        trusted: load ShardedObject payloads with plain pickle (only for
            checkpoints you wrote).
        allowed_types: extra classes ShardedObject payloads may contain.
    """

    backend: ClassVar[str]
    version: ClassVar[int]

    def __init__(
        self,
        *,
        process_group: dist.ProcessGroup | None = None,
        trusted: bool = False,
        allowed_types: Sequence[type] = (),
    ) -> None:
        self.process_group = process_group
        self.trusted = trusted
        self.allowed_types = tuple(allowed_types)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        check_compatibility(self, "sharded backend", loaded_backend, self.backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        check_compatibility(self, "sharded backend version", loaded_version, self.version)

    @abstractmethod
    def fill(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> None:
        """Read the checkpoint into every ShardedTensor/ShardedObject of the request
        (tensors without data are allocated on the CPU)."""

    def load(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> StateDict:
        """Fill every ShardedTensor/ShardedObject of the request (collective: a failure
        on one rank raises on every rank). Returns the state dict with each leaf
        replaced by its loaded tensor or object."""
        error: BaseException | None = None
        try:
            self.fill(sharded_state_dict, checkpoint_dir)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            error = e
        raise_on_all_ranks(error, self.process_group, what=f"Loading {checkpoint_dir}")
        loaded: StateDict = dict_list_map_outplace(
            lambda x: x.data if is_sharded_base(x) else x, sharded_state_dict
        )
        return loaded


__all__ = ["CollectiveLoadStrategy"]
