"""The part of a ``raw_bytes`` index that one rank's load can use.

A checkpoint saved by ``W`` ranks with distributed-optimizer state stores a flat range
of every parameter from every rank: ``W`` entries per key, ``C = W x T`` in all. Every
loading rank parses the whole index (a few vectorized passes, no Python object per
entry), but planning its request over all of it made a Python object of every field of
every entry and scanned every entry of each requested key: ``O(W x T)`` Python work and
memory on every rank. Here the entries are narrowed first, in ``numpy``:

1. :func:`key_table`: a number for each entry's key. Only the distinct ``(start,
   length)`` places of the key section are decoded. Each rank writes the keys of its
   flat ranges as one run of its key bytes, and the save's coordinator writes a run
   once where another rank's is the same (:func:`.pieces.merge_pieces`): the ranks of a
   data-parallel group store the same optimizer keys, so these are a few places per
   key. (An index without that sharing decodes every entry's key, as before.)
2. :func:`rows_for` keeps the entries of the requested keys whose stored box can meet
   the requested one; for a flat range requested of a block that is stored as flat
   ranges of that same block, the stored ranges that meet the request widened to whole
   rows of the block. A key requested more than once, as an object, with
   ``allow_shape_mismatch``, of another number of axes or of no elements keeps all its
   entries, and every requested key keeps at least its first one (so that what the
   planner reports about it is unchanged).
3. :func:`subset`: an index of those entries only (their dims and checksums copied
   out, the key section and files as they are), which the planner and the reader use.

An entry dropped here meets no request, so the plan made from the subset reads the same
bytes into the same places as the plan made from the whole index.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import CorruptCheckpointError
from ...mapping import ShardedBase, ShardedObject, ShardedTensor
from .index import KIND_FLAT, RawIndex

# Entries compared per pass (bounds the temporary arrays: a few int64 columns of this).
_PASS_ROWS = 1 << 20
_KEEP_ALL = -2  # a key whose entries are all kept
_NOT_ASKED = -1


@dataclass
class KeyTable:
    """Each entry's key as a number: ``names[ids[row]]`` is the key of entry ``row``."""

    names: list[str]
    ids: np.ndarray  # int32, one per entry
    by_name: dict[str, int]


