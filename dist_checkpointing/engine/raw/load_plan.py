"""Planning a ``raw_bytes`` load: which stored bytes land where, for any layout.

Every request (a ShardedTensor block, a flat range of one, or a ShardedObject)
is matched against the stored entries of its key in the index:

- the same chunk stored (the layout did not change): one :class:`~.reader.Read`
  straight into the destination tensor's memory (a whole entry for an
  accelerator destination streams through the staging pool once the reads are
  done);
- otherwise the request is planned by :class:`~.reshard_plan.ReshardPlanner`
  (resharding: flat ranges, boxes, staged reads).

A request's memory that overlaps another's (one tensor requested under two
keys) gets private buffers for its reads, copied over once every read is done
(:meth:`LoadPlanner.finish`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ...errors import CheckpointingException, ShapeMismatchError
from ...mapping import ShardedObject, ShardedTensor
from ..storage.overlaps import overlapping
from ..storage.staging_pool import shared_pool
from ..storage.tensor_bytes import buffer_of
from .index import KIND_FLAT, KIND_GRID, KIND_OBJECT
from .reader import Read
from .reshard_plan import LoadPlan, ReshardPlanner, copy_reshaped


def _copy_bytes(address: int, src: torch.Tensor) -> None:
    ctypes.memmove(address, src.data_ptr(), src.numel())


class LoadPlanner(ReshardPlanner):
    """Builds the :class:`LoadPlan` of one rank's request (see the module docstring)."""

    def finish(self) -> LoadPlan:
        self._isolate_shared()
        return self.plan

    def _isolate_shared(self) -> None:
        """Where a request's memory overlaps another's (one tensor requested under two
        keys; see :mod:`..storage.overlaps`), its reads land elsewhere and are copied over
        once every read is done: a read straight into that memory gets a private buffer, a
        staged read a staging buffer of its own. The other requests' memories are then
        pairwise disjoint, so a staged read's copy, which runs as soon as its bytes are
        verified, changes no bytes that another read is still verifying."""
        starts, lengths, groups = self._groups
        self._groups = ([], [], [])
        reads = self.plan.reads
        for n in overlapping(starts, lengths):
            for i in groups[n]:
                read = reads[i]
                if read.stage is not None:
                    self.plan.copies.append(read.stage.own_buffer(read))
                    continue
                private = torch.empty(read.length, dtype=torch.uint8)
                address = ctypes.addressof(read.dest)
                read.dest = buffer_of(private)
                self.plan.copies.append(partial(_copy_bytes, address, private))

    # ------------------------------------------------------------------ requests

    def _rows(self, key: str) -> list[int]:
        rows = self.index.rows_by_key.get(key)
        if not rows:
            raise CheckpointingException(f"'{key}' is not stored in the checkpoint")
        return rows

    def add_object(self, sh: ShardedObject) -> None:
        key = sh.unique_key
        kinds = self.index.columns["kind"]
        rows = [r for r in self._rows(key) if kinds[r] == KIND_OBJECT]
        if not rows:
            raise CheckpointingException(f"'{key}' is stored as a tensor, requested as an object")
        buf = bytearray(self.index.columns["length"][rows[0]])
        self.plan.reads.append(self._read(rows[0], 0, len(buf), buf))
        self.plan.objects.append((sh, buf))

    def add_tensor(self, sh: ShardedTensor) -> None:
        data = sh.data
        assert data is not None
        rows = self._by_key.get(sh.key) or self._rows(sh.key)
        d = self._dims
        if len(rows) == 1 and sh.flattened_range is None and not sh.prepend_axis_num:
            # One stored chunk, a plain block (most loads): the same chunk, one compare.
            row = rows[0]
            n, at = self._ndim[row], self._dims_start[row]
            if self._kind[row] == KIND_GRID and d[at : at + 3 * n] == [
                *sh.global_shape,
                *sh.global_offset,
                *sh.local_shape,
            ]:
                self._add_exact(row, data)
                return
        first = rows[0]
        n, at = self._ndim[first], self._dims_start[first]
        gshape = list(sh.global_shape)
        if d[at : at + n] != gshape and not sh.allow_shape_mismatch:
            raise ShapeMismatchError(
                f"'{sh.key}': requested global shape {tuple(gshape)}, the checkpoint "
                f"stores {tuple(d[at : at + n])}"
            )
        block = [1] * sh.prepend_axis_num + list(sh.local_shape)
        offset = list(sh.global_offset)
        fr = sh.flattened_range
        kind = KIND_GRID if fr is None else KIND_FLAT
        kinds, starts, ndims = self._kind, self._dims_start, self._ndim
        for row in rows:  # the same chunk stored: one read straight into the request
            n, at = ndims[row], starts[row]
            if kinds[row] != kind or d[at + n : at + 2 * n] != offset:
                continue
            if d[at + 2 * n : at + 3 * n] != block:
                continue
            if fr is not None and (self._flat_start[row], self._flat_stop[row]) != (
                fr.start,
                fr.stop,
            ):
                continue
            self._add_exact(row, data)
            return
        if (
            fr is not None
            and not sh.allow_shape_mismatch
            and self._add_flat(sh, rows, offset, block)
        ):
            return
        self._add_boxes(sh, rows, tuple(offset), tuple(block))

    def _add_exact(self, row: int, data: torch.Tensor) -> None:
        dtype = self._dtypes[self._dtype[row]]
        length = self._length[row]
        if data.dtype == dtype and data.is_cpu and data.is_contiguous():
            dest = data
        elif data.dtype == dtype and data.is_contiguous() and self._streams(length):
            self.plan.device_fills.append((row, data))
            return
        else:
            dest = torch.empty(data.shape, dtype=dtype)
            self.plan.copies.append(partial(copy_reshaped, data, dest))
        reads = self.plan.reads
        if length:
            address = dest.data_ptr()
            buf: Any = (ctypes.c_char * length).from_address(address)
            if dest is data:  # straight into the request: see _isolate_shared
                self._note_group(address, length, [len(reads)])
        else:
            buf = b""
        reads.append(Read(row, 0, length, buf, self._offsets[row]))

    def _streams(self, length: int) -> bool:
        """Whether an entry of ``length`` bytes for an accelerator destination streams
        through the staging pool: there is one, its buffers hold whole checksum blocks
        (each chunk is then read and verified on its own), and the entry is large (at
        least an eighth of a buffer, 4 MiB by default: smaller ones are read with the
        rest, in batches, and copied from host memory)."""
        if not self._pool_known:
            pool = shared_pool()
            bb = self.index.block_bytes or 1
            self.plan.pool = pool if pool is not None and pool.buffer_bytes % bb == 0 else None
            self._pool_known = True
        pool = self.plan.pool
        return pool is not None and length >= pool.buffer_bytes // 8


def finish_objects(plan: LoadPlan, load: Callable[[bytes, str], Any]) -> None:
    """Unpickle the objects read (through ``load``, the restricted loader)."""
    for sh, buf in plan.objects:
        sh.data = load(bytes(buf), sh.unique_key)


__all__ = ["LoadPlanner", "finish_objects"]
