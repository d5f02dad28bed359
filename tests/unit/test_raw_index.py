"""The ``raw_bytes`` index (``.raw_index``): encoding, bounded parsing, hostile input.

Indexes are built from real save plans (:func:`plan_rank` over ShardedTensors and
ShardedObjects) and parsed back; damaged and crafted indexes must raise a clear
``CorruptCheckpointError`` / ``UnsafeCheckpointError`` before anything large is
allocated, and never any other exception.
"""

from __future__ import annotations

import contextlib
import json
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.engine.raw import index as raw_index
from dist_checkpointing.engine.raw.index import (
    ENTRY_DTYPE,
    KIND_OBJECT,
    MAGIC,
    RawIndex,
    parse_index,
)
from dist_checkpointing.engine.raw.pieces import merge_pieces
from dist_checkpointing.engine.raw.request_rows import key_table, rows_for, subset
from dist_checkpointing.engine.raw.writer import plan_rank
from dist_checkpointing.errors import CorruptCheckpointError, UnsafeCheckpointError

BLOCK = 4096


def _leaves(n: int = 3) -> list:
    leaves: list = []
    for i in range(n):
        t = torch.arange(24, dtype=torch.float32).reshape(4, 6) + i
        leaves.append(ShardedTensor.from_rank_offsets(f"w{i}", t[:2], (0, 0, 2)))
    leaves.append(
        ShardedTensor.from_rank_offsets_flat(
            "flat", torch.arange(5, dtype=torch.bfloat16), (2, 4), flattened_range=slice(1, 6)
        )
    )
    leaves.append(ShardedObject("obj", {"a": 1}, (2,), (1,)))
    leaves.append(ShardedTensor.from_rank_offsets("ké", torch.ones(3, dtype=torch.bool)))
    return leaves


def _index(n: int = 3, block: int = BLOCK) -> RawIndex:
    _, piece_a = plan_rank(_leaves(n), "/ckpt", 0, 2, 64, block)
    _, piece_b = plan_rank(_leaves(1), "/ckpt", 1, 1, 64, block)
    return merge_pieces([piece_a, piece_b], 64, block)


def _header_and_body(data: bytes) -> tuple[dict, int, bytes]:
    n = int.from_bytes(data[8:12], "little")
    return json.loads(data[12 : 12 + n]), n, data[12 + n :]


def _with_header(data: bytes, **changes: object) -> bytes:
    header, n, body = _header_and_body(data)
    header.update(changes)
    text = json.dumps(header).encode()
    head = MAGIC + len(text).to_bytes(4, "little") + text
    pad = b"\0" * (-len(head) % 8)
    old_pad = -(12 + n) % 8
    return head + pad + body[old_pad:]


def test_roundtrip_keeps_every_section() -> None:
    index = _index()
    parsed = parse_index(index.to_bytes(), "idx")
    assert parsed.files == index.files == ["__0_0.dcpraw", "__0_1.dcpraw", "__1_0.dcpraw"]
    assert parsed.entries.tobytes() == index.entries.tobytes()
    assert np.array_equal(parsed.dims, index.dims)
    assert parsed.keys == index.keys
    assert parsed.key_list[:3] == ["w0", "w1", "w2"]
    assert "ké" in parsed.rows_by_key and "obj/shard_1_2" in parsed.rows_by_key
    assert (parsed.entries["offset"] % 64 == 0).all()
    assert parsed.box(0) == ((4, 6), (0, 0), (2, 6))
    assert parsed.dtype_of(parsed.rows_by_key["flat"][0]) == torch.bfloat16


def test_entries_are_numpy_records_of_72_bytes() -> None:
    assert ENTRY_DTYPE.itemsize == 72
    index = _index()
    assert len(index.to_bytes()) > len(index.entries) * 72


@pytest.mark.parametrize(
    "change, message",
    [
        ({"version": 2}, "unsupported version"),
        ({"format": "x"}, "not a raw_bytes index"),
        ({"dtypes": ["float32", "evil"]}, "unknown dtype"),
        ({"byte_order": "big"}, "byte_order"),
    ],
)
def test_bad_header_fields_are_refused(change: dict, message: str) -> None:
    data = _with_header(_index().to_bytes(), **change)
    with pytest.raises(CorruptCheckpointError, match=message):
        parse_index(data, "/ckpt/.raw_index")


def test_file_name_outside_the_directory_is_refused() -> None:
    index = _index()
    data = _with_header(index.to_bytes(), files=["../../etc/passwd", *index.files[1:]])
    with pytest.raises(UnsafeCheckpointError, match="passwd"):
        parse_index(data, "/ckpt/.raw_index")


