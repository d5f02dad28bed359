"""The N-D flattened reformulation, by Megatron-Core's names (``strategies.resharding``).

Flat ranges of a block ``[x, y, z]`` of a global tensor ``[X, Y, Z]`` are stored
as a tensor of shape ``[X // x, Y // y, Z // z, x * y * z]`` (see
:mod:`.torch.layout`). Our loader reshards such tensors itself; these functions
are the public API Megatron-Core offers for doing it by hand: turn a request laid
out on another grid into requests for whole stored blocks, load them, then
assemble the requested flat ranges back.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from itertools import product
from typing import Any

import torch

from ..dict_utils import dict_list_map_inplace, extract_matching_values
from ..errors import CheckpointingException, MappingError
from ..mapping import (
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)

logger = logging.getLogger(__name__)

# What restores the original formulation: the factories of the reformulated tensors.
ReformulationRestoreMetadata = ShardedStateDict


@dataclass
class TensorReformulationMetadata:
    """How a flattened tensor is stored in a checkpoint.

    Args:
        ckpt_orig_global_shape: the logical global shape ``[X, Y, Z]``.
        ckpt_reform_global_shape: the stored shape ``[X // x, Y // y, Z // z, x*y*z]``.
    """

    ckpt_orig_global_shape: tuple[int, ...]
    ckpt_reform_global_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.ckpt_orig_global_shape:
            raise MappingError("TensorReformulationMetadata needs the original global shape")


def is_nd_flattened_tensor(sh_ten: Any) -> bool:
    """Whether ``sh_ten`` is a ShardedTensor holding a flat range of its block."""
    return isinstance(sh_ten, ShardedTensor) and sh_ten.flattened_range is not None


def nd_flattened_tensor_reformulated_global_shape(sh_ten: ShardedTensor) -> tuple[int, ...]:
    """The stored shape of a flattened ShardedTensor: its grid plus the block's size."""
    if not is_nd_flattened_tensor(sh_ten) or sh_ten.axis_fragmentations is None:
        raise MappingError(f"ShardedTensor '{sh_ten.key}' is not flattened on a regular grid")
    return tuple(sh_ten.axis_fragmentations) + (math.prod(sh_ten.local_shape),)


def _overlapping_cells(
    sh_ten: ShardedTensor, ckpt_grid: tuple[int, ...], ckpt_block: tuple[int, ...]
) -> list[tuple[int, ...]]:
    """Grid cells of the checkpoint whose blocks overlap ``sh_ten``'s block."""
    block = (1,) * sh_ten.prepend_axis_num + tuple(sh_ten.local_shape)
    ranges = []
    for off, size, b, g in zip(sh_ten.global_offset, block, ckpt_block, ckpt_grid):
        ranges.append(range(off // b, min(-(-(off + size) // b), g)))
    return list(product(*ranges))


def reformulate_single_nd_flattened_tensor(
    sh_ten: ShardedTensor, reformulation_metadata: TensorReformulationMetadata
) -> ShardedTensorFactory:
    """A factory that requests the stored blocks overlapping ``sh_ten`` (build) and
    cuts ``sh_ten``'s flat range out of them once loaded (merge)."""
    rmd = reformulation_metadata
    grid = tuple(rmd.ckpt_reform_global_shape[:-1])
    orig = tuple(rmd.ckpt_orig_global_shape)
    if len(grid) != len(orig) or any(s % g for s, g in zip(orig, grid)):
        raise CheckpointingException(
            f"'{sh_ten.key}': stored shape {rmd.ckpt_reform_global_shape} is no reformulation "
            f"of {orig}"
        )
    ckpt_block = tuple(s // g for s, g in zip(orig, grid))
    p = sh_ten.prepend_axis_num
    numel = math.prod(ckpt_block)
    requests = {
        cell: ShardedTensor(
            sh_ten.key, None, sh_ten.dtype, ckpt_block[p:], orig,
            tuple(c * b for c, b in zip(cell, ckpt_block)), grid, sh_ten.replica_id, p,
            sh_ten.allow_shape_mismatch, flattened_range=slice(0, numel),
        )
        for cell in _overlapping_cells(sh_ten, grid, ckpt_block)
    }  # fmt: skip
    template = sh_ten.without_data()

    def build(*_: Any) -> ShardedStateDict:
        return {str(cell): req for cell, req in requests.items()}

    @torch.no_grad()
    def merge(loaded: StateDict) -> torch.Tensor:
        block = torch.empty(template.local_shape, dtype=template.dtype)
        for cell, req in requests.items():
            stored = loaded[str(cell)].view(req.local_shape)
            src, dst = [], []
            for axis in range(len(template.local_shape)):
                g_axis = axis + p
                lo = max(req.global_offset[g_axis], template.global_offset[g_axis])
                hi = min(
                    req.global_offset[g_axis] + req.local_shape[axis],
                    template.global_offset[g_axis] + template.local_shape[axis],
                )
                src.append(slice(lo - req.global_offset[g_axis], hi - req.global_offset[g_axis]))
                dst.append(
                    slice(lo - template.global_offset[g_axis], hi - template.global_offset[g_axis])
                )
            block[tuple(dst)] = stored[tuple(src)]
        assert template.flattened_range is not None
        return block.flatten()[template.flattened_range]

    return ShardedTensorFactory(
        sh_ten.key, sh_ten.data, build, merge, sh_ten.replica_id, sh_ten.flattened_range
    )


def apply_nd_flattened_tensors_reformulation(
    sharded_state_dict: ShardedStateDict,
    reformulation_metadata: dict[str, TensorReformulationMetadata],
) -> tuple[ShardedStateDict, ReformulationRestoreMetadata]:
    """Replace flattened tensors stored under another grid by requests for the stored
    blocks; returns the new state dict and what
    :func:`restore_nd_flattened_tensors_formulation` needs after loading it.

    Raises:
        CheckpointingException: a flattened N-D tensor has no reformulation metadata.
    """

    def reformulate(x: Any) -> Any:
        if not is_nd_flattened_tensor(x):
            return x
        rmd = reformulation_metadata.get(x.key)
        if rmd is None:
            if len(x.global_shape) == 1:
                return x  # 1-D flat tensors of older checkpoints are stored as they are
            raise CheckpointingException(
                f"no reformulation metadata for '{x.key}' (have: {sorted(reformulation_metadata)})"
            )
        if tuple(rmd.ckpt_reform_global_shape) == nd_flattened_tensor_reformulated_global_shape(x):
            return x
        return reformulate_single_nd_flattened_tensor(x, rmd)

    dict_list_map_inplace(reformulate, sharded_state_dict)
    factories, _ = extract_matching_values(
        sharded_state_dict,
        lambda x: isinstance(x, ShardedTensorFactory),
        return_lists_as_dicts=True,
    )
    apply_factories(sharded_state_dict)
    return sharded_state_dict, factories  # type: ignore[return-value]


def restore_nd_flattened_tensors_formulation(
    state_dict: StateDict, formulation_restore_metadata: ReformulationRestoreMetadata
) -> StateDict:
    """The state dict with each reformulated request merged back into its flat range."""
    restored: StateDict = apply_factory_merges(state_dict, formulation_restore_metadata)
    return restored


__all__ = [
    "ReformulationRestoreMetadata",
    "TensorReformulationMetadata",
    "apply_nd_flattened_tensors_reformulation",
    "is_nd_flattened_tensor",
    "nd_flattened_tensor_reformulated_global_shape",
    "reformulate_single_nd_flattened_tensor",
    "restore_nd_flattened_tensors_formulation",
]
