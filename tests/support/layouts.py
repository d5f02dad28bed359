"""Reference tensors and sharding layouts for the round-trip and resharding tests.

A *layout* of a global tensor is, for every rank, a list of :class:`Shard` s: the grid
block that rank holds (block index and per-axis fragmentations), optionally only a flat
range of that block (distributed optimizer), and its replica id. :func:`make_sharded`
turns a shard into a :class:`ShardedTensor` through the public constructors
(``from_rank_offsets`` / ``from_rank_offsets_flat``); :func:`expected_local` computes what
that shard must hold, directly from the reference global tensor (independently of the
library). Everything here is picklable, so layouts drawn in the test process can be sent
to the ranks.
"""

from __future__ import annotations

import io
import itertools
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import dist_checkpointing as dcp

# Imported for its side effect: the harness's forkserver then preloads torch's DCP
# modules, which every rank would otherwise import lazily (seconds per rank and run).
import dist_checkpointing.strategies.torch  # noqa: F401
from dist_checkpointing import ShardedTensor

# The int dtype of the same width, to flip every bit of a tensor of a given element size.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def reference_tensor(key: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A deterministic global tensor for ``key``: distinct-looking values that depend on the key."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
        return torch.randint(low, high, shape, generator=gen, dtype=torch.int64).to(dtype)
    values = torch.randn(shape, generator=gen) * 8
    return values.to(dtype)


def poison(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in which every element differs from ``t``'s bitwise (a load
    destination whose unwritten elements can never pass for loaded ones)."""
    if t.dtype == torch.bool:
        return ~t
    bits = t.contiguous().view(_INT_OF_SIZE[t.element_size()])
    return torch.bitwise_not(bits).view(t.dtype).clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and every byte (NaNs and FP8 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    int_dtype = _INT_OF_SIZE[a.element_size()]
    return torch.equal(a.contiguous().view(int_dtype), b.contiguous().view(int_dtype))


@dataclass(frozen=True)
class Shard:
    """Block ``index`` of the grid ``fragm`` of a global tensor; with ``flat = (a, b)`` only
    the flat range ``[a, b)`` of the block's C-order flattening."""

    index: tuple[int, ...]
    fragm: tuple[int, ...]
    flat: tuple[int, int] | None = None
    replica_id: int = 0


Layout = list[list[Shard]]  # per rank


