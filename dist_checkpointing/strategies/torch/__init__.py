"""The ``torch_dist`` backend: Megatron-Core's format on PyTorch DCP.

Importable as ``dist_checkpointing.strategies.torch`` (Megatron-Core's module
path), re-exporting the converter, the planners and the strategies.
"""

from __future__ import annotations

from .compat import (
    HAVE_NVRX,
    MSC_PREFIX,
    MCoreMetadata,
    MCoreSavePlan,
    get_async_strategy,
    get_reformulation_metadata,
    logger,
)
from .converter import (
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    flatten_state_dict,
    mcore_to_pyt_state_dict,
    sharded_tensor_to_torch_sharded_tensor,
    unflatten_state_dict,
)
from .planners import MCoreLoadPlanner, MCoreSavePlanner
from .strategy import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    register_default_torch_strategies,
)

__all__ = [
    "HAVE_NVRX",
    "MSC_PREFIX",
    "MCoreMetadata",
    "MCoreSavePlan",
    "get_async_strategy",
    "get_reformulation_metadata",
    "logger",
    "MCoreLoadPlanner",
    "MCoreSavePlanner",
    "TorchDistLoadShardedStrategy",
    "TorchDistSaveShardedStrategy",
    "_replace_sharded_keys_with_state_dict_keys",
    "_replace_state_dict_keys_with_sharded_keys",
    "_restore_dict_types",
    "_unwrap_pyt_sharded_tensor",
    "flatten_state_dict",
    "mcore_to_pyt_state_dict",
    "register_default_torch_strategies",
    "sharded_tensor_to_torch_sharded_tensor",
    "unflatten_state_dict",
]
