"""Parsing a tensor item: :func:`parse_tensor_item`.

It locates the tensor bytes of a ``torch.save`` archive and reads its dtype, shape
and storage offset with a restricted unpickler, so a reader can copy exactly the
bytes it needs. An archive laid out exactly like ``torch.save``'s is recognized by
comparing it with the template (:mod:`.item_template`); others are parsed through
their zip directory. It raises :class:`NotFastPath` for anything unexpected; the
caller then falls back to ``torch.load``.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import pickletools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..._torch_compat import legacy_storage_name
from ...errors import CorruptCheckpointError
from ..safety.bounded import short_repr
from ..safety.pickle_scan import check_pickle
from .item_template import (
    _ARCHIVE,
    _LOCAL,
    NotFastPath,
    ReadAt,
    _central_directory,
    _data_start,
    _itemsize,
    _record_name_hash,
    _Template,
    _template,
)


@dataclass(frozen=True)
class TensorRecord:
    """Where a tensor's bytes are inside a ``torch.save`` item, and what they hold."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    storage_offset: int  # in elements; the stored tensor is contiguous from there
    data_offset: int  # byte offset of the storage bytes inside the item
    data_length: int  # bytes of the storage record
    # With ``defer_tail``: whether the item's last bytes match the layout assumed
    # (call after reading the data; False: read the item another way).
    tail_check: Callable[[], bool] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype | None  # None: untyped storage (numel counts bytes)
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorSpec:
    storage: _StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class _TypedStorageClass:
    """A legacy typed storage class named by data.pkl (sealed, as :class:`_Sealed`)."""

    __slots__ = ("dtype",)
    dtype: torch.dtype

    def __init__(self, dtype: torch.dtype) -> None:
        object.__setattr__(self, "dtype", dtype)

    def __setattr__(self, name: str, value: Any) -> None:
        raise NotFastPath("data.pkl sets an attribute of a storage class")

    def __setstate__(self, state: Any) -> None:
        raise NotFastPath("data.pkl sets the state of a storage class")


_UNTYPED = object()


@functools.cache
def _legacy_storage_dtypes() -> dict[str, torch.dtype]:
    names = {}
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            name = legacy_storage_name(value)
            if name is not None:
                names[name] = value
    return names


def _spec_v2(
    storage: Any,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    backward_hooks: Any,
    metadata: Any = None,
) -> _TensorSpec:
    if metadata or storage.dtype is None:
        raise NotFastPath("tensor metadata or untyped storage with _rebuild_tensor_v2")
    return _TensorSpec(storage, storage_offset, tuple(size), tuple(stride), storage.dtype)


def _spec_v3(
    storage: Any,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    backward_hooks: Any,
    dtype: torch.dtype,
    metadata: Any = None,
) -> _TensorSpec:
    if metadata or storage.dtype is not None or not isinstance(dtype, torch.dtype):
        raise NotFastPath("tensor metadata or typed storage with _rebuild_tensor_v3")
    return _TensorSpec(storage, storage_offset, tuple(size), tuple(stride), dtype)


class _Sealed:
    """A callable handed to the unpickler: no ``__dict__``, no settable attribute.

    A BUILD opcode on what ``find_class`` returned must not change this module's
    functions for the rest of the process (``_spec_v2.__defaults__ = ...``).
    """

    __slots__ = ("_fn",)
    _fn: Callable[..., Any]

    def __init__(self, fn: Callable[..., Any]) -> None:
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def __setattr__(self, name: str, value: Any) -> None:
        raise NotFastPath(f"data.pkl sets attribute {short_repr(name)} of a global")

    def __setstate__(self, state: Any) -> None:
        raise NotFastPath("data.pkl sets the state of a global")


_SPEC_V2 = _Sealed(_spec_v2)
_SPEC_V3 = _Sealed(_spec_v3)


