"""The index of a ``raw_bytes`` checkpoint (``.raw_index``): what is stored where.

One file, written by the save's coordinator, describing every stored chunk of
every rank: a small JSON header and four binary sections read with
``numpy.frombuffer`` (no pickle, no Python object per entry until a load asks
for a key). The byte layout is documented in ``docs/format.rst``; in short::

    magic      8 bytes  b"DCPRAWIX"
    header_len 4 bytes  little-endian uint32
    header     header_len bytes of UTF-8 JSON (format, version, alignment,
               block_bytes, dtypes, files, counts)
    padding    to a multiple of 8 bytes
    entries    counts.entries x 72-byte records (ENTRY_DTYPE)
    dims       counts.dims int64 (per entry: global shape, chunk offsets, chunk sizes)
    crcs       counts.crcs uint32 (CRC32C per checksum block of each entry)
    keys       counts.key_bytes UTF-8 bytes (the entries' keys, concatenated)

Parsing is bounded: the header is capped and must fit the file, and the
sections' sizes, computed from the header's counts, must add up to the file's
size exactly before any array is built; every field is then checked with a few
vectorized comparisons (indices inside their sections, lengths that match the
chunk's shape and dtype, aligned offsets) and every file name goes through
:func:`..storage.names.safe_name`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np
import torch

from ...errors import CorruptCheckpointError
from ..storage.item_checksums import ItemChecksum
from ..storage.names import safe_name

INDEX_NAME = ".raw_index"
DATA_SUFFIX = ".dcpraw"
MAGIC = b"DCPRAWIX"
FORMAT = "dist_checkpointing.raw_bytes.index"
VERSION = 1
MAX_HEADER_BYTES = 64 << 20
MAX_NDIM = 64
_LIMIT = 1 << 62  # offsets, lengths and sizes above this are refused

KIND_GRID = 0  # a block of a regular grid (or any box) of a global tensor
KIND_FLAT = 1  # a flat range [flat_start, flat_stop) of a block's C-order flattening
KIND_OBJECT = 2  # the torch.save payload of a ShardedObject (key: its unique key)

ENTRY_DTYPE = np.dtype(
    [
        ("key_start", "<u8"),
        ("key_len", "<u4"),
        ("kind", "u1"),
        ("dtype", "u1"),
        ("ndim", "u1"),
        ("reserved", "u1"),
        ("file", "<u4"),
        ("crc_count", "<u4"),
        ("offset", "<u8"),
        ("length", "<u8"),
        ("dims_start", "<u8"),
        ("flat_start", "<u8"),
        ("flat_stop", "<u8"),
        ("crc_start", "<u8"),
    ]
)
assert ENTRY_DTYPE.itemsize == 72

# Stored dtype names (torch's, without "torch."). A name not listed here is refused.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "complex64",
        "complex128",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    )
    if hasattr(torch, name)
}
DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}
ITEMSIZE: dict[torch.dtype, int] = {
    d: torch.empty((), dtype=d).element_size() for d in DTYPES.values()
}


def is_raw_bytes_file(name: str) -> bool:
    """Whether ``name`` is a file of the raw_bytes layout (its index or a data file)."""
    return name == INDEX_NAME or name.endswith(DATA_SUFFIX)


def dtype_name(dtype: torch.dtype) -> str:
    """The stored name of ``dtype`` (``ValueError`` if the layout cannot store it)."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"the raw_bytes layout cannot store dtype {dtype}") from None