def test_huge_counts_are_refused_before_any_allocation() -> None:
    data = _with_header(
        _index().to_bytes(), counts={"entries": 10**15, "dims": 10**15, "crcs": 1, "key_bytes": 1}
    )
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="entries must be"):
            parse_index(data, "/ckpt/.raw_index")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_counts_that_do_not_add_up_to_the_file_are_refused() -> None:
    data = _index().to_bytes()
    header, _, _ = _header_and_body(data)
    counts = dict(header["counts"], crcs=header["counts"]["crcs"] + 1)
    with pytest.raises(CorruptCheckpointError, match="sections need"):
        parse_index(_with_header(data, counts=counts), "idx")
    with pytest.raises(CorruptCheckpointError, match="sections need"):
        parse_index(data[:-1], "idx")


def test_huge_header_length_is_refused() -> None:
    data = bytearray(_index().to_bytes())
    data[8:12] = (2**32 - 1).to_bytes(4, "little")
    with pytest.raises(CorruptCheckpointError, match="header of"):
        parse_index(bytes(data), "idx")


def _tampered(field: str, value: int, row: int = 0) -> bytes:
    index = _index()
    entries = index.entries.copy()
    entries[field][row] = value
    index.entries = entries
    return index.to_bytes()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("kind", 9, "unknown kind"),
        ("file", 99, "file index"),
        ("dtype", 77, "dtype index"),
        ("key_start", 10**9, "key outside"),
        ("dims_start", 10**9, "dims outside"),
        ("crc_start", 10**9, "checksums outside"),
        ("offset", 3, "not aligned"),
        ("offset", 2**63, "offset out of range"),
        ("length", 12345, "length does not match"),
        ("crc_count", 7, "wrong number of checksums"),
        ("ndim", 200, "more than"),
    ],
)
def test_inconsistent_entries_are_refused(field: str, value: int, message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=message):
        parse_index(_tampered(field, value), "/ckpt/.raw_index")


@pytest.mark.parametrize(
    "field, value, message",
    [("kind", 9, "unknown kind"), ("length", 12345, "length does not match")],
)
def test_a_large_index_is_checked_in_passes_that_name_the_entry(
    field: str, value: int, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked a few entries at a time (bounded temporary memory), the error still names
    the damaged entry by its number in the whole index."""
    monkeypatch.setattr(raw_index, "_CHECK_ROWS", 2)
    kinds = _index().entries["kind"].tolist()
    for row, kind in enumerate(kinds):
        if field == "length" and kind == KIND_OBJECT:
            continue  # an object's length is any length (its checksums' count differs)
        with pytest.raises(CorruptCheckpointError, match=f"entry {row}: {message}"):
            parse_index(_tampered(field, value, row), "/ckpt/.raw_index")
    parse_index(_index().to_bytes(), "idx")  # an intact index still parses


def test_index_without_checksums_has_no_crcs() -> None:
    index = _index(block=0)
    assert len(index.crcs) == 0
    parsed = parse_index(index.to_bytes(), "idx")
    assert (parsed.entries["crc_count"] == 0).all()


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_damage_is_refused_cleanly_or_parses(data: st.DataObject) -> None:
    """Flipped bytes anywhere: a clear checkpoint error, or an index that passed every check
    (and that a load can narrow to its request without any other exception)."""
    raw = bytearray(_index().to_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    with contextlib.suppress(CorruptCheckpointError, UnsafeCheckpointError):
        index = parse_index(bytes(raw), "idx")
        subset(index, rows_for(index, key_table(index), _leaves()))


@settings(max_examples=50, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.lists(st.integers(0, 5), min_size=0, max_size=3), st.integers(1, 3)),
        min_size=1,
        max_size=20,
    ),
    files=st.integers(1, 4),
)
def test_random_plans_roundtrip(shapes: list, files: int) -> None:
    """Random chunk shapes and file counts: the index parses back to the same entries,
    items do not overlap and each file holds its items in order."""
    leaves = []
    for i, (shape, dt) in enumerate(shapes):
        dtype = (torch.float32, torch.bfloat16, torch.int8)[dt - 1]
        leaves.append(ShardedTensor.from_rank_offsets(f"k{i}", torch.zeros(shape, dtype=dtype)))
    wr, piece = plan_rank(leaves, "/ckpt", 0, files, 64, BLOCK)
    index = merge_pieces([piece], 64, BLOCK)
    parsed = parse_index(index.to_bytes(), "idx")
    assert parsed.entries.tobytes() == index.entries.tobytes()
    e = parsed.entries
    for f in range(len(parsed.files)):
        mine = e[e["file"] == f]
        ends = mine["offset"] + mine["length"]
        assert (mine["offset"][1:] >= ends[:-1]).all()
        assert wr.sizes[f] == int(ends.max())