def key_table(index: RawIndex) -> KeyTable:
    """The :class:`KeyTable` of ``index``: one decode per distinct place in its key
    section, not one per entry."""
    e = index.entries
    if not len(e):
        return KeyTable([], np.zeros(0, dtype=np.int32), {})
    starts = e["key_start"].astype(np.int64)
    lens = e["key_len"].astype(np.int64)
    places, inverse = _places(starts, lens, len(index.keys))
    by_name: dict[str, int] = {}
    place_ids = np.empty(len(places[0]), dtype=np.int32)
    keys = index.keys
    for i, (start, n) in enumerate(zip(places[0].tolist(), places[1].tolist())):
        try:
            name = keys[start : start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptCheckpointError(
                f"malformed raw_bytes index: the key at byte {start} is not UTF-8"
            ) from None
        place_ids[i] = by_name.setdefault(name, len(by_name))
    return KeyTable(list(by_name), place_ids[inverse], by_name)


def _places(
    starts: np.ndarray, lens: np.ndarray, size: int
) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """The distinct ``(start, length)`` pairs (two columns) and each entry's pair.
    ``parse_index`` bounds both by the key section's ``size``."""
    if size <= 4 * len(starts) + (1 << 16):  # a table by start (shared key bytes)
        len_at = np.full(size + 1, -1, dtype=np.int64)
        len_at[starts] = lens
        if bool((len_at[starts] == lens).all()):  # each start has one length
            first = np.flatnonzero(len_at >= 0)
            number = np.zeros(size + 1, dtype=np.int64)
            number[first] = np.arange(len(first))
            return (first, len_at[first]), number[starts]
    width = int(lens.max()) + 1
    codes, inverse = np.unique(starts * width + lens, return_inverse=True)
    return (codes // width, codes % width), inverse.reshape(-1)


@dataclass
class _Requests:
    """The boxed requests of one load as columns, one row per key."""

    ndim: list[int]
    offset: list[tuple[int, ...]]
    shape: list[tuple[int, ...]]
    flat: list[tuple[int, int]]  # (-1, -1): not a flat range

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Offsets and shapes (padded with zeros to the most axes), axes, flat ranges."""
        width = max(self.ndim)
        off, shape = self.offset, self.shape
        if min(self.ndim) != width:
            off = [o + (0,) * (width - len(o)) for o in off]
            shape = [b + (0,) * (width - len(b)) for b in shape]
        return (
            np.array(off, dtype=np.int64).reshape(-1, width),
            np.array(shape, dtype=np.int64).reshape(-1, width),
            np.array(self.ndim, dtype=np.int64),
            np.array(self.flat, dtype=np.int64).reshape(-1, 2),
        )


def _requests(table: KeyTable, leaves: Iterable[ShardedBase]) -> tuple[np.ndarray, _Requests]:
    """Per key number: the row of its request in the returned columns, ``_KEEP_ALL`` or
    ``_NOT_ASKED`` (about a microsecond per leaf)."""
    which = [_NOT_ASKED] * len(table.names)
    by_name = table.by_name
    req = _Requests([], [], [], [])
    for sh in leaves:
        if not isinstance(sh, ShardedTensor):
            kid = by_name.get(sh.unique_key if isinstance(sh, ShardedObject) else sh.key)
            if kid is not None:
                which[kid] = _KEEP_ALL
            continue
        kid = by_name.get(sh.key)
        if kid is None:
            continue  # not stored: the planner says so
        block = sh.local_shape
        if sh.prepend_axis_num:
            block = (1,) * sh.prepend_axis_num + tuple(block)
        if which[kid] != _NOT_ASKED or sh.allow_shape_mismatch or not block or 0 in block:
            which[kid] = _KEEP_ALL
            continue
        which[kid] = len(req.ndim)
        req.ndim.append(len(block))
        req.offset.append(tuple(sh.global_offset))
        req.shape.append(tuple(block))
        fr = sh.flattened_range
        if fr is None:
            req.flat.append((-1, -1))
        else:  # widened to whole rows of the block (see the module docstring)
            per_row = math.prod(block[1:])
            req.flat.append((fr.start // per_row * per_row, -(-fr.stop // per_row) * per_row))
    return np.array(which, dtype=np.int32), req


def rows_for(index: RawIndex, table: KeyTable, leaves: Sequence[ShardedBase]) -> np.ndarray:
    """The entries (rows of ``index``, in order) that the request of ``leaves`` can use
    (see the module docstring)."""
    which, req = _requests(table, leaves)
    asked = which[table.ids]
    cand = np.flatnonzero(asked != _NOT_ASKED)
    keep = np.zeros(len(cand), dtype=bool)
    if req.ndim:
        q_off, q_shape, q_ndim, q_flat = req.arrays()
        for lo in range(0, len(cand), _PASS_ROWS):
            part = slice(lo, lo + _PASS_ROWS)
            keep[part] = _meets(
                index, cand[part], asked[cand[part]], q_off, q_shape, q_ndim, q_flat
            )
    keep |= asked[cand] == _KEEP_ALL
    # Every requested key keeps its first entry: the planner's reports stay as they were.
    first = np.full(len(table.names), len(cand), dtype=np.int64)
    np.minimum.at(first, table.ids[cand], np.arange(len(cand)))
    keep[first[first < len(cand)]] = True
    return cand[keep]


def _meets(
    index: RawIndex,
    rows: np.ndarray,
    q: np.ndarray,
    q_off: np.ndarray,
    q_shape: np.ndarray,
    q_ndim: np.ndarray,
    q_flat: np.ndarray,
) -> np.ndarray:
    """Whether each entry of ``rows`` (boxed request ``q[i]``, or ``_KEEP_ALL``) meets
    its request; entries of another number of axes are kept."""
    ent, dims = index.entries, index.dims
    boxed = q >= 0
    q = np.where(boxed, q, 0)
    nd = ent["ndim"][rows].astype(np.int64)
    same_ndim = boxed & (nd == q_ndim.take(q))
    meets = np.ones(len(rows), dtype=bool)
    same_box = same_ndim.copy()
    offsets = np.where(same_ndim, ent["dims_start"][rows].astype(np.int64) + nd, 0)
    for d in range(q_off.shape[1] if len(dims) else 0):
        has = same_ndim & (d < nd)
        eo = dims.take(np.where(has, offsets + d, 0))
        es = dims.take(np.where(has, offsets + nd + d, 0))
        qo, qs = q_off[:, d].take(q), q_shape[:, d].take(q)
        meets &= ~has | ((eo < qo + qs) & (qo < eo + es))
        same_box &= ~has | ((eo == qo) & (es == qs))
    a, b = q_flat[:, 0].take(q), q_flat[:, 1].take(q)
    flat = same_box & (a >= 0) & (ent["kind"][rows] == KIND_FLAT)
    fs = ent["flat_start"][rows].astype(np.int64)
    fe = ent["flat_stop"][rows].astype(np.int64)
    meets &= ~flat | ((fs < b) & (a < fe))
    out: np.ndarray = meets | ~same_ndim
    return out


def subset(index: RawIndex, rows: np.ndarray) -> RawIndex:
    """``index`` with the entries ``rows`` only (their dims and checksums copied into
    sections of their own; the key section and the files are shared)."""
    e = index.entries[rows]  # a copy
    dims, e["dims_start"] = _gather(index.dims, e["dims_start"], 3 * e["ndim"].astype(np.int64))
    crcs, e["crc_start"] = _gather(index.crcs, e["crc_start"], e["crc_count"])
    return RawIndex(
        index.alignment,
        index.block_bytes,
        index.dtypes,
        index.files,
        e,
        dims,
        crcs,
        index.keys,
        dict(index.extra),
    )


def _gather(
    values: np.ndarray, starts: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The runs ``values[starts[i] : starts[i] + counts[i]]`` one after the other, and
    where each starts in the result."""
    counts = counts.astype(np.int64)
    new_starts = np.cumsum(counts) - counts
    at = np.repeat(starts.astype(np.int64) - new_starts, counts) + np.arange(int(counts.sum()))
    return values[at], new_starts


__all__ = ["KeyTable", "key_table", "rows_for", "subset"]