@dataclass
class RawIndex:
    """A parsed (or assembled) index: header values and the four sections."""

    alignment: int
    block_bytes: int  # 0: saved without checksums
    dtypes: list[str]
    files: list[str]
    entries: np.ndarray
    dims: np.ndarray
    crcs: np.ndarray
    keys: bytes
    extra: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ encoding

    def to_bytes(self) -> bytes:
        head = encode_header(
            self.alignment,
            self.block_bytes,
            self.dtypes,
            self.files,
            (len(self.entries), len(self.dims), len(self.crcs), len(self.keys)),
        )
        sections = (
            self.entries.astype(ENTRY_DTYPE, copy=False),
            self.dims.astype("<i8", copy=False),
            self.crcs.astype("<u4", copy=False),
        )  # joined as they are (one copy): a large index is hundreds of MiB
        views: list[Any] = [np.ascontiguousarray(a).view(np.uint8) for a in sections]
        return b"".join((head, *views, self.keys))

    def without_rows(self, drop: np.ndarray) -> tuple[RawIndex, list[str]]:
        """This index without the entries where ``drop`` is True, and the names of
        the data files no kept entry uses (the other sections stay as they are)."""
        kept = self.entries[~drop]
        used = np.unique(kept["file"]) if len(kept) else np.zeros(0, dtype=np.uint32)
        remap = np.zeros(max(len(self.files), 1), dtype=np.uint32)
        remap[used] = np.arange(len(used), dtype=np.uint32)
        kept = kept.copy()
        kept["file"] = remap[kept["file"]]
        files = [self.files[i] for i in used.tolist()]
        unused = sorted(set(self.files) - set(files))
        index = RawIndex(
            self.alignment,
            self.block_bytes,
            self.dtypes,
            files,
            kept,
            self.dims,
            self.crcs,
            self.keys,
        )
        return index, unused

    # ------------------------------------------------------------------ views

    @cached_property
    def key_list(self) -> list[str]:
        """The key of every entry (decoded once)."""
        starts = self.entries["key_start"].tolist()
        lens = self.entries["key_len"].tolist()
        text = self.keys.decode("utf-8")
        if len(text) != len(self.keys):  # non-ASCII keys: byte offsets differ from chars
            return [self.keys[s : s + n].decode("utf-8") for s, n in zip(starts, lens)]
        return [text[s : s + n] for s, n in zip(starts, lens)]

    @cached_property
    def rows_by_key(self) -> dict[str, list[int]]:
        """Entry rows of each key, in index order."""
        out: dict[str, list[int]] = {}
        for row, key in enumerate(self.key_list):
            rows = out.get(key)
            if rows is None:
                out[key] = [row]
            else:
                rows.append(row)
        return out

    @cached_property
    def columns(self) -> dict[str, list[int]]:
        """Every entry field as a Python list (one conversion, then cheap per-entry reads)."""
        return {name: self.entries[name].tolist() for name in ENTRY_DTYPE.names or ()}

    @cached_property
    def dims_list(self) -> list[int]:
        return self.dims.tolist()  # type: ignore[no-any-return]

    def box(self, row: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(global_shape, chunk_offsets, chunk_sizes)`` of entry ``row``."""
        c = self.columns
        n, s = c["ndim"][row], c["dims_start"][row]
        d = self.dims_list
        return tuple(d[s : s + n]), tuple(d[s + n : s + 2 * n]), tuple(d[s + 2 * n : s + 3 * n])

    def dtype_of(self, row: int) -> torch.dtype:
        return DTYPES[self.dtypes[self.columns["dtype"][row]]]

    def crcs_of(self, row: int) -> list[int]:
        c = self.columns
        start = c["crc_start"][row]
        return self.crcs[start : start + c["crc_count"][row]].tolist()  # type: ignore[no-any-return]


def encode_header(
    alignment: int,
    block_bytes: int,
    dtypes: list[str],
    files: list[str],
    counts: tuple[int, int, int, int],
) -> bytes:
    """The bytes of an index before its sections (magic, header length, JSON header,
    padding to 8 bytes); ``counts``: entries, dims, CRCs and key bytes."""
    header = {
        "format": FORMAT,
        "version": VERSION,
        "byte_order": "little",
        "alignment": alignment,
        "block_bytes": block_bytes,
        "dtypes": dtypes,
        "files": files,
        "counts": dict(zip(("entries", "dims", "crcs", "key_bytes"), counts)),
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    head = MAGIC + len(text).to_bytes(4, "little") + text
    return head + b"\0" * (-len(head) % 8)


# --------------------------------------------------------------------------- parsing


def _corrupt(source: str, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: malformed raw_bytes index: {problem}")


def _header(data: bytes, source: str) -> tuple[dict[str, Any], int]:
    if len(data) < 12 or data[:8] != MAGIC:
        raise _corrupt(source, "it does not start with the raw_bytes index magic")
    header_len = int.from_bytes(data[8:12], "little")
    if header_len > min(MAX_HEADER_BYTES, len(data) - 12):
        raise _corrupt(source, f"header of {header_len} bytes in a {len(data)}-byte file")
    try:
        header = json.loads(data[12 : 12 + header_len])
    except (ValueError, RecursionError) as exc:
        raise _corrupt(source, f"header is not JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _corrupt(source, "not a raw_bytes index header")
    if header.get("version") != VERSION or type(header.get("version")) is not int:
        raise _corrupt(source, f"unsupported version {header.get('version')!r:.20}")
    start = 12 + header_len
    return header, start + (-start % 8)


def _count(value: Any, what: str, source: str, limit: int) -> int:
    if type(value) is not int or not 0 <= value <= limit:
        raise _corrupt(source, f"{what} must be an integer in [0, {limit}], got {value!r:.40}")
    return value


def parse_index(data: bytes, source: str) -> RawIndex:
    """Parse and check an index read from ``source`` (for messages).

    Raises:
        CorruptCheckpointError: anything malformed, inconsistent or out of bounds.
        UnsafeCheckpointError: a file name that leaves the checkpoint directory.
    """
    header, pos = _header(data, source)
    counts = header.get("counts")
    if not isinstance(counts, dict):
        raise _corrupt(source, "counts missing")
    size = len(data)
    n = _count(counts.get("entries"), "entries", source, size // ENTRY_DTYPE.itemsize)
    nd = _count(counts.get("dims"), "dims", source, size // 8)
    nc = _count(counts.get("crcs"), "crcs", source, size // 4)
    nk = _count(counts.get("key_bytes"), "key_bytes", source, size)
    expected = pos + n * ENTRY_DTYPE.itemsize + nd * 8 + nc * 4 + nk
    if expected != size:  # checked before any array is built
        raise _corrupt(source, f"sections need {expected} bytes, the file has {size}")
    if header.get("byte_order") != "little":
        raise _corrupt(source, "byte_order must be 'little'")
    dtypes, files = header.get("dtypes"), header.get("files")
    if not isinstance(dtypes, list) or not all(isinstance(d, str) and d in DTYPES for d in dtypes):
        raise _corrupt(source, f"unknown dtype in {str(dtypes)[:200]}")
    if not isinstance(files, list) or len(files) > max(n, 1):
        raise _corrupt(source, "files must be a list (at most one per entry)")
    files = [safe_name(f, source=source) for f in files]
    index = RawIndex(
        alignment=_count(header.get("alignment"), "alignment", source, 1 << 30) or 1,
        block_bytes=_count(header.get("block_bytes"), "block_bytes", source, 1 << 40),
        dtypes=list(dtypes),
        files=files,
        entries=np.frombuffer(data, ENTRY_DTYPE, n, pos),
        dims=np.frombuffer(data, "<i8", nd, pos + n * ENTRY_DTYPE.itemsize),
        crcs=np.frombuffer(data, "<u4", nc, pos + n * ENTRY_DTYPE.itemsize + nd * 8),
        keys=data[size - nk :],
    )
    try:
        index.keys.decode("utf-8")
    except UnicodeDecodeError:
        raise _corrupt(source, "keys are not UTF-8") from None
    problem = entries_problem(index)
    if problem is not None:
        raise _corrupt(source, problem)
    return index


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


# Entries checked per pass: bounds the checks' temporary arrays (a few bytes per entry
# each) whatever the size of the index.
_CHECK_ROWS = 1 << 20


def entries_problem(index: RawIndex) -> str | None:
    """The first inconsistency of the index's entries as text (None if there is none)."""
    found = _in_passes(index, _fields_problem)
    if found is None and len(index.dims) and ((index.dims < 0) | (index.dims >= _LIMIT)).any():
        return "negative or huge shape, offset or size"
    if found is None:
        found = _in_passes(index, lambda part: _length_problem(part) or _crc_count_problem(part))
    return None if found is None else f"entry {found[0]}: {found[1]}"


# A problem of one entry: its row (within the entries checked) and what is wrong.
_Problem = tuple[int, str]


def _in_passes(index: RawIndex, check: Callable[[RawIndex], _Problem | None]) -> _Problem | None:
    """``check`` over :data:`_CHECK_ROWS` entries at a time; the row of the first problem
    counted in the whole index."""
    for lo in range(0, len(index.entries), _CHECK_ROWS):
        found = check(replace(index, entries=index.entries[lo : lo + _CHECK_ROWS]))
        if found is not None:
            return found[0] + lo, found[1]
    return None


def _fields_problem(index: RawIndex) -> _Problem | None:
    e = index.entries
    if not len(e):
        return None
    u8 = np.uint64
    checks = (
        (e["kind"] > KIND_OBJECT, "unknown kind"),
        (e["dtype"] >= max(len(index.dtypes), 1), "dtype index out of range"),
        (e["file"] >= len(index.files), "file index out of range"),
        (e["ndim"] > MAX_NDIM, f"more than {MAX_NDIM} axes"),
        (e["key_start"] > u8(len(index.keys)), "key outside the key section"),
        (
            e["key_len"] > u8(len(index.keys)) - np.minimum(e["key_start"], u8(len(index.keys))),
            "key outside the key section",
        ),
        (e["offset"] >= u8(_LIMIT), "offset out of range"),
        (e["length"] >= u8(_LIMIT), "length out of range"),
        (e["offset"] % u8(index.alignment) != 0, f"offset not aligned to {index.alignment}"),
        (e["dims_start"] > u8(len(index.dims)), "dims outside the dims section"),
        (e["crc_start"] > u8(len(index.crcs)), "checksums outside the checksum section"),
    )
    for mask, what in checks:
        if mask.any():
            return _first(mask), what
    ndim3 = e["ndim"].astype(np.uint64) * u8(3)
    for mask, what in (
        (e["dims_start"] + ndim3 > u8(len(index.dims)), "dims outside the dims section"),
        (e["crc_start"] + e["crc_count"] > u8(len(index.crcs)), "checksums outside the section"),
    ):
        if mask.any():
            return _first(mask), what
    return None


def _chunk_numel(index: RawIndex) -> np.ndarray:
    """Elements of each entry's chunk (float64: overflow shows as a huge value)."""
    e = index.entries
    ndim = e["ndim"].astype(np.int64)
    width = int(ndim.max()) if len(ndim) else 0
    sizes = np.ones((len(e), max(width, 1)), dtype=np.float64)
    if width:
        rows = np.repeat(np.arange(len(e)), ndim)
        cols = np.arange(len(rows)) - np.repeat(np.cumsum(ndim) - ndim, ndim)
        at = np.repeat(e["dims_start"].astype(np.int64) + 2 * ndim, ndim) + cols
        sizes[rows, cols] = index.dims[at]
    return np.prod(sizes, axis=1)  # type: ignore[no-any-return]


def _length_problem(index: RawIndex) -> _Problem | None:
    e = index.entries
    tensors = e["kind"] != KIND_OBJECT
    if not tensors.any():
        return None
    numel = _chunk_numel(index)
    itemsize = np.array([ITEMSIZE[DTYPES[d]] for d in index.dtypes] or [1], dtype=np.float64)[
        np.minimum(e["dtype"], max(len(index.dtypes), 1) - 1)
    ]
    flat = e["kind"] == KIND_FLAT
    bad_flat = flat & ((e["flat_start"] > e["flat_stop"]) | (e["flat_stop"] > numel))
    if bad_flat.any():
        return _first(bad_flat), "flat range outside its block"
    count = np.where(
        flat,
        (e["flat_stop"] - np.minimum(e["flat_start"], e["flat_stop"])).astype(np.float64),
        numel,
    )
    bad = tensors & (count * itemsize != e["length"].astype(np.float64))
    if bad.any():
        return _first(bad), "length does not match its shape and dtype"
    return None


def _crc_count_problem(index: RawIndex) -> _Problem | None:
    e = index.entries
    if index.block_bytes == 0:
        bad = e["crc_count"] != 0
    else:
        blocks = np.maximum(
            (e["length"] + np.uint64(index.block_bytes - 1)) // np.uint64(index.block_bytes),
            np.uint64(1),
        )
        bad = e["crc_count"] != blocks
    if bad.any():
        return _first(bad), "wrong number of checksums"
    return None


def raw_items_by_file(index: RawIndex) -> dict[str, list[ItemChecksum]]:
    """Each data file's items with their checksums (what ``verify`` checks)."""
    c = index.columns
    crcs = index.crcs.tolist()
    out: dict[str, list[ItemChecksum]] = {name: [] for name in index.files}
    for row in range(len(index.entries)):
        start = c["crc_start"][row]
        out[index.files[c["file"][row]]].append(
            ItemChecksum(
                c["offset"][row], c["length"][row], crcs[start : start + c["crc_count"][row]]
            )
        )
    return out


__all__ = [
    "DATA_SUFFIX",
    "DTYPES",
    "ENTRY_DTYPE",
    "INDEX_NAME",
    "KIND_FLAT",
    "KIND_GRID",
    "KIND_OBJECT",
    "RawIndex",
    "dtype_name",
    "encode_header",
    "is_raw_bytes_file",
    "parse_index",
    "raw_items_by_file",
]
