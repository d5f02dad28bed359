"""Planning the reads of a ``raw_bytes`` load whose stored chunks differ from the
requested ones (resharding): :class:`ReshardPlanner`, the base of
:class:`~.load_plan.LoadPlanner`.

- A flat range requested from flat ranges of the same block (a distributed
  optimizer's state with another data-parallel size): each stored range's overlap
  with it is read into it (:meth:`ReshardPlanner._add_flat`).
- Otherwise the request becomes a *target box* (the block, or the rows of the
  block a flat range touches), filled from every stored entry whose box meets
  it. A stored grid chunk contributes the rows that meet the box: read straight
  into the destination when those rows are one contiguous run of it, else a
  *staged* read (:class:`~.reader.Staged`): the reader lands the rows in its
  reused staging memory and copies what the box wants out of them as soon as
  they are verified, so a resharding load holds a bounded amount of staging
  memory, not a copy of everything it reads. Stored flat ranges contribute
  through the rows of their block that meet the box, assembled from the parts
  of the flat entries that hold them, copied once every read is done; a
  staging box (a destination of another dtype, or not contiguous) is copied
  into the destination last.

Reads that cover part of an entry start and end on checksum block boundaries
(the extra bytes are at most one block on each side), so the reader can verify
every block it reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from ..._shard_geometry import box_intersection, box_slices, flat_range_rows
from ...errors import CheckpointingException, CorruptCheckpointError
from ...mapping import ShardedObject, ShardedTensor
from ..storage.checksums import whole_blocks
from ..storage.staging_pool import StagingPool
from ..storage.tensor_bytes import buffer_of
from .index import DTYPES, ITEMSIZE, KIND_FLAT, KIND_GRID, RawIndex
from .reader import Read, Staged

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass
class LoadPlan:
    """The reads of one load, then the copies that run once every read is done."""

    reads: list[Read] = field(default_factory=list)
    copies: list[Callable[[], None]] = field(default_factory=list)
    objects: list[tuple[ShardedObject, bytearray]] = field(default_factory=list)
    # Accelerator destinations of whole entries: (row, tensor), each streamed through
    # ``pool`` once the reads are done (:func:`.load.fill_devices`).
    device_fills: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    pool: StagingPool | None = None


def _host_view(
    data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor | None:
    """``data`` viewed as ``shape`` if reads may land in it directly."""
    if not data.is_cpu or data.dtype != dtype or not data.is_contiguous():
        return None
    return data.view(shape)


def copy_reshaped(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` with ``src`` reshaped to ``dst``'s shape."""
    dst.copy_(src.reshape(dst.shape))


