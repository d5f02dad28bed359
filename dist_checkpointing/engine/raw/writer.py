"""Planning a rank's part of a ``raw_bytes`` checkpoint.

:func:`plan_rank` turns a rank's main-replica leaves into one :class:`RankWrite`
(which bytes go where: a few data files per rank, every item at an aligned
offset) and the rank's :class:`~.pieces.IndexPiece` (entries built as numpy
arrays from plain lists: no Python object per item beyond the list entries).
:func:`.data_files.write_rank` writes the files.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica
from ..storage.host_staging import StagingStep, TensorSlot
from ..storage.names import safe_name
from .index import (
    DATA_SUFFIX,
    DTYPE_NAMES,
    ENTRY_DTYPE,
    ITEMSIZE,
    KIND_FLAT,
    KIND_GRID,
    KIND_OBJECT,
    dtype_name,
)
from .pieces import IndexPiece


def data_file_name(rank: int, n: int, save_tag: str = "") -> str:
    """Data file ``n`` of group rank ``rank``: ``__<rank>_<n>[.<tag>].dcpraw``."""
    tag = f".{save_tag}" if save_tag else ""
    return safe_name(f"__{rank}_{n}{tag}{DATA_SUFFIX}", source="save")


@dataclass
class RankWrite:
    """What one rank writes: per file, ``(offset, length, data)`` items in file order;
    ``data`` is a contiguous CPU tensor (after staging) of ``length`` bytes, or bytes."""

    root: str
    names: list[str]
    items: list[list[tuple[int, int, Any]]]
    block_bytes: int
    sync: bool = True
    sizes: list[int] = field(default_factory=list)
    digest: bool = False  # also compute each file's sha256 (for the integrity manifest)
    # (file, position) of the tensor items planned on an accelerator or not contiguous
    # (the staging step copies them; None: not known, look at every item).
    special: list[tuple[int, int]] | None = None


@dataclass(frozen=True)
class StageRankWrite(StagingStep):
    """The staging step of a ``raw_bytes`` save (its request's ``preload_fn``): the
    slots are the tensors of ``write.items``; a non-contiguous one must be copied (the
    writer writes raw memory). Works in place (the result is None).

    With ``deferred`` (a synchronous save with a copy-ahead budget) it copies only the
    non-contiguous host tensors: :func:`write_rank` streams accelerator tensors through
    the staging pool.
    """

    write: RankWrite
    deferred: bool = False

    def slots(self) -> list[TensorSlot]:
        return [
            TensorSlot(file_items, i, 2, required=not data.is_contiguous())
            for file_items in self.write.items
            for i, (_, _, data) in enumerate(file_items)
            if isinstance(data, torch.Tensor)
        ]

    def host_copies(self) -> list[TensorSlot]:
        items = self.write.items
        if self.write.special is None:
            where = [(f, i) for f, file_items in enumerate(items) for i in range(len(file_items))]
        else:
            where = self.write.special
        return [
            TensorSlot(items[f], i, 2, required=True)
            for f, i in where
            if isinstance(data := items[f][i][2], torch.Tensor)
            and data.is_cpu
            and not data.is_contiguous()
        ]


@dataclass
class _Leaves:
    """Per-item columns collected from the leaves (plain lists, made arrays at the end)."""

    keys: list[str] = field(default_factory=list)
    kinds: list[int] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    ndims: list[int] = field(default_factory=list)
    dims: list[int] = field(default_factory=list)
    flat: list[int] = field(default_factory=list)  # start, stop of each item's flat range
    lengths: list[int] = field(default_factory=list)
    data: list[Any] = field(default_factory=list)
    # Items whose data is a tensor the writer cannot take as it is (on an accelerator,
    # or not contiguous): found once here, so that the later steps scan only these.
    special: list[int] = field(default_factory=list)


_NO_RANGE = (0, 0)


def planned_leaves(leaves: list[ShardedBase]) -> list[ShardedBase]:
    """The leaves a rank's plan has an item for, in item order: its main replicas,
    but for empty flat ranges (nothing to store)."""
    out: list[ShardedBase] = []
    for sh in leaves:
        rid = sh.replica_id
        if rid != 0 and not is_main_replica(rid):
            continue
        if isinstance(sh, ShardedTensor):
            fr = sh.flattened_range
            if fr is not None and fr.stop <= fr.start:
                continue
        elif not isinstance(sh, ShardedObject):
            continue
        out.append(sh)
    return out


def object_payload(sh: ShardedObject) -> bytes:
    """The stored bytes of a ShardedObject (``torch.save`` of its data)."""
    buf = io.BytesIO()
    torch.save(sh.data, buf)
    return buf.getvalue()


def _collect(leaves: list[ShardedBase]) -> _Leaves:
    out = _Leaves()
    for sh in leaves:
        if isinstance(sh, ShardedTensor):
            _add_tensor(out, sh)
            continue
        assert isinstance(sh, ShardedObject)
        payload = object_payload(sh)
        out.keys.append(sh.unique_key)
        out.kinds.append(KIND_OBJECT)
        out.dtypes.append("uint8")
        out.ndims.append(0)
        out.flat += _NO_RANGE
        out.lengths.append(len(payload))
        out.data.append(payload)
    return out


def _add_tensor(out: _Leaves, sh: ShardedTensor) -> None:
    """One tensor's columns, from the ShardedTensor's fields (validated on construction:
    ``data`` has ``dtype`` and the local or flat shape)."""
    fr = sh.flattened_range
    data = sh.data
    if data is None:
        raise ValueError(f"ShardedTensor {sh.key!r} has no data to save")
    local = sh.local_shape
    if fr is None:
        count = math.prod(local)
        out.kinds.append(KIND_GRID)
        out.flat += _NO_RANGE
    else:
        count = fr.stop - fr.start
        out.kinds.append(KIND_FLAT)
        out.flat += (fr.start, fr.stop)
    dtype = sh.dtype
    out.keys.append(sh.key)
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        try:
            name = dtype_name(dtype)
        except ValueError as exc:
            raise ValueError(f"ShardedTensor {sh.key!r}: {exc}") from None
    out.dtypes.append(name)
    gshape = sh.global_shape
    out.ndims.append(len(gshape))
    dims = out.dims
    dims += gshape
    dims += sh.global_offset
    if sh.prepend_axis_num:
        dims += (1,) * sh.prepend_axis_num
    dims += local
    if data.dtype is not dtype or data.numel() != count:  # data replaced after construction
        raise ValueError(
            f"ShardedTensor {sh.key!r}: its data ({data.dtype}, shape {tuple(data.shape)}) "
            f"does not match its dtype {dtype} and {count} elements"
        )
    out.lengths.append(count * ITEMSIZE[dtype])
    if not (data.is_cpu and data.is_contiguous()):
        out.special.append(len(out.data))
    out.data.append(data)


def _aligned(lengths: np.ndarray, alignment: int) -> np.ndarray:
    return (lengths + (alignment - 1)) // alignment * alignment


@dataclass
class Layout:
    """Where a rank's items go, without their data: what a save of an unchanged
    structure reuses (:mod:`.plan_reuse`). ``piece`` is the index piece's template
    (its ``files`` and ``crcs`` are made anew for each save)."""

    files_of: list[int]  # each item's file
    offsets: list[int]  # each item's offset in its file
    lengths: list[int]  # each item's bytes
    firsts: list[int]  # the first item of each file
    sizes: list[int]  # each file's bytes
    crc_total: int
    piece: IndexPiece


# The order of the key runs: flat ranges, grid blocks, objects (by kind).
_RUN_OF_KIND = np.array([1, 0, 2])
assert (KIND_GRID, KIND_FLAT, KIND_OBJECT) == (0, 1, 2)


def _key_section(c: _Leaves) -> tuple[bytes, np.ndarray, np.ndarray, list[int]]:
    """The piece's key bytes, each item's key start and length in them, and the byte
    lengths of the runs the coordinator may share with other pieces
    (:func:`.pieces.merge_pieces`): the keys of flat ranges (the ranks of a data-parallel
    group store the same optimizer keys), of grid blocks (the ranks of a tensor-parallel
    group store the same keys) and of objects (often one rank's own)."""
    n = len(c.keys)
    runs = _RUN_OF_KIND[np.array(c.kinds, dtype=np.int64)] if n else np.zeros(0, np.int64)
    ordered = n < 2 or bool((runs[1:] >= runs[:-1]).all())  # e.g. grid blocks only
    order = np.arange(n) if ordered else np.argsort(runs, kind="stable")
    keys = c.keys if ordered else [c.keys[i] for i in order.tolist()]
    blob = "".join(keys).encode()
    lens = np.fromiter(map(len, keys), dtype=np.int64, count=n)
    if len(blob) != int(lens.sum()):  # non-ASCII keys: count bytes
        lens = np.fromiter((len(k.encode()) for k in keys), dtype=np.int64, count=n)
    starts = np.empty(n, dtype=np.int64)
    starts[order] = np.cumsum(lens) - lens
    run_bytes = np.bincount(runs[order], weights=lens, minlength=3).astype(np.int64)
    by_item = np.empty(n, dtype=np.int64)
    by_item[order] = lens
    return blob, starts, by_item, run_bytes.tolist()


def _layout(c: _Leaves, file_count: int, alignment: int, block_bytes: int) -> Layout:
    """Place the collected items into up to ``file_count`` data files (contiguous runs
    of similar total size) at ``alignment``-byte offsets."""
    n = len(c.kinds)
    lengths = np.array(c.lengths, dtype=np.int64)
    padded = _aligned(lengths, alignment)
    starts = np.cumsum(padded) - padded
    total = int(padded.sum())
    files = min(file_count, n) or 1
    file_of = np.minimum(starts * files // max(total, 1), files - 1) if n else lengths
    # Runs of items in file order; a large item may leave a file empty: renumber.
    used, file_of = np.unique(file_of, return_inverse=True)
    files = len(used)
    firsts = np.searchsorted(file_of, np.arange(files))
    offsets = starts - starts[firsts][file_of] if n else lengths
    dtype_names = sorted(set(c.dtypes)) or ["uint8"]
    dtype_ids = {d: i for i, d in enumerate(dtype_names)}
    ndims = np.array(c.ndims, dtype=np.int64)
    key_blob, key_starts, key_lens, key_runs = _key_section(c)
    if block_bytes:
        crc_counts = np.maximum(-(-lengths // block_bytes), 1)
    else:
        crc_counts = np.zeros(n, dtype=np.int64)
    e = np.zeros(n, dtype=ENTRY_DTYPE)
    e["key_start"] = key_starts
    e["key_len"] = key_lens
    e["kind"] = c.kinds
    e["dtype"] = [dtype_ids[d] for d in c.dtypes]
    e["ndim"] = ndims
    e["file"] = file_of
    e["crc_count"] = crc_counts
    e["offset"] = offsets
    e["length"] = lengths
    e["dims_start"] = np.cumsum(3 * ndims) - 3 * ndims
    flat = np.array(c.flat, dtype=np.int64).reshape(n, 2)  # from plain ints: fast
    e["flat_start"], e["flat_stop"] = flat[:, 0], flat[:, 1]
    e["crc_start"] = np.cumsum(crc_counts) - crc_counts
    files_of = file_of.tolist() if n else []
    offsets_l = offsets.tolist() if n else []
    sizes = [0] * files if n else []
    for f, off, length in zip(files_of, offsets_l, c.lengths):
        sizes[f] = off + length  # items in file order: the last one ends the file
    piece = IndexPiece(
        files=[],
        file_sizes=sizes,
        entries=e,
        dims=np.array(c.dims, dtype="<i8"),
        crcs=np.zeros(0, dtype="<u4"),
        keys=key_blob,
        dtypes=dtype_names,
        key_runs=key_runs,
    )
    crc_total = int(crc_counts.sum())
    return Layout(files_of, offsets_l, list(c.lengths), firsts.tolist(), sizes, crc_total, piece)


def assemble(
    layout: Layout,
    data: list[Any],
    special: list[int],
    root: str,
    rank: int,
    block_bytes: int,
    save_tag: str,
) -> tuple[RankWrite, IndexPiece]:
    """The :class:`RankWrite` and :class:`~.pieces.IndexPiece` of ``layout`` with
    ``data`` (one per item; ``special``: the items the staging step must look at)."""
    names = [data_file_name(rank, f, save_tag) for f in range(len(layout.sizes))]
    items: list[list[tuple[int, int, Any]]] = [[] for _ in names]
    for f, off, length, value in zip(layout.files_of, layout.offsets, layout.lengths, data):
        items[f].append((off, length, value))
    firsts, files_of = layout.firsts, layout.files_of
    where = [(files_of[i], i - firsts[files_of[i]]) for i in special]
    write = RankWrite(root, names, items, block_bytes, sizes=list(layout.sizes), special=where)
    t = layout.piece
    piece = IndexPiece(
        files=names,
        file_sizes=list(layout.sizes),
        entries=t.entries.copy(),
        dims=t.dims.copy(),
        crcs=np.zeros(layout.crc_total, dtype="<u4"),
        keys=t.keys,
        dtypes=list(t.dtypes),
        key_runs=t.key_runs,
    )
    return write, piece


def plan_items(
    planned: list[ShardedBase], file_count: int, alignment: int, block_bytes: int
) -> tuple[Layout, list[Any], list[int]]:
    """The layout of the :func:`planned_leaves` ``planned``, their data and the items
    the staging step must look at (the arguments of :func:`assemble`)."""
    c = _collect(planned)
    return _layout(c, file_count, alignment, block_bytes), c.data, c.special


def plan_rank(
    leaves: list[ShardedBase],
    root: str,
    rank: int,
    file_count: int,
    alignment: int,
    block_bytes: int,
    save_tag: str = "",
) -> tuple[RankWrite, IndexPiece]:
    """Place the main-replica leaves of one rank into up to ``file_count`` data files
    (contiguous runs of similar total size) at ``alignment``-byte offsets."""
    planned = plan_items(planned_leaves(leaves), file_count, alignment, block_bytes)
    return assemble(*planned, root, rank, block_bytes, save_tag)


__all__ = [
    "Layout",
    "RankWrite",
    "StageRankWrite",
    "assemble",
    "data_file_name",
    "object_payload",
    "plan_items",
    "plan_rank",
    "planned_leaves",
]
