"""Read planning of the torch_dist loader: which stored bytes land where.

A request whose destination cannot take the stored bytes directly (a
non-contiguous view, another dtype such as FP8, a flat slice of a block, a
different flat layout) reads into a contiguous staging tensor; when the last
read item of a staging tensor commits, it is copied into the destination. N-D
reformulated (flat) tensors stored under another grid are assembled from the
stored blocks they overlap, each block read once per rank and load.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..._shard_geometry import box_intersection, box_slices
from ...engine.storage.metadata_parts import SharedParts, index_at
from ...engine.storage.overlaps import overlapping
from ...errors import CorruptCheckpointError
from ...mapping import ShardedTensor
from .layout import (
    ND_REFORMULATED_SHAPE_KEY,
    block_shape,
    flat_range_rows,
    reformulated_global_shape,
    stored_chunk,
)

_ZEROS: dict[int, torch.Size] = {}  # the all-zero offsets of each rank, one object each


def _zeros(ndim: int) -> torch.Size:
    zeros = _ZEROS.get(ndim)
    if zeros is None:
        zeros = _ZEROS.setdefault(ndim, torch.Size((0,) * ndim))
    return zeros


@dataclass(eq=False)
class _Staging:
    """A buffer that read items fill; ``on_done`` runs when the last one committed."""

    buffer: torch.Tensor
    pending: int = 0
    on_done: list[Callable[[], None]] = field(default_factory=list)


# Where the read items of one (key, chunk list index) land: the destination itself
# (most reads: no object of our own per tensor), or a staging buffer.
_Target: TypeAlias = torch.Tensor | _Staging


def _copy_into(dest: torch.Tensor, source: torch.Tensor) -> None:
    dest.copy_(source)


def _contiguous_dest(dest: torch.Tensor, dtype: torch.dtype) -> bool:
    return dest.dtype == dtype and dest.is_contiguous()


def _intersect(
    a_off: tuple[int, ...], a_sz: tuple[int, ...], b_off: tuple[int, ...], b_sz: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    return box_intersection((a_off, a_sz), (b_off, b_sz))


def read_items(
    fqn: str, md: TensorStorageMetadata, chunks: list[ChunkStorageMetadata]
) -> list[ReadItem]:
    """Read items that fill ``chunks`` from the stored chunks of ``md``.

    A request that is exactly one stored chunk (same layout at save and load, the
    common case) becomes one read item directly; anything else goes through
    DCP's general overlap computation.
    """
    if len(md.chunks) == 1 and len(chunks) == 1:  # one stored chunk, one request: no index
        only = md.chunks[0]
        want = chunks[0]
        same = only is want or (
            tuple(only.offsets) == tuple(want.offsets) and tuple(only.sizes) == tuple(want.sizes)
        )
        exact: list[int | None] = [0 if same else None]
    else:
        stored = {(tuple(c.offsets), tuple(c.sizes)): i for i, c in enumerate(md.chunks)}
        exact = [stored.get((tuple(c.offsets), tuple(c.sizes))) for c in chunks]
    if None not in exact:
        return [_exact_item(fqn, c, i, j) for i, (c, j) in enumerate(zip(chunks, exact))]
    return create_read_items_for_chunk_list(fqn, md, chunks)


def _exact_item(fqn: str, chunk: ChunkStorageMetadata, i: int, j: int | None) -> ReadItem:
    """The read of request chunk ``i``, stored as chunk ``j``: the whole chunk. Both
    indexes hold the request's offsets; they are one object where the hints agree too
    (equal, immutable: 100,000 tensors, 9 MiB less)."""
    dest = index_at(fqn, chunk.offsets, i)  # the request's offsets, shared
    zeros = _zeros(len(chunk.sizes))
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=dest,
        dest_offsets=zeros,
        storage_index=dest if i == j else index_at(fqn, chunk.offsets, j),
        storage_offsets=zeros,
        lengths=chunk.sizes,
    )


class ReadLayout:
    """Where the reads of one load land: each requested block mapped onto the
    stored chunks of ``metadata``, through staging buffers where the destination
    cannot take the stored bytes directly.

    Call sequence (one load, one rank): :meth:`plan_tensor` for every requested
    ShardedTensor; :meth:`isolate_shared`; then, per key, :meth:`count_reads` for the
    read items made from ``chunks[key]``; :meth:`finish_ready` once planning is done;
    then :meth:`target` / :meth:`finish_staging` as the reader fills and commits
    items; :meth:`incomplete` and :meth:`finish_shared` at the end.
    """

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata
        self.chunks: dict[str, list[tuple[ChunkStorageMetadata, _Target]]] = {}
        self.block_cache: dict[tuple[str, tuple[int, ...]], _Staging] = {}
        self.stagings: list[_Staging] = []
        self._zero_fill = False
        self._parts = SharedParts(max_shapes=64)  # equal request shapes and chunks: one object
        # Destinations read into directly: addresses, bytes, (key, index in chunks[key]).
        self._direct_spans: tuple[list[int], list[int], list[tuple[str, int]]] = ([], [], [])
        self._after_reads: list[Callable[[], None]] = []  # see isolate_shared

    def finish_ready(self) -> None:
        """Run the copy-backs of staging buffers that need no read."""
        for staging in self.stagings:
            if staging.pending == 0:
                self.finish_staging(staging)

    def incomplete(self) -> list[_Staging]:
        """Staging buffers that did not receive all their reads."""
        return [s for s in self.stagings if s.pending or s.on_done]

    def stored_logical_shape(self, key: str, md: TensorStorageMetadata) -> tuple[int, ...]:
        orig = self._mcore_data().get(key, {}).get(ND_REFORMULATED_SHAPE_KEY)
        return tuple(orig) if orig is not None else tuple(md.size)

    def _mcore_data(self) -> dict[str, dict[str, Any]]:
        return getattr(self.metadata, "mcore_data", None) or {}

    def _add_chunk(
        self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], target: _Target
    ) -> int:
        """Plan ``target`` for the box; returns its index in ``chunks[key]``."""
        chunk = self._parts.chunk(offsets, sizes)  # equal requests: one object
        planned = self.chunks.get(key)
        if planned is None:
            self.chunks[key] = [(chunk, target)]  # one slot, not append's four
            return 0
        planned.append((chunk, target))
        return len(planned) - 1

    def isolate_shared(self) -> None:
        """Give a staging buffer to each destination read into directly whose memory
        overlaps another's (one tensor requested under two keys; see
        :mod:`~dist_checkpointing.engine.storage.overlaps`). Call once every tensor is
        planned, before the reads are counted."""
        starts, lengths, refs = self._direct_spans
        self._direct_spans = ([], [], [])
        for n in overlapping(starts, lengths):
            key, idx = refs[n]
            chunk, view = self.chunks[key][idx]
            assert isinstance(view, torch.Tensor)
            staging = _Staging(view.clone())  # what no read covers: as the destination held it
            self.stagings.append(staging)
            # Copied over once every read is verified (finish_shared), not at its
            # commit: the memory may still be read into and verified for the other key.
            self._after_reads.append(functools.partial(_copy_into, view, staging.buffer))
            self.chunks[key][idx] = (chunk, staging)

    def finish_shared(self) -> None:
        """Copy the buffers :meth:`isolate_shared` gave into their destinations (call once
        every read is done and verified)."""
        copies, self._after_reads = self._after_reads, []
        for copy in copies:
            copy()

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Zeros where a request may extend past the stored tensor: what no read
        # covers is copied into the destination as zeros.
        alloc = torch.zeros if self._zero_fill else torch.empty
        return alloc(shape, dtype=dtype)

    def _new_staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> _Staging:
        staging = _Staging(self._alloc(shape, dtype))
        self.stagings.append(staging)
        return staging

    def plan_tensor(self, key: str, sh: ShardedTensor) -> None:
        assert sh.data is not None
        self._zero_fill = sh.allow_shape_mismatch
        md = self.metadata.state_dict_metadata[key]
        assert isinstance(md, TensorStorageMetadata)
        stored_dtype = md.properties.dtype
        orig = self._mcore_data().get(key, {}).get(ND_REFORMULATED_SHAPE_KEY)
        block = block_shape(sh)
        if orig is None:
            if sh.flattened_range is None:
                self._plan_direct(key, tuple(sh.global_offset), block, sh.data, stored_dtype, sh)
            else:
                self._plan_flat_from_regular(key, sh, stored_dtype)
            return
        same_grid = tuple(md.size) == reformulated_global_shape(tuple(orig), block)
        if sh.flattened_range is not None and same_grid:
            chunk = stored_chunk(sh)
            self._plan_direct(key, chunk.offsets, chunk.sizes, sh.data, stored_dtype, sh)
        else:
            self._plan_from_reformulated(key, sh, tuple(orig), md)

    def _plan_direct(
        self,
        key: str,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        data: torch.Tensor,
        stored_dtype: torch.dtype,
        sh: ShardedTensor,
    ) -> None:
        """Read the stored box straight into ``data`` (or via staging if it cannot)."""
        if data.shape == sizes:  # the common case: no new view (microseconds per item)
            view: torch.Tensor | None = data if data.is_contiguous() else None
        else:
            view = data.view(sizes) if data.is_contiguous() else None
        if view is not None and _contiguous_dest(view, stored_dtype):
            idx = self._add_chunk(key, offsets, sizes, view)
            if view.nbytes:
                starts, lengths, refs = self._direct_spans
                starts.append(view.data_ptr())
                lengths.append(view.nbytes)
                refs.append((key, idx))
            return
        staging = self._new_staging(sizes, stored_dtype)
        if self._zero_fill:
            # What no read covers must come back as the destination held it.
            staging.buffer.copy_(data.reshape(sizes))

        def copy_back() -> None:
            data.copy_(staging.buffer.reshape(data.shape))

        staging.on_done.append(copy_back)
        self._add_chunk(key, offsets, sizes, staging)

    def _plan_flat_from_regular(
        self, key: str, sh: ShardedTensor, stored_dtype: torch.dtype
    ) -> None:
        """A flat request from a tensor stored in its logical shape: read the rows of
        the block that the range touches, then copy the range out."""
        assert sh.flattened_range is not None and sh.data is not None
        block = block_shape(sh)
        first, last = flat_range_rows(block, sh.flattened_range)
        offsets = (sh.global_offset[0] + first,) + tuple(sh.global_offset[1:])
        sizes = (last - first,) + block[1:]
        staging = self._new_staging(sizes, stored_dtype)
        start = sh.flattened_range.start - first * math.prod(block[1:])
        data = sh.data

        def copy_range() -> None:
            data.copy_(staging.buffer.reshape(-1)[start : start + data.numel()])

        staging.on_done.append(copy_range)
        self._add_chunk(key, offsets, sizes, staging)

    def _plan_from_reformulated(
        self, key: str, sh: ShardedTensor, orig: tuple[int, ...], md: TensorStorageMetadata
    ) -> None:
        """A request whose layout differs from the stored N-D reformulated blocks:
        assemble the stored blocks it overlaps, then copy the overlap."""
        assert sh.data is not None
        grid = tuple(md.size[:-1])
        stored_block = tuple(o // g if g else 0 for o, g in zip(orig, grid))
        req_block = block_shape(sh)
        req_off = tuple(sh.global_offset)
        finish_request: Callable[[torch.Tensor], None] | None = None
        if sh.flattened_range is None:
            box_off, box_size = req_off, req_block
            data = sh.data
            if data.is_contiguous():
                out = data.view(req_block)
            else:
                out = self._alloc(box_size, data.dtype)

                def finish_request(box: torch.Tensor) -> None:
                    data.copy_(box.reshape(data.shape))
        else:
            first, last = flat_range_rows(req_block, sh.flattened_range)
            box_off = (req_off[0] + first,) + req_off[1:]
            box_size = (last - first,) + req_block[1:]
            out = self._alloc(box_size, md.properties.dtype)
            start = sh.flattened_range.start - first * math.prod(req_block[1:])
            flat = sh.data

            def finish_request(box: torch.Tensor) -> None:
                flat.copy_(box.reshape(-1)[start : start + flat.numel()])

        blocks = self._overlapping_blocks(box_off, box_size, stored_block, grid)
        request = _Staging(out, pending=len(blocks))
        for cell in blocks:
            staging = self._stored_block(key, cell, stored_block, md.properties.dtype)
            cell_off = tuple(c * b for c, b in zip(cell, stored_block))

            def copy_overlap(
                staging: _Staging = staging, cell_off: tuple[int, ...] = cell_off
            ) -> None:
                inter = _intersect(cell_off, stored_block, box_off, box_size)
                assert inter is not None
                lo, size = inter
                src = staging.buffer.reshape(stored_block)[
                    box_slices(tuple(a - b for a, b in zip(lo, cell_off)), size)
                ]
                request.buffer[box_slices(tuple(a - b for a, b in zip(lo, box_off)), size)].copy_(
                    src
                )
                request.pending -= 1
                if request.pending == 0 and finish_request is not None:
                    finish_request(request.buffer)

            staging.on_done.append(copy_overlap)

    @staticmethod
    def _overlapping_blocks(
        box_off: tuple[int, ...],
        box_size: tuple[int, ...],
        stored_block: tuple[int, ...],
        grid: tuple[int, ...],
    ) -> list[tuple[int, ...]]:
        ranges = []
        for o, s, b, g in zip(box_off, box_size, stored_block, grid):
            if s == 0 or b == 0:
                return []
            ranges.append(range(o // b, min(-(-(o + s) // b), g)))
        cells: list[tuple[int, ...]] = [()]
        for r in ranges:
            cells = [c + (i,) for c in cells for i in r]
        return cells

    def _stored_block(
        self, key: str, cell: tuple[int, ...], stored_block: tuple[int, ...], dtype: torch.dtype
    ) -> _Staging:
        """The staging buffer of one stored block (read once per rank and load)."""
        cached = self.block_cache.get((key, cell))
        if cached is not None:
            return cached
        numel = math.prod(stored_block)
        staging = self._new_staging((1,) * len(cell) + (numel,), dtype)
        self.block_cache[(key, cell)] = staging
        self._add_chunk(key, cell + (0,), (1,) * len(cell) + (numel,), staging)
        return staging

    def count_reads(
        self,
        key: str,
        reads: list[ReadItem],
        chunk_targets: list[tuple[ChunkStorageMetadata, _Target]],
        allows_mismatch: bool,
    ) -> None:
        """Count each staging buffer's pending reads; check the reads cover every
        requested element (unless the request allows a shape mismatch)."""
        covered = [0] * len(chunk_targets)
        for r in reads:
            idx = r.dest_index.index
            assert idx is not None
            covered[idx] += math.prod(r.lengths)
            target = chunk_targets[idx][1]
            if type(target) is _Staging:
                target.pending += 1
        for (chunk, _), n in zip(chunk_targets, covered):
            if n != math.prod(chunk.sizes) and not allows_mismatch:
                raise CorruptCheckpointError(
                    f"'{key}': the checkpoint's chunks cover {n} of the {math.prod(chunk.sizes)} "
                    f"requested elements at offsets {tuple(chunk.offsets)}; its metadata is "
                    "inconsistent"
                )

    def target(self, read_item: ReadItem) -> _Target:
        """Where ``read_item`` lands: its destination tensor, or its staging buffer."""
        idx = read_item.dest_index.index
        assert idx is not None
        return self.chunks[read_item.dest_index.fqn][idx][1]

    def dest(self, read_item: ReadItem) -> torch.Tensor:
        """The tensor ``read_item``'s bytes are read into."""
        target = self.target(read_item)
        return target.buffer if isinstance(target, _Staging) else target

    def staging(self, read_item: ReadItem) -> _Staging | None:
        """The staging buffer ``read_item`` fills, if it does not read straight into
        its destination."""
        target = self.target(read_item)
        return target if isinstance(target, _Staging) else None

    @staticmethod
    def finish_staging(staging: _Staging) -> None:
        for fn in staging.on_done:
            fn()
        staging.on_done.clear()
