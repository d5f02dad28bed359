"""The ``torch.save`` zip of one tensor: a fast writer and a fast parser.

DCP stores every tensor item as a complete ``torch.save`` archive of the chunk.
``torch.save`` has a high fixed cost per call, so :func:`write_tensor` writes the same
archive itself, byte for byte: records ``data.pkl``, ``.format_version``,
``.storage_alignment``, ``byteorder``, ``data/0`` (64-byte aligned), ``version``,
``.data/serialization_id``, then the central directory and zip64 end records. The
layout for a given ``data.pkl`` is computed once (:class:`_Template`); per tensor only
the CRC-32 of its bytes (computed unless ``torch.serialization.set_crc32_options(False)``,
in a second thread when cores are spare) and the serialization id derived from it
change. On first use per dtype the output is compared with ``torch.save``'s; any
difference (another torch version, another storage alignment) disables the fast writer
for that dtype, and ``torch.save`` is used, as it is for tensors the fast writer does not
handle (subclasses, non-contiguous, views, archives of 4 GiB or more).

:func:`parse_tensor_item` locates the tensor bytes of such an archive and reads its
dtype, shape and storage offset with a restricted unpickler, so a reader can copy
exactly the bytes it needs. An archive laid out exactly like ``torch.save``'s is
recognized by comparing it with the template; others are parsed through their zip
directory. It raises :class:`NotFastPath` for anything unexpected; the caller then
falls back to ``torch.load``.

Note: ``torch.load`` does not verify these CRC-32 values; they exist for byte-identity
with ``torch.save`` and for external integrity checks.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import io
import logging
import os
import pickle
import struct
import sys
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ..._torch_compat import legacy_storage_name, rebuild_tensor_v2, rebuild_tensor_v3

logger = logging.getLogger(__name__)

_ARCHIVE = "archive/"
_ALIGNMENT = 64
_FLAGS = 0x0808  # data descriptor follows each record; UTF-8 names
_FLAGS_EMPTY = 0x0800
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
# Archives up to this size need no zip64 fields in local/central headers.
_MAX_FAST_BYTES = _U32 - (1 << 20)
# Large tensors are written in pieces of this size while another thread checksums
# them (from _PARALLEL_CRC_BYTES on, given spare cores) ...
_CHUNK_BYTES = 64 << 20
_PARALLEL_CRC_BYTES = 8 << 20
# ... or else checksummed and written piece by piece, each piece small enough to stay
# in the CPU cache between the two passes, and larger than the write buffer of
# fs_io.LocalFileSystem (so that it is not copied into that buffer).
_CACHE_CHUNK_BYTES = 1 << 20

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<IIII")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_EOCD = struct.Struct("<IHHHHIIH")
_SIG_LOCAL, _SIG_DESCRIPTOR, _SIG_CENTRAL = 0x04034B50, 0x08074B50, 0x02014B50
_SIG_ZIP64_EOCD, _SIG_ZIP64_LOCATOR, _SIG_EOCD = 0x06064B50, 0x07064B50, 0x06054B50

_BEFORE_DATA = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))
_VERSION = ("version", b"3\n")
_SERIALIZATION_ID = ".data/serialization_id"


@functools.cache
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------- writing


def write_tensor(stream: BinaryIO, tensor: torch.Tensor) -> int:
    """Write ``torch.save(tensor)`` to ``stream``; return the number of bytes written.

    ``tensor`` must be on the CPU. The bytes equal ``torch.save``'s output, also with
    ``torch.serialization.set_crc32_options(False)`` (then no checksums are computed).
    """
    compute_crc = torch.serialization.get_crc32_options()
    if not _fast_path_applies(tensor, compute_crc):
        start = stream.tell()
        torch.save(tensor, stream)
        return stream.tell() - start
    data = _byte_view(tensor)
    pickled = _tensor_pickle(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
    template = _template(pickled, len(data), compute_crc)
    stream.write(template.head)
    if not compute_crc:
        crc = 0
        stream.write(data)
    elif len(data) >= _PARALLEL_CRC_BYTES and _spare_cores():
        crc = _write_with_parallel_crc(stream, data)
    else:
        crc = 0
        for start in range(0, len(data), _CACHE_CHUNK_BYTES):
            # Checksum a piece, then write it while it is still in the CPU cache.
            piece = data[start : start + _CACHE_CHUNK_BYTES]
            crc = zlib.crc32(piece, crc)
            stream.write(piece)
    tail = template.tail(crc)
    stream.write(tail)
    return len(template.head) + len(data) + len(tail)


@functools.cache
def _spare_cores() -> bool:
    """Whether this process may use enough cores to checksum in a separate thread."""
    try:
        return len(os.sched_getaffinity(0)) >= 4
    except AttributeError:  # platforms without sched_getaffinity
        return (os.cpu_count() or 1) >= 4


def _write_with_parallel_crc(stream: BinaryIO, data: memoryview | bytes) -> int:
    """Write ``data`` in pieces while another thread computes its CRC-32 (both release
    the GIL), so the checksum costs no extra time when writing is the bottleneck."""
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(zlib.crc32(data)), daemon=True)
    worker.start()
    try:
        for start in range(0, len(data), _CHUNK_BYTES):
            stream.write(data[start : start + _CHUNK_BYTES])
    finally:
        worker.join()
    return result[0]


def serialize_tensor(tensor: torch.Tensor) -> bytes:
    """``torch.save(tensor)`` as bytes, through :func:`write_tensor`."""
    buf = io.BytesIO()
    write_tensor(buf, tensor)
    return buf.getvalue()


def _fast_path_applies(t: torch.Tensor, compute_crc: bool) -> bool:
    # Cheapest checks first: this runs once per item.
    if type(t) is not torch.Tensor or t.layout != torch.strided or not t.is_cpu:
        return False
    if t.requires_grad or t.storage_offset() or not t.is_contiguous():
        return False
    nbytes = t.nbytes
    return (
        nbytes <= _MAX_FAST_BYTES
        and t.untyped_storage().nbytes() == nbytes
        and not t.is_conj()
        and not t.is_neg()
        and fast_path_supported(t.dtype, compute_crc)
    )


# Below this size a tensor's bytes are copied out (cheaper than a numpy view).
_COPY_BELOW_BYTES = 64 << 10


def _byte_view(t: torch.Tensor) -> bytes | memoryview:
    """The bytes of a contiguous CPU tensor (a zero-copy view for large tensors)."""
    nbytes = t.nbytes
    if nbytes < _COPY_BELOW_BYTES:
        return ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b""
    return t.reshape(-1).view(torch.uint8).numpy().data


def _hash_combine(seed: int, value: int) -> int:
    # c10::hash_combine on a 64-bit size_t, as torch's zip writer uses it.
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _U64)) & _U64


def _flags(size: int) -> int:
    # An empty record gets no data descriptor (so its crc is not in the id hash either).
    return _FLAGS if size else _FLAGS_EMPTY


def _local_header(offset: int, name: bytes, size: int) -> bytes:
    start = offset + _LOCAL.size + len(name) + 4
    pad = -start % _ALIGNMENT
    extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    header = _LOCAL.pack(_SIG_LOCAL, 0, _flags(size), 0, 0, 0, 0, 0, 0, len(name), len(extra))
    return header + name + extra


def _descriptor(crc: int, size: int) -> bytes:
    return _DESCRIPTOR.pack(_SIG_DESCRIPTOR, crc, size, size) if size else b""


def _central(name: bytes, offset: int, crc: int, size: int) -> bytes:
    fields = (_SIG_CENTRAL, 0, 0, _flags(size), 0, 0, 0, crc, size, size, len(name))
    return _CENTRAL.pack(*fields, 0, 0, 0, 0, 0, offset) + name


def _record(offset: int, name: str, payload: bytes, compute_crc: bool) -> tuple[bytes, bytes, int]:
    """(local header + payload + descriptor, central entry, crc) of a small record."""
    full = (_ARCHIVE + name).encode()
    crc = zlib.crc32(payload) if compute_crc else 0
    local = _local_header(offset, full, len(payload)) + payload + _descriptor(crc, len(payload))
    return local, _central(full, offset, crc, len(payload)), crc


@dataclass(frozen=True)
class _Template:
    """The archive of a tensor with a given ``data.pkl`` and byte size. Only four crc
    fields and the serialization id depend on the tensor bytes: :meth:`tail` patches
    them into a precomputed tail."""

    head: bytes  # every record before the tensor bytes, and data/0's local header
    tail_bytes: bytes  # everything after the tensor bytes, with zero crcs and id
    nbytes: int
    seed: int  # id hash over the crcs of the records before data/0
    version_crc: int
    name_hash: bytes
    sid_at: int  # where the 40-digit serialization id sits in the tail
    sid_crc_at: tuple[int, int]  # its crc in its data descriptor and central entry
    data_crc_at: tuple[int, ...]  # the tensor bytes' crc in the descriptor and central entry
    compute_crc: bool  # False: every crc is 0 (torch.serialization.set_crc32_options)

    def tail(self, crc: int) -> bytes:
        combined = _hash_combine(self.seed, crc) if self.nbytes else self.seed
        combined = _hash_combine(combined, self.version_crc)
        sid = self.name_hash + b"%020d" % combined
        sid_crc = zlib.crc32(sid) if self.compute_crc else 0
        out = bytearray(self.tail_bytes)
        out[self.sid_at : self.sid_at + len(sid)] = sid
        for at in self.data_crc_at:
            _U32_FIELD.pack_into(out, at, crc)
        for at in self.sid_crc_at:
            _U32_FIELD.pack_into(out, at, sid_crc)
        return bytes(out)


_U32_FIELD = struct.Struct("<I")
_CENTRAL_CRC_AT = 16  # offset of the crc field in a central directory entry
_DESCRIPTOR_CRC_AT = 4


@functools.lru_cache(maxsize=4096)
def _template(pickled: bytes, nbytes: int, compute_crc: bool = True) -> _Template:
    name_hash = _record_name_hash()
    if name_hash is None:
        raise RuntimeError("the fast torch.save writer is disabled")  # see fast_path_supported
    head = bytearray()
    central = bytearray()
    seed = 0
    for name, payload in (("data.pkl", pickled), *_BEFORE_DATA):
        local, entry, crc = _record(len(head), name, payload, compute_crc)
        head += local
        central += entry
        seed = _hash_combine(seed, crc)
    data_name = (_ARCHIVE + "data/0").encode()
    data_header_offset = len(head)
    head += _local_header(data_header_offset, data_name, nbytes)
    tail_start = len(head) + nbytes  # tail offsets below are relative to this

    tail = bytearray(_descriptor(0, nbytes))
    data_crc_at = [_DESCRIPTOR_CRC_AT] if nbytes else []
    version_record, central_version, version_crc = _record(
        tail_start + len(tail), *_VERSION, compute_crc
    )
    tail += version_record
    sid_name = (_ARCHIVE + _SERIALIZATION_ID).encode()
    sid_offset = tail_start + len(tail)
    sid_len = 40
    tail += _local_header(sid_offset, sid_name, sid_len)
    sid_at = len(tail)
    tail += bytes(sid_len) + _descriptor(0, sid_len)
    sid_crc_at = [sid_at + sid_len + _DESCRIPTOR_CRC_AT]
    cd_start = len(tail)
    tail += central
    data_crc_at.append(len(tail) + _CENTRAL_CRC_AT)
    tail += _central(data_name, data_header_offset, 0, nbytes)
    tail += central_version
    sid_crc_at.append(len(tail) + _CENTRAL_CRC_AT)
    tail += _central(sid_name, sid_offset, 0, sid_len)
    cd_size = len(tail) - cd_start
    cd_offset = tail_start + cd_start
    n = len(_BEFORE_DATA) + 4  # data.pkl, the records before data/0, data/0, version, id
    tail += _ZIP64_EOCD.pack(_SIG_ZIP64_EOCD, 44, 0x031E, 0x2D, 0, 0, n, n, cd_size, cd_offset)
    tail += _ZIP64_LOCATOR.pack(_SIG_ZIP64_LOCATOR, 0, cd_offset + cd_size, 1)
    tail += _EOCD.pack(_SIG_EOCD, 0, 0, n, n, cd_size, cd_offset, 0)
    return _Template(
        head=bytes(head),
        tail_bytes=bytes(tail),
        nbytes=nbytes,
        seed=seed,
        version_crc=version_crc,
        name_hash=name_hash.encode(),
        sid_at=sid_at,
        sid_crc_at=(sid_crc_at[0], sid_crc_at[1]),
        data_crc_at=tuple(data_crc_at),
        compute_crc=compute_crc,
    )


class _StorageStub:
    """Stands for the tensor's storage in the pickle (see _StubPickler.persistent_id)."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _TensorStub:
    """Pickles exactly like a plain CPU tensor (the reduce value torch uses)."""

    __slots__ = ("reduce_value",)

    def __init__(self, reduce_value: tuple[Any, ...]) -> None:
        self.reduce_value = reduce_value

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduce_value


