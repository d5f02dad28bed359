"""Megatron-Core's remaining ``strategies.torch`` names: constants, the classes its
checkpoints pickle, the reformulation-metadata reader and the async-module chooser."""

from __future__ import annotations

import logging
import os
from typing import Any

from ...dict_utils import nested_values
from ...engine.safety import LegacyMCoreSavePlan
from ...engine.storage.reader import FileSystemReader
from ...errors import CheckpointingException, MissingDependencyError, UnsupportedFeatureError
from ...mapping import ShardedStateDict
from ..nvrx import NVRX_MIN_VERSION, has_nvrx_async_support
from ..resharding import TensorReformulationMetadata, is_nd_flattened_tensor
from .layout import ND_REFORMULATED_SHAPE_KEY

logger = logging.getLogger("dist_checkpointing.strategies.torch")

# Paths with this prefix name Multi-Storage Client locations.
MSC_PREFIX = "msc://"

# Whether nvidia-resiliency-ext's async checkpointing is installed (we save with our
# own writer either way).
HAVE_NVRX = has_nvrx_async_support()

# Megatron-Core 0.13's SavePlan subclass with ``mcore_data``; 0.13 checkpoints pickle
# it in ``.metadata`` (our safe unpickler restores it as this class).
MCoreSavePlan = LegacyMCoreSavePlan


class MCoreMetadata:
    """Megatron-Core 0.19's placeholder for a class that 0.15 checkpoints with optimizer
    state name in their metadata; it carries nothing."""


def get_reformulation_metadata(
    sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
) -> dict[str, TensorReformulationMetadata]:
    """For every N-D flattened ShardedTensor of ``sharded_state_dict``, the logical and
    stored global shapes recorded in the checkpoint's metadata (``mcore_data``).

    A 1-D flattened tensor without a record is a legacy checkpoint's and is skipped.

    Raises:
        CheckpointingException: an N-D flattened tensor has no record.
    """
    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    mcore_data: dict[str, dict[str, Any]] = getattr(metadata, "mcore_data", None) or {}
    out: dict[str, TensorReformulationMetadata] = {}
    for sh_ten in nested_values(sharded_state_dict):
        if not is_nd_flattened_tensor(sh_ten):
            continue
        orig = mcore_data.get(sh_ten.key, {}).get(ND_REFORMULATED_SHAPE_KEY)
        if orig is None:
            if len(sh_ten.global_shape) == 1:
                logger.warning("legacy 1-D flattened tensor %s: no reformulation", sh_ten.key)
                continue
            raise CheckpointingException(
                f"{checkpoint_dir}: no global shape recorded for the N-D flattened tensor "
                f"'{sh_ten.key}' in the checkpoint metadata (recorded: {sorted(mcore_data)})"
            )
        stored = tuple(metadata.state_dict_metadata[sh_ten.key].size)  # type: ignore[union-attr]
        out[sh_ten.key] = TensorReformulationMetadata(tuple(orig), stored)
    return out


def _mcore_async_modules() -> dict[str, Any]:
    from ...engine.storage import write_results
    from .. import filesystem_async
    from ..async_utils import AsyncCallsQueue, AsyncRequest
    from ..cached_metadata_filesystem_reader import CachedMetadataFileSystemReader
    from ..state_dict_saver import save_state_dict_async_finalize, save_state_dict_async_plan

    return {
        "AsyncCallsQueue": AsyncCallsQueue,
        "AsyncRequest": AsyncRequest,
        "CachedMetadataFileSystemReader": CachedMetadataFileSystemReader,
        "FileSystemWriterAsync": filesystem_async.FileSystemWriterAsync,
        "_results_queue": write_results._results_queue,  # the queue get_write_results_queue made
        "get_write_results_queue": filesystem_async.get_write_results_queue,
        "save_state_dict_async_finalize": save_state_dict_async_finalize,
        "save_state_dict_async_plan": save_state_dict_async_plan,
    }


def get_async_strategy(async_strategy: str = "nvrx", module: str | None = None) -> tuple[str, Any]:
    """``(strategy name, the async classes and functions it uses)``, or with ``module``
    only that one (e.g. ``"AsyncCallsQueue"``).

    ``"mcore"`` gives this library's; ``"nvrx"`` is refused: saving goes through our
    writer, not nvidia-resiliency-ext's (``save`` refuses ``async_strategy="nvrx"``).
    """
    if async_strategy == "mcore":
        modules = _mcore_async_modules()
        return "mcore", modules[module] if module else modules
    if async_strategy == "nvrx":
        if not HAVE_NVRX:
            raise MissingDependencyError(
                f'async_strategy="nvrx" needs nvidia-resiliency-ext>={NVRX_MIN_VERSION}, and '
                'dist_checkpointing saves with its own writer anyway: use async_strategy="mcore"'
            )
        raise UnsupportedFeatureError(
            'async_strategy="nvrx": dist_checkpointing saves with its own async writer, not '
            'nvidia-resiliency-ext\'s; use async_strategy="mcore"'
        )
    raise UnsupportedFeatureError(
        f"async_strategy {async_strategy!r} is not supported. Available strategies: mcore "
        "(nvrx is refused, see above)"
    )


__all__ = [
    "HAVE_NVRX",
    "MCoreMetadata",
    "MCoreSavePlan",
    "MSC_PREFIX",
    "get_async_strategy",
    "get_reformulation_metadata",
    "logger",
]
