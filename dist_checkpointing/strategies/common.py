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
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from ..engine.safety.safe_load import safe_torch_load
from ..engine.storage.resolve import filesystem_for
from ..errors import CheckpointNotFoundError, UnsupportedFeatureError
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
    from .base import _REGISTRY

    if (StrategyAction.LOAD_COMMON.value, "torch", 1) not in _REGISTRY:
        register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, TorchCommonLoadStrategy())
    if (StrategyAction.SAVE_COMMON.value, "torch", 1) not in _REGISTRY:
        register_default_strategy(
            StrategyAction.SAVE_COMMON, "torch", 1, TorchCommonSaveStrategy("torch", 1)
        )


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Writes ``common.pt`` (the first rank of ``process_group``, default: the world)."""

    def __init__(
        self,
        backend: str = "torch",
        version: int = 1,
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(backend, version)
        self.process_group = process_group

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: str | Path) -> None:
        if dist.is_initialized() and dist.get_rank(self.process_group) != 0:
            return
        fs = filesystem_for(checkpoint_dir)
        buf = io.BytesIO()
        torch.save(common_state_dict, buf)
        path = fs.join(str(checkpoint_dir), COMMON_STATE_FNAME)
        # Not the commit point (metadata.json is), but never leave a partial file.
        fs.atomic_write(path, buf.getvalue())

    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | Path
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

    def load_common(self, checkpoint_dir: str | Path) -> StateDict:
        fs = filesystem_for(checkpoint_dir)
        path = fs.join(str(checkpoint_dir), COMMON_STATE_FNAME)
        if fs.exists(path):
            with fs.open_read(path) as f:
                data = f.read()
            return safe_torch_load(
                data, source=path, trusted=self.trusted, allowed_types=self.allowed_types
            )
        return self._load_common_state_object(checkpoint_dir)

    def _load_common_state_object(self, checkpoint_dir: str | Path) -> StateDict:
        from ..engine.storage.reader import read_object_bytes

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
        return payload

    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | Path
    ) -> StateDict:
        raise UnsupportedFeatureError(
            "ShardedObjects are loaded by the torch_dist sharded strategy, not from separate files"
        )
