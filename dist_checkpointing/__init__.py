"""dist_checkpointing: save and load sharded state dicts across torch.distributed ranks.

The public API mirrors Megatron-Core's ``dist_checkpointing`` (same names and
parameters), on the same on-disk format (``torch_dist`` backend, version 1).
"""

from . import errors
from .core import CheckpointingConfig, check_is_distributed_checkpoint
from .errors import CheckpointingException
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
from .validation import StrictHandling, parse_strict_flag

__all__ = [
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
    "is_main_replica",
    "parse_strict_flag",
]
