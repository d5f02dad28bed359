"""One rank's part of a ``raw_bytes`` index (:class:`IndexPiece`) and the coordinator's
merge of every rank's part into the index of the save (:func:`merge_pieces`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .index import ENTRY_DTYPE, RawIndex, encode_header


@dataclass
class IndexPiece:
    """One rank's part of the index, with rank-local file, dims, crc and key positions."""

    files: list[str]
    file_sizes: list[int]
    entries: np.ndarray
    dims: np.ndarray
    crcs: np.ndarray
    keys: bytes
    dtypes: list[str]
    # Byte lengths of consecutive runs of ``keys`` (summing to its length) that the
    # coordinator writes once when another piece has the same run.
    key_runs: list[int] = field(default_factory=list)

    def __reduce__(self) -> tuple[Any, ...]:
        # The columns as bytes: a small piece unpickles in about a third of the time
        # numpy's and a dataclass's own pickling take (4,096 ranks send 4,096 pieces).
        columns = [
            np.ascontiguousarray(self.entries, dtype=ENTRY_DTYPE).tobytes(),
            (self.dims.dtype.str, self.dims.tobytes()),
            (self.crcs.dtype.str, self.crcs.tobytes()),
        ]
        return _piece, (
            self.files,
            self.file_sizes,
            *columns,
            self.keys,
            self.dtypes,
            self.key_runs,
        )


def _piece(
    files: list[str],
    file_sizes: list[int],
    entries: bytes,
    dims: tuple[str, bytes],
    crcs: tuple[str, bytes],
    keys: bytes,
    dtypes: list[str],
    key_runs: list[int],
) -> IndexPiece:
    """A piece from its pickled fields (:meth:`IndexPiece.__reduce__`); its columns are
    read-only views of the pickle's bytes."""
    return IndexPiece(
        files,
        file_sizes,
        np.frombuffer(entries, ENTRY_DTYPE),
        np.frombuffer(dims[1], np.dtype(dims[0])),
        np.frombuffer(crcs[1], np.dtype(crcs[0])),
        keys,
        dtypes,
        key_runs,
    )


def merge_pieces(pieces: list[IndexPiece], alignment: int, block_bytes: int) -> RawIndex:
    """The index of a save: every rank's piece, positions shifted into one index
    (:func:`merged_encoding` without the file's bytes)."""
    return merged_encoding(pieces, alignment, block_bytes)[0]


def merged_encoding(
    pieces: list[IndexPiece], alignment: int, block_bytes: int
) -> tuple[RawIndex, bytearray]:
    """The index of a save and the bytes of its file, the index's sections being views
    into those bytes: each piece's columns are copied once, straight to where the file
    has them, and shifted there (a large index is hundreds of MiB: no concatenated
    copy, no joined copy). A run of key bytes (:attr:`IndexPiece.key_runs`) that another
    piece has too is written once and the entries point at that copy (a load then
    decodes each key a few times, not once per rank: see :mod:`.request_rows`)."""
    dtypes: list[str] = []
    for p in pieces:
        dtypes += [d for d in p.dtypes if d not in dtypes]
    counts = [len(p.entries) for p in pieces]
    local_starts = [p.entries["key_start"].astype(np.int64) for p in pieces]
    joined = np.concatenate(local_starts) if pieces else np.zeros(0, dtype=np.int64)
    keys, key_starts = _shared_keys(pieces, counts, joined)
    files = [f for p in pieces for f in p.files]
    n, nd, nc = sum(counts), sum(len(p.dims) for p in pieces), sum(len(p.crcs) for p in pieces)
    head = encode_header(alignment, block_bytes, dtypes, files, (n, nd, nc, len(keys)))
    data = bytearray(len(head) + n * ENTRY_DTYPE.itemsize + nd * 8 + nc * 4 + len(keys))
    data[: len(head)] = head
    at = len(head)
    sections: list[Any] = []
    for dtype, count, parts in (
        (ENTRY_DTYPE, n, [p.entries for p in pieces]),
        (np.dtype("<i8"), nd, [p.dims for p in pieces]),
        (np.dtype("<u4"), nc, [p.crcs for p in pieces]),
    ):
        view = np.frombuffer(data, dtype, count, at)
        if count:
            np.concatenate([np.asarray(x, dtype=dtype) for x in parts], out=view)
        sections.append(view)
        at += count * dtype.itemsize
    data[at:] = keys
    entries, dims, crcs = sections
    if n:

        def per_entry(values: list[int]) -> np.ndarray:
            return np.repeat(np.array(values, dtype=np.int64), counts)

        remaps = [[dtypes.index(d) for d in p.dtypes] or [0] for p in pieces]
        table = np.array([i for r in remaps for i in r], dtype=np.uint8)
        entries["dtype"] = table[entries["dtype"] + per_entry(_before([len(r) for r in remaps]))]
        entries["file"] += per_entry(_before([len(p.files) for p in pieces])).astype(np.uint32)
        entries["dims_start"] += per_entry(_before([len(p.dims) for p in pieces])).astype(np.uint64)
        entries["crc_start"] += per_entry(_before([len(p.crcs) for p in pieces])).astype(np.uint64)
        entries["key_start"] = key_starts
    index = RawIndex(alignment, block_bytes, dtypes, files, entries, dims, crcs, keys)
    return index, data


def _before(sizes: list[int]) -> list[int]:
    """Where each of consecutive sections of ``sizes`` starts."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


def _shared_keys(
    pieces: list[IndexPiece], counts: list[int], starts: np.ndarray
) -> tuple[bytes, np.ndarray]:
    """The merged key section, each run written once, and the entries' key starts in it
    (``starts``: within their own piece's keys)."""
    parts: list[bytes] = []
    size = 0
    seen: dict[tuple[int, bytes, bytes], list[tuple[bytes, int]]] = {}
    # Every piece's runs as if the pieces' keys were laid end to end ("virtual"): where
    # each run ends there, and how far its bytes move to where they are written.
    run_ends: list[int] = []
    shifts: list[int] = []
    virtual = 0
    for p in pieces:
        at = 0
        for run in p.key_runs or [len(p.keys)]:
            blob = p.keys[at : at + run]
            same = seen.setdefault((run, blob[:64], blob[-64:]), [])
            where = next((w for b, w in same if b == blob), None)
            if where is None:
                where = size
                same.append((blob, where))
                parts.append(blob)
                size += run
            run_ends.append(virtual + at + run)
            shifts.append(where - virtual - at)
            at += run
        virtual += len(p.keys)
    out = np.zeros(len(starts), dtype=np.int64)  # an empty key past the last run: 0
    if len(starts) and run_ends:
        sizes = np.array([len(p.keys) for p in pieces], dtype=np.int64)
        base = np.repeat(np.cumsum(sizes) - sizes, counts)
        inside = starts < np.repeat(sizes, counts)
        spots = starts[inside] + base[inside]
        runs = np.searchsorted(np.array(run_ends, dtype=np.int64), spots, side="right")
        out[inside] = spots + np.array(shifts, dtype=np.int64)[runs]
    return b"".join(parts), out


__all__ = ["IndexPiece", "merge_pieces", "merged_encoding"]