class ReshardPlanner:
    """The plan of one rank's request where it differs from the stored chunks (see the
    module docstring); :class:`~.load_plan.LoadPlanner` adds the requests that match."""

    def __init__(self, index: RawIndex) -> None:
        self.index = index
        self._pool_known = False  # the staging pool is looked up at the first device target
        c = index.columns
        self._offsets, self._length = c["offset"], c["length"]
        self._kind, self._ndim, self._dims_start = c["kind"], c["ndim"], c["dims_start"]
        self._flat_start, self._flat_stop, self._dtype = c["flat_start"], c["flat_stop"], c["dtype"]
        self._dims = index.dims_list
        self._by_key = index.rows_by_key
        self._dtypes = [DTYPES[name] for name in index.dtypes]
        self.plan = LoadPlan()
        # The reads that land in a request's memory, a group per request: its memory's
        # address and bytes, the group's indexes in plan.reads (see _isolate_shared).
        self._groups: tuple[list[int], list[int], list[list[int]]] = ([], [], [])

    def _read(self, row: int, entry_offset: int, length: int, dest: Any) -> Read:
        return Read(row, entry_offset, length, dest, self._offsets[row] + entry_offset)

    def _note_group(self, address: int, nbytes: int, reads: list[int]) -> None:
        """Note that ``reads`` (indexes in plan.reads) land in one request's memory,
        ``nbytes`` at ``address`` (see ``LoadPlanner._isolate_shared``)."""
        starts, lengths, groups = self._groups
        starts.append(address)
        lengths.append(nbytes)
        groups.append(reads)

    def _flat_parts(
        self, rows: list[int], offset: list[int], block: list[int], a: int, b: int
    ) -> list[tuple[int, int, int]]:
        """``(row, lo, hi)`` for each stored flat range of the block at ``offset`` of
        shape ``block`` that meets elements ``[a, b)`` of its flattening, ``[lo, hi)``
        where it does."""
        d, kinds, starts, ndims = self._dims, self._kind, self._dims_start, self._ndim
        parts = []
        for row in rows:
            n, at = ndims[row], starts[row]
            if kinds[row] != KIND_FLAT or d[at + n : at + 2 * n] != offset:
                continue
            if d[at + 2 * n : at + 3 * n] != block:
                continue
            lo, hi = max(a, self._flat_start[row]), min(b, self._flat_stop[row])
            if lo < hi:
                parts.append((row, lo, hi))
        return parts

    def _read_parts(
        self,
        parts: list[tuple[int, int, int]],
        a: int,
        out: torch.Tensor,
        size: int,
        into: list[int] | None,
    ) -> None:
        """Read each of ``parts`` (see :meth:`_flat_parts`) into ``out`` (``uint8``: the
        elements from ``a`` on, ``size`` bytes each)."""
        for row, lo, hi in parts:
            first = self._flat_start[row]
            target = out[(lo - a) * size : (hi - a) * size]
            self._read_bytes(row, (lo - first) * size, (hi - first) * size, target, into)

    def _add_flat(
        self, sh: ShardedTensor, rows: list[int], offset: list[int], block: list[int]
    ) -> bool:
        """A flat range of a block whose stored entries are flat ranges of that same block
        (a distributed optimizer's state saved with another data-parallel size): each
        entry's overlap with the request is read into it, not the whole block assembled
        first (every rank read and held all of every block it touched). False where the
        stored flat ranges of the block do not cover the request exactly once: the caller
        plans boxes."""
        fr = sh.flattened_range
        assert fr is not None and sh.data is not None
        parts = self._flat_parts(rows, offset, block, fr.start, fr.stop)
        if sum(hi - lo for _, lo, hi in parts) != fr.stop - fr.start:
            return False
        dtypes = {self._dtype[row] for row, _, _ in parts}
        if len(dtypes) != 1:
            return False
        dtype = self._dtypes[dtypes.pop()]
        data = sh.data
        dest = _host_view(data, dtype, (fr.stop - fr.start,))
        into: list[int] | None = [] if dest is not None else None
        if dest is None:  # on a device, or of another dtype: a host buffer, copied last
            dest = torch.empty(fr.stop - fr.start, dtype=dtype)
            self.plan.copies.append(partial(copy_reshaped, data, dest))
        # (A contiguous tensor of one element may have any stride: as_strided gives 1.)
        out = dest.as_strided((dest.numel(),), (1,)).view(torch.uint8)
        self._read_parts(parts, fr.start, out, ITEMSIZE[dtype], into)
        if into:
            self._note_group(dest.data_ptr(), dest.nbytes, into)
        return True

    def _read_bytes(
        self, row: int, lo: int, hi: int, target: torch.Tensor, into: list[int] | None
    ) -> None:
        """Read bytes ``[lo, hi)`` of entry ``row`` into ``target`` (``uint8``, contiguous):
        the whole checksum blocks among them straight into it, the partial ones at its
        ends as staged reads of their whole blocks. ``into``: where to note the reads
        that land in a request's memory."""
        lo_b, hi_b = whole_blocks(lo, hi, self.index.block_bytes, self._length[row])
        bb = self.index.block_bytes
        a = lo if lo == lo_b else min(hi_b, lo_b + bb)  # the whole blocks: [a, b)
        b = hi if hi == hi_b else hi // bb * bb
        spans = [(lo_b, hi_b, lo, hi)] if a >= b else [(lo_b, a, lo, a), (a, b, a, b)]
        if a < b:
            spans.append((b, hi_b, b, hi))
        for start, stop, want_lo, want_hi in spans:
            if want_lo == want_hi:
                continue
            piece = target[want_lo - lo : want_hi - lo]
            if (start, stop) == (want_lo, want_hi):
                read = self._read(row, start, stop - start, buffer_of(piece))
            else:
                at = want_lo - start

                def deliver(buf: torch.Tensor, piece: torch.Tensor = piece, at: int = at) -> None:
                    piece.copy_(buf[at : at + piece.numel()])

                read = self._read(row, start, stop - start, None)
                read.stage = Staged(0, deliver)
            if into is not None:
                into.append(len(self.plan.reads))
            self.plan.reads.append(read)

    def _add_boxes(
        self, sh: ShardedTensor, rows: list[int], offset: tuple[int, ...], block: tuple[int, ...]
    ) -> None:
        data = sh.data
        assert data is not None
        dtype = self.index.dtype_of(rows[0])
        fr = sh.flattened_range
        finish: Callable[[torch.Tensor], None] | None = None
        into: list[int] | None = None  # the reads that land in the request's memory
        if fr is None:
            box: Box = (offset, block)
            out = _host_view(data, dtype, block)
            if out is not None and out.nbytes:
                into = []
            if out is None:
                out = self._alloc(block, dtype, sh.allow_shape_mismatch)

                def finish(o: torch.Tensor) -> None:
                    data.copy_(o.reshape(data.shape))
        else:
            first, last = flat_range_rows(block, fr)
            box = ((offset[0] + first,) + offset[1:], (last - first,) + block[1:])
            out = self._alloc(box[1], dtype, sh.allow_shape_mismatch)
            start = fr.start - first * math.prod(block[1:])

            def finish(o: torch.Tensor) -> None:
                data.copy_(o.reshape(-1)[start : start + data.numel()])

        covered = 0
        seen: set[tuple[int, ...]] = set()  # flat blocks already used (one per block)
        for row in rows:
            covered += self._fill_from(row, sh.key, box, out, seen, into)
        if into:
            self._note_group(out.data_ptr(), out.nbytes, into)
        if covered != math.prod(box[1]) and not sh.allow_shape_mismatch:
            raise CorruptCheckpointError(
                f"'{sh.key}': the checkpoint's chunks cover {covered} of the "
                f"{math.prod(box[1])} requested elements at offsets {box[0]}"
            )
        if finish is not None:
            self.plan.copies.append(partial(finish, out))

    @staticmethod
    def _alloc(shape: tuple[int, ...], dtype: torch.dtype, zeros: bool) -> torch.Tensor:
        return (torch.zeros if zeros else torch.empty)(shape, dtype=dtype)

    def _fill_from(
        self,
        row: int,
        key: str,
        box: Box,
        out: torch.Tensor,
        seen: set[tuple[int, ...]],
        into: list[int] | None,
    ) -> int:
        """Plan what entry ``row`` contributes to ``out`` (the target ``box``); returns
        the number of elements it covers. ``into``: where to note the reads that land in
        ``out`` when it is the request's memory."""
        c = self.index.columns
        _, o, s = self.index.box(row)
        inter = box_intersection((o, s), box)
        if inter is None:
            return 0
        lo, size = inter
        dst = out[box_slices(tuple(a - b for a, b in zip(lo, box[0])), size)]
        if c["kind"][row] == KIND_FLAT:
            if o in seen:
                return 0
            seen.add(o)
            first = lo[0] - o[0] if s else 0  # the rows of the stored block that meet the box
            stored = self._flat_rows(key, o, s, self.index.dtype_of(row), first, size[:1])
            at = (0,) + tuple(a - b for a, b in zip(lo[1:], o[1:])) if s else ()
            src = stored[box_slices(at, size)]
            self.plan.copies.append(partial(copy_reshaped, dst, src))
        elif c["kind"][row] == KIND_GRID:
            self._rows_of_grid(row, o, s, lo, size, dst, into)
        else:
            raise CheckpointingException(f"'{key}' is stored as an object, requested as a tensor")
        return math.prod(size)

    def _rows_of_grid(
        self,
        row: int,
        o: tuple[int, ...],
        s: tuple[int, ...],
        lo: tuple[int, ...],
        size: tuple[int, ...],
        dst: torch.Tensor,
        into: list[int] | None,
    ) -> None:
        """Read the rows (axis 0) of grid entry ``row`` that meet the box ``(lo, size)``."""
        dtype = self.index.dtype_of(row)
        itemsize = ITEMSIZE[dtype]
        length = self.index.columns["length"][row]
        if not s:  # a 0-d tensor: its one element
            r0, r1, row_bytes = 0, 1, length
        else:
            r0, r1 = lo[0] - o[0], lo[0] - o[0] + size[0]
            row_bytes = math.prod(s[1:]) * itemsize
        want_lo, want_hi = r0 * row_bytes, r1 * row_bytes
        whole = want_lo == 0 and want_hi == length
        if whole and tuple(size[1:]) == tuple(s[1:]) and dst.is_contiguous() and dst.dtype == dtype:
            if into is not None and length:
                into.append(len(self.plan.reads))
            self.plan.reads.append(self._read(row, 0, length, buffer_of(dst)))
            return
        lo_b, hi_b = whole_blocks(want_lo, want_hi, self.index.block_bytes, length)
        # The block bounds need not fall on elements (any block size is valid): lead the
        # staging buffer with the bytes that put the wanted rows on an element boundary.
        lead = -(want_lo - lo_b) % itemsize
        rows_shape = (r1 - r0,) + tuple(s[1:])
        sub = tuple(slice(a - b, a - b + n) for a, b, n in zip(lo[1:], o[1:], size[1:]))
        at = lead + want_lo - lo_b

        def deliver(buf: torch.Tensor) -> None:
            part = buf[at : at + want_hi - want_lo].view(dtype).view(rows_shape)
            dst.copy_(part[(slice(None),) + sub] if s else part.reshape(dst.shape))

        read = self._read(row, lo_b, hi_b - lo_b, None)
        read.stage = Staged(lead, deliver)
        if into is not None:
            into.append(len(self.plan.reads))
        self.plan.reads.append(read)

    def _flat_rows(
        self,
        key: str,
        o: tuple[int, ...],
        s: tuple[int, ...],
        dtype: torch.dtype,
        first: int,
        count: tuple[int, ...],
    ) -> torch.Tensor:
        """Rows ``first`` to ``first + count[0]`` (all of a 0-d block) of the stored block
        at ``o``, assembled from the parts of its flat entries that hold them (read
        straight in where they span whole checksum blocks, else staged): only what the
        request needs, not the whole block (a data-parallel rank's request meets a small
        part of each block)."""
        per_row = math.prod(s[1:])
        a = first * per_row
        b = a + (count[0] * per_row if s else 1)
        rows = torch.empty(b - a, dtype=dtype)
        parts = self._flat_parts(self.index.rows_by_key[key], list(o), list(s), a, b)
        self._read_parts(parts, a, rows.view(torch.uint8), ITEMSIZE[dtype], None)
        covered = sum(hi - lo for _, lo, hi in parts)
        if covered != b - a:
            raise CorruptCheckpointError(
                f"'{key}': the flat ranges stored for the block at {o} cover {covered} of "
                f"the {b - a} elements of its flattening [{a}, {b}) requested"
            )
        return rows.view(((count[0],) + s[1:]) if s else s)


__all__ = ["LoadPlan", "ReshardPlanner", "copy_reshaped"]
