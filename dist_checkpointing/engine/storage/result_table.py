"""One rank's write results as columns: what the coordinator needs of them, in a form
that is cheap to pickle, to send and to hold.

After the writes, every rank sends the coordinator what it wrote: each item's key and
chunk offset, its size, its file, its place in the file and its block checksums. As
DCP ``WriteResult`` objects, or as one tuple per item, that is 15-20 Python objects per
item once the coordinator has unpickled them (about 650 bytes): at 100,000 items from
another rank, 60 MiB, and ``W x T`` of them with distributed-optimizer state. A
:class:`ResultTable` holds the keys as a list of strings, equal chunk offsets as one
tuple, and everything else in numpy arrays (one per column, in the narrowest dtype that
holds it; all block CRCs in one): about 90 bytes per item held, 28 pickled (each column
as one byte string), against 61 for the tuples.

The coordinator reads a table back a row at a time (:meth:`ResultTable.rows`, the
``WriteResult`` fields in order) to build ``Metadata.storage_data``, and builds the
commit record's :class:`~.checksums.DataFileEntry` of each file straight from the
columns (:func:`data_files_from_tables`). A save whose structure and results are
unchanged sends only the location and checksum columns (:meth:`ResultTable.locations`).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from ..._torch_compat import StorageInfo
from .item_checksums import DataFileEntry, ItemChecksum

# One row: key, chunk offset (a tuple, or None), size in bytes, file, offset in the file,
# length, transform descriptors, item checksum (or None): the fields of a WriteResult.
ResultRow = tuple[Any, ...]


def _column(values: list[int]) -> np.ndarray:
    """``values`` in the narrowest unsigned dtype that holds them (int64 if any is
    negative): a column of small lengths pickles in 2 bytes a row, not 8."""
    return _narrow(np.array(values, dtype=np.int64)) if values else _NO_INTS


def _narrow(column: np.ndarray) -> np.ndarray:
    if len(column) and int(column.min()) >= 0:
        return column.astype(np.min_scalar_type(int(column.max())), copy=False)
    return column


def _frozen(column: np.ndarray) -> np.ndarray:
    column.flags.writeable = False
    return column


_NO_INTS = _frozen(np.zeros(0, dtype=np.uint8))  # the columns of an empty table (shared)
_NO_BOOLS = _frozen(np.zeros(0, dtype=np.bool_))


def _int64(column: np.ndarray) -> np.ndarray:
    return column.astype(np.int64, copy=False)


@dataclass(eq=False)
class ResultTable:
    """One rank's write results, a column per field (see the module docstring).

    Row ``i`` is one write result. ``offsets`` holds one tuple per distinct chunk
    offset; ``files`` the distinct file names, ``file_rows`` the index of each row's
    file. Checksums: ``crc_counts[i]`` block CRCs of row ``i`` follow those of the rows
    before it in ``crcs``; ``has_checksum[i]`` is False for a row without a checksum;
    a checksum covers its item's bytes (``starts``, ``lengths``) unless
    ``checksum_places`` gives another ``(offset, length)``. Integer columns are in the
    narrowest dtype that holds them. A table of locations only (:meth:`locations`) has
    no keys, offsets or sizes.
    """

    fqns: list[Any]
    offsets: list[tuple[int, ...] | None]
    sizes: np.ndarray
    files: list[str]
    file_rows: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    has_checksum: np.ndarray
    crc_counts: np.ndarray
    crcs: np.ndarray
    checksum_places: dict[int, tuple[int, int]] = field(default_factory=dict)
    transforms: dict[int, Any] = field(default_factory=dict)  # rows that have any

    @classmethod
    def of(cls, results: Iterable[WriteResult]) -> ResultTable:
        """The table of ``results``, in their order (one pass over them)."""
        shared: dict[Any, tuple[int, ...]] = {}  # equal offsets: one tuple
        files: dict[str, int] = {}
        transforms: dict[int, Any] = {}
        places: dict[int, tuple[int, int]] = {}
        fqns, offsets, sizes, file_rows, starts, lengths = [], [], [], [], [], []
        has, counts, crcs = [], [], []
        for i, r in enumerate(results):
            index, info = r.index, r.storage_data
            fqns.append(index.fqn)
            at = index.offset
            key = None if at is None else tuple(at)
            offsets.append(None if key is None else shared.setdefault(key, key))
            sizes.append(r.size_in_bytes)
            file_rows.append(files.setdefault(info.relative_path, len(files)))
            starts.append(info.offset)
            lengths.append(info.length)
            descriptors = getattr(info, "transform_descriptors", None)
            if descriptors is not None:
                transforms[i] = descriptors
            checksum = getattr(r, "checksum", None)
            has.append(checksum is not None)
            if checksum is None:
                counts.append(0)
                continue
            counts.append(len(checksum.blocks))
            crcs += checksum.blocks
            if checksum.offset != info.offset or checksum.length != info.length:
                places[i] = (checksum.offset, checksum.length)
        return cls(
            fqns=fqns,
            offsets=offsets,
            sizes=_column(sizes),
            files=list(files),
            file_rows=_column(file_rows),
            starts=_column(starts),
            lengths=_column(lengths),
            has_checksum=np.array(has, dtype=np.bool_),
            crc_counts=_column(counts),
            crcs=_column(crcs),
            checksum_places=places,
            transforms=transforms,
        )

    def __len__(self) -> int:
        return len(self.starts)

    def __reduce__(self) -> tuple[Any, ...]:
        # The fields in order, each column as its dtype and bytes: a small table
        # unpickles in a third of the time numpy's and a dataclass's own pickling take
        # (4,096 ranks send 4,096 small tables).
        if not self.files and not len(self):
            return _empty_table, ()  # a rank that wrote nothing (most ranks, with DP)
        values = [
            (v.dtype.str, v.tobytes()) if isinstance(v, np.ndarray) else v
            for v in (getattr(self, f) for f in _FIELDS)
        ]
        return _table, tuple(values)

    def _crc_starts(self) -> np.ndarray:
        starts = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.crc_counts, out=starts[1:])
        return starts

    def rows(self) -> Iterator[ResultRow]:
        """Each row as the fields of its WriteResult (see ``ResultRow``), in order."""
        if not len(self):
            return
        files, transforms, places = self.files, self.transforms, self.checksum_places
        crc_starts = self._crc_starts().tolist()
        crcs = self.crcs.tolist()
        columns = zip(
            self.fqns,
            self.offsets,
            self.sizes.tolist(),
            self.file_rows.tolist(),
            self.starts.tolist(),
            self.lengths.tolist(),
            self.has_checksum.tolist(),
        )
        for i, (fqn, offset, size, f, start, length, has) in enumerate(columns):
            checksum = None
            if has:
                at, n = places.get(i, (start, length))
                checksum = ItemChecksum(at, n, crcs[crc_starts[i] : crc_starts[i + 1]])
            yield (fqn, offset, size, files[f], start, length, transforms.get(i), checksum)

    def digest(self) -> int:
        """A digest of the results without their checksums (which change with the data)."""
        h = hashlib.blake2b(digest_size=8)
        h.update(pickle.dumps((self.fqns, self.offsets, self.files, self.transforms), protocol=4))
        for column in (self.sizes, self.file_rows, self.starts, self.lengths):
            h.update(_int64(column).tobytes())  # whatever dtype the values came in
        return int.from_bytes(h.digest(), "little") >> 1

    def write_results(self) -> list[WriteResult]:
        """The rows as DCP ``WriteResult`` objects (with their ``checksum`` attribute,
        as the writer makes them; the index hints are not kept)."""
        out = []
        for fqn, offset, size, path, start, length, transforms, checksum in self.rows():
            result = WriteResult(
                MetadataIndex(fqn, None if offset is None else torch.Size(offset)),
                size,
                StorageInfo(path, start, length, transforms),
            )
            object.__setattr__(result, "checksum", checksum)  # WriteResult is frozen
            out.append(result)
        return out

    @classmethod
    def concat(cls, tables: Sequence[ResultTable]) -> ResultTable:
        """One table of the rows of ``tables``, in order (a few array operations per
        table: a save of 4,096 ranks sends 4,096 small tables)."""
        if len(tables) == 1:
            return tables[0]
        files: dict[str, int] = {}
        file_rows, shifts, counts, places, transforms, base = [], [], [], {}, {}, 0
        for t in tables:
            first = len(files)
            ids = [files.setdefault(p, len(files)) for p in t.files]
            n = len(t)
            if len(files) - first == len(ids):  # new files, in order (the usual case)
                file_rows.append(t.file_rows)
                shifts.append(first)
            else:
                file_rows.append(np.array(ids, dtype=np.int64)[_int64(t.file_rows)])
                shifts.append(0)
            counts.append(n)
            if t.checksum_places:
                places.update({base + row: at for row, at in t.checksum_places.items()})
            if t.transforms:
                transforms.update({base + row: d for row, d in t.transforms.items()})
            base += n

        def joined(name: str) -> np.ndarray:
            return _narrow(np.concatenate([getattr(t, name) for t in tables] or [_NO_INTS]))

        return cls(
            fqns=[f for t in tables for f in t.fqns],
            offsets=[o for t in tables for o in t.offsets],
            sizes=joined("sizes"),
            files=list(files),
            file_rows=_narrow(
                np.concatenate(file_rows or [_NO_INTS], dtype=np.int64)
                + np.repeat(np.asarray(shifts, dtype=np.int64), counts)
            ),
            starts=joined("starts"),
            lengths=joined("lengths"),
            has_checksum=np.concatenate([t.has_checksum for t in tables] or [_NO_BOOLS]),
            crc_counts=joined("crc_counts"),
            crcs=joined("crcs"),
            checksum_places=places,
            transforms=transforms,
        )

    def locations(self) -> ResultTable:
        """The table without keys, offsets and sizes: what a save whose results are
        unchanged sends (the files, places and checksums of its items)."""
        return ResultTable(
            fqns=[],
            offsets=[],
            sizes=_NO_INTS,
            files=self.files,
            file_rows=self.file_rows,
            starts=self.starts,
            lengths=self.lengths,
            has_checksum=self.has_checksum,
            crc_counts=self.crc_counts,
            crcs=self.crcs,
            checksum_places=self.checksum_places,
        )

    def clear(self) -> None:
        """Let go of the columns (once their content is in ``Metadata`` and the record)."""
        vars(self).update(vars(_empty_table()))


_FIELDS = tuple(f.name for f in fields(ResultTable))
_COLUMNS = frozenset(f.name for f in fields(ResultTable) if f.type in ("np.ndarray", np.ndarray))


def _empty_table() -> ResultTable:
    """A table without rows (a name in a pickle: most ranks of a large save send one)."""
    return ResultTable(
        [], [], _NO_INTS, [], _NO_INTS, _NO_INTS, _NO_INTS, _NO_BOOLS, _NO_INTS, _NO_INTS
    )


def _table(*values: Any) -> ResultTable:
    """A table from its pickled fields (:meth:`ResultTable.__reduce__`)."""
    if len(values) != len(_FIELDS):
        raise ValueError(f"a result table of {len(values)} fields, not {len(_FIELDS)}")
    table = ResultTable.__new__(ResultTable)
    for name, value in zip(_FIELDS, values):
        if name in _COLUMNS:
            dtype, data = value
            value = np.frombuffer(data, np.dtype(dtype))
        setattr(table, name, value)
    return table


def data_files_from_tables(tables: Iterable[ResultTable]) -> dict[str, DataFileEntry]:
    """Every data file the tables name, with its size (the end of its last item) and
    its items' checksums (rows without one are not listed), built from the columns.

    The tables are joined first (:meth:`ResultTable.concat`), then cut per file."""
    table = ResultTable.concat([t for t in tables if t.files])  # (the others wrote nothing)
    paths, places = table.files, table.checksum_places
    if not paths:
        return {}
    file_ids, starts, lengths = _int64(table.file_rows), _int64(table.starts), _int64(table.lengths)
    has, crcs = table.has_checksum, _int64(table.crcs)
    sizes = np.zeros(len(paths), dtype=np.int64)
    np.maximum.at(sizes, file_ids, starts + lengths)
    crc_starts = table._crc_starts()
    if places:  # a checksum over other bytes than its item's (none from our writers)
        starts, lengths = starts.copy(), lengths.copy()
        for row, (at, n) in places.items():
            starts[row], lengths[row] = at, n
    # The rows with a checksum, by file and offset; their CRCs in that order.
    order = np.flatnonzero(has)
    order = order[np.lexsort((starts[order], file_ids[order]))]
    lo, hi = crc_starts[order], crc_starts[order + 1]
    crcs = _segments(crcs, lo, hi)
    ends = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(hi - lo, out=ends[1:])
    cuts = np.searchsorted(file_ids[order], np.arange(len(paths) + 1)).tolist()
    entries = DataFileEntry.split_sorted(
        sizes.tolist(), cuts, starts[order], lengths[order], ends, crcs
    )
    return dict(zip(paths, entries))


def _segments(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``values[lo[0]:hi[0]]``, then ``values[lo[1]:hi[1]]``... in one array (no Python
    loop over the segments)."""
    counts = hi - lo
    total = int(counts.sum())
    if total == len(values) and (len(lo) == 0 or (lo[0] == 0 and bool((lo[1:] == hi[:-1]).all()))):
        return values  # every segment, in order: the usual case
    # Position k of the output is lo[row] + (k - the first position of the row).
    firsts = np.cumsum(counts) - counts
    return values[np.repeat(lo - firsts, counts) + np.arange(total, dtype=np.int64)]


__all__ = ["ResultRow", "ResultTable", "data_files_from_tables"]
