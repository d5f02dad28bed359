"""Megatron-Core 0.19's ``gpt_checkpoint_interop`` module path (loading GPT checkpoints
into hybrid Mamba/attention models).

The layer correspondence comes from Megatron-Core's model code (the hybrid layer
pattern symbols of ``megatron.core.models``), which this checkpointing library does
not contain; the functions raise :class:`UnsupportedFeatureError` saying so. The
result type is defined so that code annotating with it imports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from .errors import UnsupportedFeatureError
from .mapping import ShardedStateDict

_WHY = (
    "needs Megatron-Core's hybrid model layer allocation (megatron.core.models), which is "
    "model code outside dist_checkpointing; use Megatron-Core's gpt_checkpoint_interop for it"
)


@dataclass(frozen=True)
class GPTCompatLayerMaps:
    """Which hybrid layer takes which GPT layer's attention and MLP weights.

    Attributes:
        attention_to_gpt: hybrid layer index -> GPT layer index, for attention layers.
        mlp_to_gpt: hybrid layer index -> GPT layer index, for MLP (dense or MoE) layers.
        fresh_init: hybrid layers with no GPT counterpart (kept as initialized).
        num_gpt_layers: the number of layers of the GPT checkpoint.
    """

    attention_to_gpt: Mapping[int, int]
    mlp_to_gpt: Mapping[int, int]
    fresh_init: frozenset[int]
    num_gpt_layers: int


def _unsupported(name: str) -> NoReturn:
    raise UnsupportedFeatureError(f"{name} {_WHY}")


def gpt_compatible_layer_maps(hybrid_layer_pattern: str) -> GPTCompatLayerMaps:
    """Not supported here (see the module docstring)."""
    _unsupported("gpt_compatible_layer_maps")


def retarget_sharded_state_dict_to_gpt_checkpoint(
    sharded_state_dict: ShardedStateDict, layer_maps: GPTCompatLayerMaps
) -> ShardedStateDict:
    """Not supported here (see the module docstring)."""
    _unsupported("retarget_sharded_state_dict_to_gpt_checkpoint")


def retarget_fsdp_state_dict_to_gpt_checkpoint(
    state_dict: dict[str, Any],
    layer_maps: GPTCompatLayerMaps,
    checkpoint_keys: Iterable[str],
    checkpoint_prefix: str = "",
) -> dict[str, Any]:
    """Not supported here (see the module docstring)."""
    _unsupported("retarget_fsdp_state_dict_to_gpt_checkpoint")


__all__ = [
    "GPTCompatLayerMaps",
    "gpt_compatible_layer_maps",
    "retarget_fsdp_state_dict_to_gpt_checkpoint",
    "retarget_sharded_state_dict_to_gpt_checkpoint",
]
