"""The layout of one tensor item: the ``torch.save`` zip archive of a chunk.

DCP stores every tensor item as a complete ``torch.save`` archive: records
``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``, ``data/0``
(64-byte aligned), ``version``, ``.data/serialization_id``, then the central
directory and zip64 end records. For a given ``data.pkl`` the layout is computed
once (:class:`_Template`); per tensor only the CRC-32 of its bytes and the
serialization id derived from it change. The writer (:mod:`.item_writer`) fills a
template; the reader (:mod:`.item_reader`) recognizes archives laid out exactly
like it.

Note: ``torch.load`` does not verify these CRC-32 values; they exist for
byte-identity with ``torch.save`` and for external integrity checks.
"""

from __future__ import annotations

import collections
import functools
import io
import logging
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..._torch_compat import legacy_storage_name, rebuild_tensor_v2, rebuild_tensor_v3
from .checksums import zip_crc32

logger = logging.getLogger(__name__)

_ARCHIVE = "archive/"


_ALIGNMENT = 64


_FLAGS = 0x0808  # data descriptor follows each record; UTF-8 names


_FLAGS_EMPTY = 0x0800


_U32 = 0xFFFFFFFF


_U64 = (1 << 64) - 1


# Archives up to this size need no zip64 fields in local/central headers.
_MAX_FAST_BYTES = _U32 - (1 << 20)


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
    crc = zip_crc32(payload) if compute_crc else 0
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
        sid_crc = zip_crc32(sid) if self.compute_crc else 0
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


class NotFastPath(Exception):
    """The item is not a plain one-tensor archive this parser handles (use torch.load)."""


ReadAt = Callable[[int, int], bytes | memoryview]


_END_BYTES = _ZIP64_EOCD.size + _ZIP64_LOCATOR.size + _EOCD.size


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
    start: int = at + _LOCAL.size + f[9] + f[10]
    if start + record[3] > length:
        raise NotFastPath("record data out of range")
    return start