class _StubPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is _StorageStub else None


@functools.lru_cache(maxsize=4096)
def _tensor_pickle(dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...]) -> bytes:
    """``data.pkl`` of a contiguous tensor that owns its whole storage (storage key "0")."""
    numel = 1
    for s in shape:
        numel *= s
    storage_name = legacy_storage_name(dtype)
    args: tuple[Any, ...]
    reduce_value: tuple[Any, ...]
    if storage_name is None:  # untyped storage: numel counts bytes; dtype passed explicitly
        pid = ("storage", torch.UntypedStorage, "0", "cpu", numel * _itemsize(dtype))
        args = (_StorageStub(pid), 0, shape, stride, False, collections.OrderedDict(), dtype)
        reduce_value = (rebuild_tensor_v3, args)
    else:
        pid = ("storage", getattr(torch, storage_name), "0", "cpu", numel)
        args = (_StorageStub(pid), 0, shape, stride, False, collections.OrderedDict())
        reduce_value = (rebuild_tensor_v2, args)
    buf = io.BytesIO()
    _StubPickler(buf, protocol=2).dump(_TensorStub(reduce_value))
    return buf.getvalue()


@functools.lru_cache(maxsize=1)
def _record_name_hash() -> str | None:
    """First half of torch's serialization id: a hash of the record names, constant for
    one-tensor archives. Learned from torch.save (None if it cannot be read)."""
    try:
        buf = io.BytesIO()
        torch.save(torch.zeros(1), buf)
        data = buf.getvalue()

        def read_at(offset: int, n: int) -> bytes:
            return data[offset : offset + n]

        # Our own zip walk: zipfile would reject the zero crcs of set_crc32_options(False).
        record = _central_directory(read_at, len(data))[(_ARCHIVE + _SERIALIZATION_ID).encode()]
        start = _data_start(read_at, record, len(data))
        sid = data[start : start + record[3]].decode()
        return sid[:20] if len(sid) == 40 and sid.isdigit() else None
    except Exception as exc:  # noqa: BLE001 - the fast path is an optimization
        logger.warning("cannot learn torch.save's serialization id layout: %s", exc)
        return None