def block_slices(
    shape: Sequence[int], fragm: Sequence[int], index: Sequence[int]
) -> tuple[slice, ...]:
    """The slices of block ``index`` of a global tensor of ``shape`` split ``fragm`` ways."""
    sizes = [s // f for s, f in zip(shape, fragm)]
    return tuple(slice(i * b, (i + 1) * b) for i, b in zip(index, sizes))


def expected_local(ref: torch.Tensor, shard: Shard) -> torch.Tensor:
    """What ``shard`` holds of the global tensor ``ref`` (computed from ``ref`` alone)."""
    block = ref[block_slices(ref.shape, shard.fragm, shard.index)]
    if shard.flat is None:
        return block.clone()
    return block.reshape(-1)[shard.flat[0] : shard.flat[1]].clone()


def make_sharded(key: str, ref: torch.Tensor, shard: Shard, fill: bool = True) -> ShardedTensor:
    """The ShardedTensor of ``shard``: holding its values (``fill``), or a poisoned
    destination of the same shape to load into."""
    data = expected_local(ref, shard)
    if not fill:
        data = poison(data)
    rank_offsets = [
        (axis, i, f) for axis, (i, f) in enumerate(zip(shard.index, shard.fragm)) if f > 1
    ]
    if shard.flat is None:
        return ShardedTensor.from_rank_offsets(
            key, data, *rank_offsets, replica_id=shard.replica_id
        )
    block_shape = tuple(s // f for s, f in zip(ref.shape, shard.fragm))
    return ShardedTensor.from_rank_offsets_flat(
        key,
        data,
        block_shape,
        *rank_offsets,
        flattened_range=slice(*shard.flat),
        replica_id=shard.replica_id,
    )


def grid_shards(fragm: Sequence[int]) -> list[Shard]:
    """Every block of the grid ``fragm``, in C order."""
    fragm = tuple(fragm)
    return [Shard(index, fragm) for index in itertools.product(*(range(f) for f in fragm))]


def flat_shards(
    shape: Sequence[int], fragm: Sequence[int], cuts: Sequence[Sequence[int]]
) -> list[Shard]:
    """The flat pieces of every grid block: block ``i``'s flattening cut at ``cuts[i]``
    (sorted interior boundaries; a repeated boundary makes an empty range)."""
    numel = math.prod(s // f for s, f in zip(shape, fragm))
    return [
        replace(block, flat=(a, b))
        for block, block_cuts in zip(grid_shards(fragm), cuts)
        for a, b in itertools.pairwise([0, *block_cuts, numel])
    ]


def deal(shards: Sequence[Shard], world_size: int, owners: Sequence[int] = ()) -> Layout:
    """Shard ``i`` goes to rank ``owners[i]`` (round-robin without ``owners``)."""
    layout: Layout = [[] for _ in range(world_size)]
    for i, shard in enumerate(shards):
        layout[owners[i] if owners else i % world_size].append(shard)
    return layout


def grid_layout(fragm: Sequence[int], world_size: int) -> Layout:
    """Blocks dealt round-robin to the ranks; a rank left without one holds a replica."""
    blocks = grid_shards(fragm)
    layout = deal(blocks, world_size)
    for rank in range(len(blocks), world_size):
        layout[rank].append(replace(blocks[rank % len(blocks)], replica_id=1))
    return layout


def flat_layout(
    shape: Sequence[int], fragm: Sequence[int], cuts: Sequence[Sequence[int]], world_size: int
) -> Layout:
    """The :func:`flat_shards` dealt round-robin to the ranks (with ``DP - 1`` cuts per
    block on ``TP * DP`` ranks: rank ``dp + DP * tp`` holds piece ``dp`` of block ``tp``)."""
    return deal(flat_shards(shape, fragm, cuts), world_size)


def replicated_layout(ndim: int, world_size: int) -> Layout:
    """Every rank holds the whole tensor, as replica ``rank``."""
    whole = ((0,) * ndim, (1,) * ndim)
    return [[Shard(*whole, replica_id=rank)] for rank in range(world_size)]


def even_cuts(numel: int, parts: int) -> list[int]:
    """Interior boundaries splitting ``numel`` elements into ``parts`` near-equal pieces."""
    return [numel * i // parts for i in range(1, parts)]


@dataclass(frozen=True)
class TensorSpec:
    """A global tensor (its reference values follow from key, shape and dtype) and the
    layout in which the ranks hold it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout

    def reference(self) -> torch.Tensor:
        return reference_tensor(self.key, self.shape, self.dtype)


def sharded_state_dict(
    specs: Sequence[TensorSpec], rank: int, fill: bool = True
) -> dict[str, list[ShardedTensor]]:
    """``rank``'s shards of every spec, ``{key: [ShardedTensor, ...]}`` (keys of which
    ``rank`` holds nothing are left out: an empty list would be saved as common state)."""
    return {
        spec.key: [make_sharded(spec.key, spec.reference(), s, fill) for s in spec.layout[rank]]
        for spec in specs
        if spec.layout[rank]
    }


def save_specs(
    ckpt_dir: str | Path, specs: Sequence[TensorSpec], backend: str | None = None
) -> None:
    """Rank function: save this rank's shards of ``specs`` (in layout ``(backend, 1)``
    where given, else the default one)."""
    layout = None if backend is None else (backend, 1)
    dcp.save(sharded_state_dict(specs, dist.get_rank()), ckpt_dir, layout)


def load_specs(ckpt_dir: str | Path, specs: Sequence[TensorSpec]) -> bytes:
    """Rank function: load this rank's shards of ``specs`` into poisoned destinations;
    returns the loaded state dict, :func:`pack` ed."""
    return pack(dcp.load(sharded_state_dict(specs, dist.get_rank(), fill=False), ckpt_dir))


def loaded_mismatches(results: Sequence[bytes], specs: Sequence[TensorSpec]) -> list[str]:
    """Every shard of every rank (``results`` of :func:`load_specs`) whose loaded value
    differs from the reference; empty when all are bit-exact."""
    problems = []
    for rank, packed in enumerate(results):
        loaded = unpack(packed)
        for spec in specs:
            ref, got = spec.reference(), loaded.get(spec.key, [])
            if len(got) != len(spec.layout[rank]):
                problems.append(f"rank {rank} '{spec.key}': got {got!r}")
                continue
            for tensor, shard in zip(got, spec.layout[rank]):
                if not same_bits(tensor, expected_local(ref, shard)):
                    problems.append(f"rank {rank} '{spec.key}' {spec.shape} {shard}: {tensor}")
    return problems


def pack(obj: object) -> bytes:
    """``obj`` serialized with ``torch.save``, for a rank's return value: plain pickling of
    FP8 tensors fails in torch 2.x (their storage type has no ``dtype``)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    """The object that :func:`pack` serialized (trusted: our own ranks wrote it)."""
    return torch.load(io.BytesIO(data), weights_only=False)
