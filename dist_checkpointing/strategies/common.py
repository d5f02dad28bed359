"""The common (non-sharded) part of a checkpoint: ``common.pt``.

Backend ``torch`` version 1, as Megatron-Core 0.12-0.15 write it: rank 0
saves the common state dict with ``torch.save`` to ``common.pt``; every rank
can load it. Megatron-Core 0.16+ instead stores the common state as the
ShardedObject ``common_state`` inside the DCP data files; loading falls back
to it when ``common.pt`` is absent.

Loading never executes code from the checkpoint: ``common.pt`` is read with
``weights_only`` semantics unless the strategy is built with ``trusted=True``
or with ``allowed_types``.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..engine.collectives import RankGroup
from ..engine.safety import safe_torch_load
from ..engine.storage.location import CheckpointDir
from ..engine.storage.reader import read_object_bytes
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFeatureError
from ..mapping import ShardedStateDict, StateDict
from .base import (
    LoadCommonStrategy,
    SaveCommonStrategy,
    StrategyAction,
    check_compatibility,
    register_default_strategy,
)

logger = logging.getLogger(__name__)

COMMON_STATE_FNAME = "common.pt"
# Megatron-Core 0.16+: the common state is this ShardedObject's payload.
COMMON_STATE_OBJECT_KEY = "common_state/shard_0_1"


def register_default_common_strategies() -> None:
    """Register the ``torch`` v1 common strategies (idempotent)."""
    register_default_strategy(
        StrategyAction.LOAD_COMMON, "torch", 1, TorchCommonLoadStrategy(), if_absent=True
    )
    register_default_strategy(
        StrategyAction.SAVE_COMMON, "torch", 1, TorchCommonSaveStrategy("torch", 1), if_absent=True
    )


def _as_state_dict(payload: Any, source: str) -> StateDict:
    """The loaded common state, which must be a dict."""
    if not isinstance(payload, dict):
        raise CorruptCheckpointError(
            f"{source}: the common state must be a dict, found {type(payload).__name__}"
        )
    return payload


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Writes ``common.pt`` (the first rank of ``process_group``, default: the world)."""

    saves_on_coordinator_only = True

    def __init__(
        self,
        backend: str = "torch",
        version: int = 1,
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(backend, version)
        self.process_group = process_group

    def save_common(
        self, common_state_dict: StateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> None:
        if not RankGroup(self.process_group).is_coordinator:
            return
        buf = io.BytesIO()
        torch.save(common_state_dict, buf)
        # Not the commit point (metadata.json is), but never leave a partial file.
        CheckpointDir.of(checkpoint_dir).atomic_write(COMMON_STATE_FNAME, buf.getvalue())

    def owns_file(self, name: str) -> bool:
        return name == COMMON_STATE_FNAME

    def files(self, checkpoint_dir: str | os.PathLike[str]) -> list[str]:
        """``common.pt`` on the rank that writes it."""
        if not RankGroup(self.process_group).is_coordinator:
            return []
        return (
            [COMMON_STATE_FNAME] if CheckpointDir.of(checkpoint_dir).has(COMMON_STATE_FNAME) else []
        )

    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> None:
        raise UnsupportedFeatureError(
            "ShardedObjects are saved by the torch_dist sharded strategy, not as separate files"
        )


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Loads ``common.pt`` (or Megatron-Core 0.16+'s ``common_state`` object).

    Args:
        trusted: load with plain pickle (only for checkpoints you wrote).
        allowed_types: extra classes the common state may contain
            (e.g. ``argparse.Namespace``), loaded without trusting everything.
    """

    def __init__(self, trusted: bool = False, allowed_types: Sequence[type] = ()) -> None:
        self.trusted = trusted
        self.allowed_types = tuple(allowed_types)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        check_compatibility(self, "common backend", loaded_backend, "torch")

    def check_version_compatibility(self, loaded_version: int) -> None:
        check_compatibility(self, "common backend version", loaded_version, 1)

    def load_common(self, checkpoint_dir: str | os.PathLike[str]) -> StateDict:
        ckpt = CheckpointDir.of(checkpoint_dir)
        if ckpt.has(COMMON_STATE_FNAME):
            source = ckpt.path(COMMON_STATE_FNAME)
            payload = safe_torch_load(
                ckpt.read_bytes(COMMON_STATE_FNAME),
                source=source,
                trusted=self.trusted,
                allowed_types=self.allowed_types,
            )
            return _as_state_dict(payload, source)
        return self._load_common_state_object(ckpt)

    def files(self, checkpoint_dir: str | os.PathLike[str]) -> list[str]:
        """``common.pt`` when the checkpoint has one."""
        return (
            [COMMON_STATE_FNAME] if CheckpointDir.of(checkpoint_dir).has(COMMON_STATE_FNAME) else []
        )

    def _load_common_state_object(self, checkpoint_dir: CheckpointDir) -> StateDict:
        data, source = read_object_bytes(checkpoint_dir, COMMON_STATE_OBJECT_KEY)
        if data is None:
            raise CheckpointNotFoundError(
                f"{checkpoint_dir}: no common state ({COMMON_STATE_FNAME} is missing and the "
                f"data files hold no '{COMMON_STATE_OBJECT_KEY}' object)"
            )
        payload = safe_torch_load(
            data, source=source, trusted=self.trusted, allowed_types=self.allowed_types
        )
        if isinstance(payload, list) and len(payload) == 1:
            payload = payload[0]
        return _as_state_dict(payload, source)

    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> StateDict:
        raise UnsupportedFeatureError(
            "ShardedObjects are loaded by the torch_dist sharded strategy, not from separate files"
        )


def save_common(common_state_dict: StateDict, checkpoint_dir: str | os.PathLike[str]) -> None:
    """Megatron-Core 0.19's function form: the first rank of the world writes
    ``common_state_dict`` to ``common.pt`` in ``checkpoint_dir``."""
    TorchCommonSaveStrategy().save_common(common_state_dict, checkpoint_dir)


def load_common(checkpoint_dir: str | os.PathLike[str]) -> StateDict:
    """Megatron-Core 0.19's function form: the checkpoint's common state, from
    ``common.pt`` or (0.16+ checkpoints) the ``common_state`` object, loaded safely."""
    return TorchCommonLoadStrategy().load_common(checkpoint_dir)
