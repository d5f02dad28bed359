"""Where a ShardedTensor's data lives in the stored (DCP) tensor.

Regular ShardedTensors are stored in their global shape: the chunk is the
local block (size 1 on prepended axes). Flat ShardedTensors (distributed
optimizer slices) use Megatron-Core's "N-D reformulation": a global tensor of
shape ``[X, Y, ..]`` whose blocks have shape ``[x, y, ..]`` is stored as
``[X//x, Y//y, .., x*y*..]``; element ``[c0, c1, .., j]`` is element ``j`` of
the C-order flattening of block ``(c0, c1, ..)``. A flat range ``[a, b)`` of
block ``(c0, c1, ..)`` is then the chunk at ``[c0, c1, .., a]`` of size
``[1, 1, .., b - a]``, which lets different data-parallel splits reshard.

These are pure functions shared by the converter, the planners and the
strategies (one place for the layout arithmetic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..._shard_geometry import flat_range_rows
from ...mapping import ShardedTensor

# Key of Metadata.mcore_data entries that record a reformulated tensor's logical shape.
ND_REFORMULATED_SHAPE_KEY = "nd_reformulated_orig_global_shape"


@dataclass(frozen=True)
class StoredChunk:
    """One chunk of a stored tensor: its stored global shape, offsets and sizes."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def block_shape(sh: ShardedTensor) -> tuple[int, ...]:
    """The local block in global coordinates (1 on prepended axes)."""
    return (1,) * sh.prepend_axis_num + tuple(sh.local_shape)


def reformulated_global_shape(
    global_shape: tuple[int, ...], block: tuple[int, ...]
) -> tuple[int, ...]:
    """Stored shape ``[X//x, Y//y, .., x*y*..]`` of a reformulated tensor."""
    return tuple(g // b if b else 0 for g, b in zip(global_shape, block)) + (math.prod(block),)


def stored_chunk(sh: ShardedTensor) -> StoredChunk:
    """The chunk that ``sh``'s data occupies in the stored tensor."""
    block = block_shape(sh)
    if sh.flattened_range is None:
        return StoredChunk(tuple(sh.global_shape), tuple(sh.global_offset), block)
    grid = tuple(o // b if b else 0 for o, b in zip(sh.global_offset, block))
    fr = sh.flattened_range
    return StoredChunk(
        reformulated_global_shape(tuple(sh.global_shape), block),
        grid + (fr.start,),
        (1,) * len(block) + (fr.stop - fr.start,),
    )


__all__ = [
    "ND_REFORMULATED_SHAPE_KEY",
    "StoredChunk",
    "block_shape",
    "flat_range_rows",
    "reformulated_global_shape",
    "stored_chunk",
]
