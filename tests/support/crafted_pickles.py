"""Pickles whose dict keys or set items collide by hash, written opcode by opcode.

Building such a dict in this process to pickle it would itself take minutes, so the
opcodes are written directly: one big ``SETITEMS`` (or ``APPENDS`` before a ``REDUCE``)
that inserts every key without returning to the input stream. Keys:

* ints ``k * (2**61 - 1) + c``: an int hashes to itself modulo the Mersenne prime;
* 2-tuples ``(x, y)`` of ints below ``2**61``: CPython's tuple hash (xxHash-style lanes,
  ``Objects/tupleobject.c``) solved for ``y`` so that every tuple hashes alike;
* ``MetadataIndex(fqn, torch.Size((x, y)))`` with those tuples as offsets (a
  ``MetadataIndex`` hashes as ``(fqn, offset)``: same ``fqn``, colliding offsets),
  also in a compact form of about 29 bytes per key (the slowest to insert per byte).

:func:`metadata_with` splices such opcodes into a valid pickled ``Metadata``.
"""

from __future__ import annotations

import functools
import io
import pickle
import pickletools
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

MERSENNE = (1 << 61) - 1
_M64 = (1 << 64) - 1
_P1 = 11400714785074694791
_P2 = 14029467366897019727
_P5 = 2870177450012600261
_P1_INV = pow(_P1, -1, 1 << 64)
_P2_INV = pow(_P2, -1, 1 << 64)


def _lane(value: int) -> int:
    return hash(value) & _M64


def _mix(acc: int, lane: int) -> int:
    acc = (acc + lane * _P2) & _M64
    acc = ((acc << 31) | (acc >> 33)) & _M64
    return (acc * _P1) & _M64


def _int_with_lane(lane: int) -> int | None:
    """An int whose hash, as an unsigned 64-bit lane, is ``lane`` (None if none is)."""
    signed = lane - (1 << 64) if lane >> 63 else lane
    if 0 <= signed < MERSENNE:
        return signed
    if -MERSENNE < signed < -2:  # hash(-1) is -2, so -1 and -2 are skipped
        return signed
    return None


def colliding_ints(count: int, residue: int = 7) -> list[int]:
    """``count`` distinct ints with one hash (each 10 bytes as LONG1)."""
    first = 1 << 17
    return [k * MERSENNE + residue for k in range(first, first + count)]


def colliding_pairs(count: int) -> list[tuple[int, int]]:
    """``count`` distinct 2-tuples of ints below ``2**61`` with one hash."""
    pairs: list[tuple[int, int]] = []
    x = 0
    while len(pairs) < count:
        after_x = _mix(_P5, _lane(x))
        y = _int_with_lane(((0 - after_x) * _P2_INV) & _M64)  # acc + lane * P2 == 0
        if y is not None:
            pairs.append((x, y))
        x += 1
    return pairs


def int_op(value: int) -> bytes:
    """LONG1 (any int; long keys keep one length so they can be compared)."""
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def tuple_op(items: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(map(int_op, items)) + b"t"


def dict_op(keys: list[bytes]) -> bytes:
    """A dict of ``keys`` (opcodes each) to None, inserted by one SETITEMS."""
    return b"}(" + b"N".join(keys) + b"Nu"


def reduce_op(module: str, name: str, items: list[bytes]) -> bytes:
    """``module.name([items...])``: REDUCE of a global with one list argument."""
    return f"c{module}\n{name}\n".encode() + b"](" + b"".join(items) + b"e\x85R"


def index_op(fqn: str, offset: tuple[int, ...]) -> bytes:
    """``MetadataIndex(fqn, torch.Size(offset))`` as pickle writes it, without memo."""
    head, tail = _index_template(fqn)
    return head + tuple_op(offset) + tail


@functools.cache
def _index_template(fqn: str) -> tuple[bytes, bytes]:
    raw = pickle.dumps(MetadataIndex(fqn, torch.Size((1, 1))), protocol=2)
    size = b"ctorch\nSize\n"
    head, found, tail = pickletools.optimize(raw)[2:-1].partition(size + b"K\x01K\x01\x86")
    assert found, raw
    return head + size, tail


def compact_index_dict_op(fqn: str, pairs: list[tuple[int, int]]) -> bytes:
    """A dict of ``MetadataIndex(fqn, pair)`` keys in about 29 bytes per key: the class
    and the strings are memoized once (BINPUT 200-203: only for a ``Metadata`` pickle
    of fewer memo entries, such as an empty one) and fetched with BINGET."""
    memo = (
        b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\nq\xc80"
        + b"X\x03\x00\x00\x00fqnq\xc90"
        + (b"X" + len(fqn).to_bytes(4, "little") + fqn.encode() + b"q\xca0")
        + b"X\x06\x00\x00\x00offsetq\xcb0"
    )
    key = b"h\xc8)\x81}(h\xc9h\xcah\xcb%s\x86ub"
    keys = [key % (int_op(x) + int_op(y)) for x, y in pairs]
    return memo + dict_op(keys)


def metadata_with(fields: dict[str, bytes], base: Metadata | None = None) -> bytes:
    """A pickled ``Metadata`` (``base``, or an empty one) whose ``fields`` are the given
    opcodes: each field is pickled as a placeholder string, then swapped."""
    metadata: Any = base if base is not None else Metadata({})
    for name in fields:
        setattr(metadata, name, f"@@{name}@@")
    raw = pickle.dumps(metadata, protocol=2)  # no frames: their lengths would change
    for name, ops in fields.items():
        text = f"@@{name}@@".encode()
        placeholder = b"X" + len(text).to_bytes(4, "little") + text
        assert raw.count(placeholder) == 1, name
        raw = raw.replace(placeholder, ops)
    return raw


def saved(obj: object) -> bytes:
    """``torch.save`` bytes of ``obj``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


__all__ = [
    "MERSENNE",
    "colliding_ints",
    "compact_index_dict_op",
    "colliding_pairs",
    "dict_op",
    "index_op",
    "int_op",
    "metadata_with",
    "reduce_op",
    "saved",
    "tuple_op",
]