class _TensorPickleReader(pickle.Unpickler):
    """Reads ``data.pkl`` of a one-tensor archive into a _TensorSpec; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _SPEC_V2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _SPEC_V3
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch.storage" and name == "UntypedStorage":
            return _UNTYPED
        if module == "torch":
            dtype = _legacy_storage_dtypes().get(name)
            if dtype is not None:
                return _TypedStorageClass(dtype)
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise NotFastPath(f"unexpected global {module}.{name} in data.pkl")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise NotFastPath(f"unexpected persistent id {short_repr(pid)}")
        _, storage_type, key, _location, numel = pid
        if storage_type is _UNTYPED:
            return _StorageRef(None, str(key), int(numel))
        if isinstance(storage_type, _TypedStorageClass):
            return _StorageRef(storage_type.dtype, str(key), int(numel))
        raise NotFastPath(f"unexpected storage type {short_repr(storage_type)}")


@functools.lru_cache(maxsize=4096)
def _tensor_spec(pickled: bytes) -> _TensorSpec:
    """The tensor described by ``data.pkl`` (cached: same-shaped tensors share it)."""
    try:
        check_pickle(pickled, "data.pkl")
    except CorruptCheckpointError as exc:
        raise NotFastPath(str(exc)) from None
    _check_opcodes(pickled)
    try:
        spec = _TensorPickleReader(io.BytesIO(pickled)).load()
    except NotFastPath:
        raise
    except Exception as exc:
        raise NotFastPath(f"data.pkl not readable: {exc}") from exc
    if not isinstance(spec, _TensorSpec):
        raise NotFastPath(f"data.pkl holds {type(spec).__name__}, not one tensor")
    if not _is_contiguous(spec.shape, spec.stride):
        raise NotFastPath(f"non-contiguous stored tensor (stride {spec.stride})")
    return spec


# Out-of-band buffer opcodes (protocol 5): never in torch.save's data.pkl, and a damaged
# length on one makes CPython's unpickler report "deallocated bytearray object has
# exported buffers" on stderr before it fails.
_BUFFER_OPCODES = frozenset({"BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER"})


def _check_opcodes(pickled: bytes) -> None:
    """Raise NotFastPath unless ``pickled`` is a well-formed run of opcodes, none of
    them :data:`_BUFFER_OPCODES` (checked before the C unpickler sees it)."""
    try:
        names = {op.name for op, _, _ in pickletools.genops(pickled)}
    except Exception as exc:  # noqa: BLE001 - any malformed opcode or argument
        raise NotFastPath(f"data.pkl malformed: {exc}") from None
    if names & _BUFFER_OPCODES:
        raise NotFastPath(f"data.pkl uses {sorted(names & _BUFFER_OPCODES)}")


_NATIVE_ORDER = sys.byteorder.encode()


def parse_tensor_item(read_at: ReadAt, length: int, defer_tail: bool = False) -> TensorRecord:
    """Locate and describe the tensor of a ``torch.save`` item of ``length`` bytes.

    ``read_at(offset, n)`` returns ``n`` bytes of the item starting at ``offset``
    (and raises on a short read). Raises :class:`NotFastPath` for anything unexpected.

    With ``defer_tail`` (a stream that reads best in offset order), an item whose
    first bytes match ``torch.save``'s layout is described before its last bytes (the
    zip directory) are read: the caller reads the data, then calls
    ``record.tail_check()``, and reads the item another way if that says False.
    """
    record = _match_template(read_at, length, defer_tail)
    return record if record is not None else _parse_zip(read_at, length)


def _storage_bytes(spec: _TensorSpec) -> int:
    return spec.storage.numel * (_itemsize(spec.dtype) if spec.storage.dtype is not None else 1)


def _make_record(spec: _TensorSpec, data_offset: int, data_length: int) -> TensorRecord:
    numel = 1
    for s in spec.shape:
        numel *= s
    if (
        _storage_bytes(spec) != data_length
        or (spec.storage_offset + numel) * _itemsize(spec.dtype) > data_length
    ):
        raise NotFastPath("storage size does not match the tensor")
    return TensorRecord(spec.dtype, spec.shape, spec.storage_offset, data_offset, data_length)


_PKL_NAME = (_ARCHIVE + "data.pkl").encode()


_HEAD_BYTES = 4096
_PKL_PROBE_BYTES = 512


@dataclass(frozen=True)
class KnownLayout:
    """An archive layout recognized before: its bytes before the tensor data (every
    record up to data/0's header, ``data.pkl`` included), the constant stretches of its
    tail, and the record it describes. An item of the same length whose first bytes are
    this ``head`` holds the same ``data.pkl``, so it is described by the same record."""

    head: bytes
    tail_length: int
    tail_segments: tuple[tuple[int, int, bytes], ...]  # (start, stop, bytes) in the tail
    record: TensorRecord

    def tail_matches(self, tail: bytes) -> bool:
        """Whether ``tail`` (the item's last ``tail_length`` bytes) is this layout's,
        whatever its crcs and serialization id."""
        for start, stop, constant in self.tail_segments:  # noqa: SIM110 - per item: no generator
            if tail[start:stop] != constant:
                return False
        return True


# Layouts recognized so far, by item length (a few per length at most: same-sized
# tensors of another shape or dtype). Bounded: cleared when it grows past _KNOWN_MAX.
_KNOWN: dict[int, list[KnownLayout]] = {}
_KNOWN_MAX = 4096


def _known_layout(template: _Template, record: TensorRecord) -> KnownLayout:
    """The layout of ``template``'s archives: its tail without the fields that depend
    on the tensor bytes (their crcs and the serialization id derived from them)."""
    variable = sorted(
        [(template.sid_at, 40)] + [(at, 4) for at in (*template.data_crc_at, *template.sid_crc_at)]
    )
    tail = template.tail_bytes
    segments = []
    pos = 0
    for at, n in variable:
        if at > pos:
            segments.append((pos, at, tail[pos:at]))
        pos = max(pos, at + n)
    if pos < len(tail):
        segments.append((pos, len(tail), tail[pos:]))
    return KnownLayout(template.head, len(tail), tuple(segments), record)


def known_layouts(length: int) -> list[KnownLayout]:
    """The layouts recognized so far in items of ``length`` bytes (a few at most)."""
    return _KNOWN.get(length, [])


def _remember(length: int, layout: KnownLayout) -> None:
    if sum(len(v) for v in _KNOWN.values()) >= _KNOWN_MAX:
        _KNOWN.clear()
    _KNOWN.setdefault(length, []).append(layout)


def _with_tail(
    layout: KnownLayout, read_at: ReadAt, length: int, defer_tail: bool
) -> TensorRecord | None:
    """``layout``'s record once the item's tail matches (checked now, or by the caller
    through ``tail_check`` with ``defer_tail``); None if it does not."""
    n = layout.tail_length

    def tail_matches() -> bool:
        return layout.tail_matches(bytes(read_at(length - n, n)))

    if defer_tail:
        return replace(layout.record, tail_check=tail_matches)
    return layout.record if tail_matches() else None


def _match_template(read_at: ReadAt, length: int, defer_tail: bool = False) -> TensorRecord | None:
    """The record of an item laid out exactly as ``torch.save`` lays out its ``data.pkl``
    (the common case: any bytes except the tensor data, crcs and id would differ), or
    None. Much cheaper than walking the zip directory; an item of a layout seen before
    (same length, same bytes before the tensor data) costs two comparisons."""
    if _NATIVE_ORDER != b"little":  # the template says "little"
        return None
    head = read_at(0, min(length, _HEAD_BYTES))
    for known in known_layouts(length):
        if bytes(head[: len(known.head)]) == known.head:
            return _with_tail(known, read_at, length, defer_tail)
    if len(head) < _LOCAL.size + len(_PKL_NAME) or bytes(head[30:46]) != _PKL_NAME:
        return None
    start = _LOCAL.size + len(_PKL_NAME) + _LOCAL.unpack_from(head)[10]
    # data.pkl of one tensor is short: look for its end in the first bytes, then further.
    end = bytes(head[start : start + _PKL_PROBE_BYTES]).find(b"PK\x07\x08")
    if end < 0:
        end = bytes(head[start:]).find(b"PK\x07\x08")
    if end <= 0 or _record_name_hash() is None:
        return None
    pickled = bytes(head[start : start + end])
    try:
        spec = _tensor_spec(pickled)
    except NotFastPath:
        return None
    if spec.storage.key != "0":
        return None
    nbytes = _storage_bytes(spec)
    template = _template(pickled, nbytes)
    if (
        length != len(template.head) + nbytes + len(template.tail_bytes)
        or bytes(head[: len(template.head)]) != template.head
    ):
        return None
    layout = _known_layout(template, _make_record(spec, len(template.head), nbytes))
    _remember(length, layout)
    return _with_tail(layout, read_at, length, defer_tail)


def _parse_zip(read_at: ReadAt, length: int) -> TensorRecord:
    """Walk the zip directory: handles any layout of a one-tensor archive."""
    records = _central_directory(read_at, length)
    pkl_name = next((n for n in records if n.endswith(b"/data.pkl")), None)
    if pkl_name is None:
        raise NotFastPath("no data.pkl record")
    prefix = pkl_name[: -len(b"data.pkl")]
    pkl = records[pkl_name]
    pkl_start = _data_start(read_at, pkl, length)
    spec = _tensor_spec(bytes(read_at(pkl_start, pkl[3])))
    byteorder = records.get(prefix + b"byteorder")
    if byteorder is not None:
        order = bytes(read_at(_data_start(read_at, byteorder, length), byteorder[3]))
        if order != _NATIVE_ORDER:
            raise NotFastPath(f"byte order {short_repr(order)}")
    data = records.get(prefix + b"data/" + spec.storage.key.encode())
    if data is None:
        raise NotFastPath(f"storage record data/{spec.storage.key} missing")
    return _make_record(spec, _data_start(read_at, data, length), data[3])


def _is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    if len(shape) != len(stride):
        return False
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size == 0:
            return True
        if size != 1 and st != expected:
            return False
        expected *= size
    return True