@functools.cache
def fast_path_supported(dtype: torch.dtype, compute_crc: bool = True) -> bool:
    """Whether the fast writer reproduces ``torch.save`` exactly for ``dtype`` (with
    torch's crc32 option set to ``compute_crc``, as it must be when this is called).

    Probed once per dtype, option and process (an empty and a 2x3 tensor), and cached.
    """
    if _record_name_hash() is None:
        return False
    try:
        for shape in ((2, 3), (0,)):
            numel = 1
            for s in shape:
                numel *= s
            raw = torch.arange(numel * _itemsize(dtype), dtype=torch.uint8)
            probe = raw.view(dtype).reshape(shape)
            expected = io.BytesIO()
            torch.save(probe, expected)
            data = _byte_view(probe)
            pickled = _tensor_pickle(dtype, shape, probe.stride())
            template = _template(pickled, len(data), compute_crc)
            crc = zlib.crc32(data) if compute_crc else 0
            ours = template.head + bytes(data) + template.tail(crc)
            if ours != expected.getvalue():
                logger.warning(
                    "fast torch.save writer disabled for %s: its output differs from "
                    "torch.save (torch %s); using torch.save",
                    dtype,
                    torch.__version__,
                )
                return False
    except Exception as exc:  # noqa: BLE001 - the fast path is an optimization
        logger.debug("fast torch.save writer disabled for %s: %s", dtype, exc)
        return False
    return True


