"""dist_checkpointing: save and load sharded state dicts across torch.distributed ranks.

The public API mirrors Megatron-Core's ``dist_checkpointing`` (same names and
parameters), on the same on-disk format (``torch_dist`` backend, version 1).
"""

from __future__ import annotations

from . import errors
from .core import CheckpointingConfig, check_is_distributed_checkpoint
from .engine.checkpoint.verify import VerifyReport, verify
from .errors import CheckpointingException
from .manager import CheckpointManager
from .mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from .serialization import (
    get_default_load_sharded_strategy,
    get_default_save_common_strategy,
    get_default_save_sharded_strategy,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from .validation import StrictHandling, parse_strict_flag

__all__ = [
    "verify",
    "VerifyReport",
    "CheckpointManager",
    "CheckpointingConfig",
    "CheckpointingException",
    "LocalNonpersistentObject",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StateDict",
    "StrictHandling",
    "apply_factories",
    "apply_factory_merges",
    "check_is_distributed_checkpoint",
    "errors",
    "get_default_load_sharded_strategy",
    "get_default_save_common_strategy",
    "get_default_save_sharded_strategy",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "remove_sharded_tensors",
    "save",
    "is_main_replica",
    "parse_strict_flag",
]