# --------------------------------------------------------------------------- parsing


class NotFastPath(Exception):
    """The item is not a plain one-tensor archive this parser handles (use torch.load)."""


@dataclass(frozen=True)
class TensorRecord:
    """Where a tensor's bytes are inside a ``torch.save`` item, and what they hold."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    storage_offset: int  # in elements; the stored tensor is contiguous from there
    data_offset: int  # byte offset of the storage bytes inside the item
    data_length: int  # bytes of the storage record


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


@dataclass(frozen=True)
class _TypedStorageClass:
    dtype: torch.dtype


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


class _TensorPickleReader(pickle.Unpickler):
    """Reads ``data.pkl`` of a one-tensor archive into a _TensorSpec; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _spec_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _spec_v3
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
            raise NotFastPath(f"unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if storage_type is _UNTYPED:
            return _StorageRef(None, str(key), int(numel))
        if isinstance(storage_type, _TypedStorageClass):
            return _StorageRef(storage_type.dtype, str(key), int(numel))
        raise NotFastPath(f"unexpected storage type {storage_type!r}")


@functools.lru_cache(maxsize=4096)
def _tensor_spec(pickled: bytes) -> _TensorSpec:
    """The tensor described by ``data.pkl`` (cached: same-shaped tensors share it)."""
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


ReadAt = Callable[[int, int], bytes | memoryview]
_END_BYTES = _ZIP64_EOCD.size + _ZIP64_LOCATOR.size + _EOCD.size
_NATIVE_ORDER = sys.byteorder.encode()


def parse_tensor_item(read_at: ReadAt, length: int) -> TensorRecord:
    """Locate and describe the tensor of a ``torch.save`` item of ``length`` bytes.

    ``read_at(offset, n)`` returns ``n`` bytes of the item starting at ``offset``
    (and raises on a short read). Raises :class:`NotFastPath` for anything unexpected.
    """
    record = _match_template(read_at, length)
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


def _match_template(read_at: ReadAt, length: int) -> TensorRecord | None:
    """The record of an item laid out exactly as ``torch.save`` lays out its ``data.pkl``
    (the common case: any bytes except the tensor data, crcs and id would differ), or
    None. Much cheaper than walking the zip directory."""
    if _NATIVE_ORDER != b"little":  # the template says "little"
        return None
    head = read_at(0, min(length, _HEAD_BYTES))
    if len(head) < _LOCAL.size + len(_PKL_NAME) or bytes(head[30:46]) != _PKL_NAME:
        return None
    start = _LOCAL.size + len(_PKL_NAME) + _LOCAL.unpack_from(head)[10]
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
    tail_len = len(template.tail_bytes)
    if (
        length != len(template.head) + nbytes + tail_len
        or bytes(head[: len(template.head)]) != template.head
    ):
        return None
    tail = bytearray(read_at(length - tail_len, tail_len))
    tail[template.sid_at : template.sid_at + 40] = bytes(40)
    for at in (*template.data_crc_at, *template.sid_crc_at):
        tail[at : at + 4] = bytes(4)
    if tail != template.tail_bytes:
        return None
    return _make_record(spec, len(template.head), nbytes)


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
            raise NotFastPath(f"byte order {order!r}")
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


# A record: (local header offset, compression method, compressed size, size).
_Rec = tuple[int, int, int, int]


def _central_directory(read_at: ReadAt, length: int) -> dict[bytes, _Rec]:
    if length < _EOCD.size:
        raise NotFastPath("item too short for a zip archive")
    end_len = min(length, _END_BYTES)
    end = read_at(length - end_len, end_len)
    sig, _, _, _, count, cd_size, cd_offset, comment = _EOCD.unpack_from(end, end_len - _EOCD.size)
    if sig != _SIG_EOCD or comment != 0:
        raise NotFastPath("no end-of-central-directory record at the end of the item")
    if end_len == _END_BYTES:
        loc = _ZIP64_LOCATOR.unpack_from(end, _ZIP64_EOCD.size)
        if loc[0] == _SIG_ZIP64_LOCATOR:
            at = loc[2]
            if at + _ZIP64_EOCD.size > length - _EOCD.size - _ZIP64_LOCATOR.size:
                raise NotFastPath("zip64 end record out of range")
            z = _ZIP64_EOCD.unpack(read_at(at, _ZIP64_EOCD.size))
            if z[0] != _SIG_ZIP64_EOCD:
                raise NotFastPath("bad zip64 end record")
            count, cd_size, cd_offset = z[7], z[8], z[9]
    if cd_offset + cd_size > length or count > 64:
        raise NotFastPath("central directory out of range")
    cd = read_at(cd_offset, cd_size)
    records: dict[bytes, _Rec] = {}
    pos = 0
    unpack = _CENTRAL.unpack_from
    for _ in range(count):
        if pos + _CENTRAL.size > cd_size:
            raise NotFastPath("truncated central directory")
        f = unpack(cd, pos)
        if f[0] != _SIG_CENTRAL:
            raise NotFastPath("bad central directory entry")
        name_end = pos + _CENTRAL.size + f[10]
        name = bytes(cd[pos + _CENTRAL.size : name_end])
        compressed, size, offset = f[8], f[9], f[16]
        if _U32 in (compressed, size, offset):
            extra = bytes(cd[name_end : name_end + f[11]])
            size, compressed, offset = _zip64_fields(extra, size, compressed, offset)
        if f[4] != 0 or compressed != size:
            raise NotFastPath(f"compressed record {name!r}")
        records[name] = (offset, f[4], compressed, size)
        pos = name_end + f[11] + f[12]
    return records


def _zip64_fields(extra: bytes, size: int, compressed: int, offset: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            values = iter(struct.unpack_from(f"<{n // 8}Q", extra, pos + 4))
            size = next(values) if size == _U32 else size
            compressed = next(values) if compressed == _U32 else compressed
            offset = next(values) if offset == _U32 else offset
            return size, compressed, offset
        pos += 4 + n
    raise NotFastPath("zip64 sizes without a zip64 extra field")


def _data_start(read_at: ReadAt, record: _Rec, length: int) -> int:
    at = record[0]
    if at + _LOCAL.size > length:
        raise NotFastPath("local header out of range")
    f = _LOCAL.unpack(read_at(at, _LOCAL.size))
    if f[0] != _SIG_LOCAL:
        raise NotFastPath("bad local header")
    start = at + _LOCAL.size + f[9] + f[10]
    if start + record[3] > length:
        raise NotFastPath("record data out of range")
    return start


__all__ = [
    "NotFastPath",
    "TensorRecord",
    "fast_path_supported",
    "parse_tensor_item",
    "serialize_tensor",
    "write_tensor",
]
