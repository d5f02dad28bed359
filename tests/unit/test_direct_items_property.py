"""Property: :func:`read_direct` over a file of ``torch.save`` items, intact or with one
byte flipped anywhere, fills and commits exactly what the bytes and checksums allow.

* intact: every item of the run lands bit-exactly in its destination;
* checksums verified: the first damaged item is named (key, file, offset) and only the
  items before it are committed;
* not verified: items are committed in order, each holding the file's bytes; a damaged
  record before or after the tensor bytes stops the run at that item (the caller reads
  it the usual way), and damage to the tensor bytes is loaded as it is.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dist_checkpointing.engine.storage import item_reader
from dist_checkpointing.engine.storage.byte_ranges import DataFile
from dist_checkpointing.engine.storage.direct_items import read_direct
from dist_checkpointing.engine.storage.item_checksums import ItemChecksum
from dist_checkpointing.engine.storage.overlaps import overlapping
from dist_checkpointing.errors import ChecksumMismatchError
from tests.support.item_files import (
    fresh_layouts,  # noqa: F401 - an autouse fixture
    in_records,
    item_file,
    saved_item,
    whole_request,
)

_KINDS = [
    (torch.float32, (64,)),
    (torch.float32, (8, 8)),  # same length as (64,), another data.pkl
    (torch.bfloat16, (3, 5)),
    (torch.int64, (7,)),
    (torch.uint8, (100,)),
]


def _tensor(kind: int, seed: int) -> torch.Tensor:
    dtype, shape = _KINDS[kind]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 200, shape, generator=g).to(dtype)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kinds=st.lists(st.integers(0, len(_KINDS) - 1), min_size=1, max_size=12),
    gaps=st.lists(st.integers(0, 40), min_size=12, max_size=12),
    flip=st.one_of(st.none(), st.floats(0, 1, exclude_max=True)),
    verify=st.booleans(),
)
@example(kinds=[0, 0, 0], gaps=[0] * 12, flip=0.5, verify=True)
@example(kinds=[3, 3, 3], gaps=[0] * 12, flip=0.02, verify=False)  # a head record
def test_read_direct_fills_what_the_bytes_allow(
    tmp_path: Path, kinds: list[int], gaps: list[int], flip: float | None, verify: bool
) -> None:
    item_reader._KNOWN.clear()
    tensors = [_tensor(k, i) for i, k in enumerate(kinds)]
    # The layouts are known, as after a first window.
    path, content, spans, blobs, flipped = item_file(tmp_path / "data.distcp", tensors, gaps, flip)
    targets = {f"k{i}": torch.zeros_like(t) for i, t in enumerate(tensors)}
    items = [
        (whole_request(f"k{i}", tuple(t.shape)), SimpleNamespace(offset=o, length=n))
        for i, (t, (o, n)) in enumerate(zip(tensors, spans))
    ]
    recorded = {o: ItemChecksum(o, n, [crc32c.crc32c(b)]) for (o, n), b in zip(spans, blobs)}
    committed: list[str] = []

    def checksum_of(offset: int, length: int) -> Any:
        return recorded[offset] if verify else None

    def commit(read_item: ReadItem, target: torch.Tensor) -> None:
        committed.append(read_item.storage_index.fqn)

    damaged = next(
        (i for i, (o, n) in enumerate(spans) if flipped is not None and o <= flipped < o + n), None
    )
    with path.open("rb") as stream:
        file = DataFile(stream, str(path), len(content), (1 << 20, 1 << 10, 1 << 24))
        try:
            end = read_direct(
                file, items, 0, lambda ri: targets[ri.storage_index.fqn], checksum_of, commit
            )
        except ChecksumMismatchError as err:
            assert verify and damaged is not None
            assert err.key == f"k{damaged}" and err.file == str(path)
            assert spans[damaged][0] <= err.offset < sum(spans[damaged])
            assert committed == [f"k{i}" for i in range(damaged)]
            return
    assert committed == [f"k{i}" for i in range(end)]
    if verify:
        assert damaged is None or damaged >= end, (damaged, end)
    for i in range(end):
        offset, length = spans[i]
        stored = bytes(content[offset : offset + length])
        data = targets[f"k{i}"].view(torch.uint8).flatten().numpy().tobytes()
        start = length - len(data) - _layout(length, tensors[i]).tail_length
        assert data == stored[start : start + len(data)], i  # the file's bytes, as they are
        if i != damaged:
            assert torch.equal(targets[f"k{i}"].view(torch.uint8), tensors[i].view(torch.uint8))
    if (
        damaged is not None
        and flipped is not None
        and _in_records(spans[damaged], flipped, tensors[damaged])
    ):
        assert end <= damaged, (damaged, end)  # its records are not the layout's: stopped
    if flipped is None:
        assert end == len(items), end  # intact, every layout known: one run


def _layout(length: int, tensor: torch.Tensor) -> item_reader.KnownLayout:
    """The layout recognized for ``tensor``'s items of ``length`` bytes."""
    (layout,) = [
        k
        for k in item_reader.known_layouts(length)
        if k.record.shape == tuple(tensor.shape) and k.record.dtype == tensor.dtype
    ]
    return layout


def _in_records(span: tuple[int, int], at: int, tensor: torch.Tensor) -> bool:
    """Whether byte ``at`` of the file is one of the records of the item at ``span``."""
    offset, length = span
    return in_records(_layout(length, tensor), length, at - offset)


@pytest.mark.parametrize("change", ["dtype", "shape", "strided", "region"])
def test_a_destination_that_does_not_take_the_bytes_as_they_are_stops_the_run(
    tmp_path: Path, change: str
) -> None:
    """Another dtype of the same size, another shape of the same size, a strided view,
    a region of the stored tensor: the usual path handles those (it converts or stages)."""
    stored = _tensor(0, 1)  # float32 (64,)
    blob = saved_item(stored)
    assert item_reader._match_template(lambda o, n: blob[o : o + n], len(blob))
    path = tmp_path / "data.distcp"
    path.write_bytes(blob)
    target = torch.zeros(64)
    read_item = whole_request("k0", (64,))
    if change == "dtype":
        target = torch.zeros(64, dtype=torch.int32)
    elif change == "shape":
        target, read_item = torch.zeros(8, 8), whole_request("k0", (8, 8))
    elif change == "strided":
        target = torch.zeros(64, 2)[:, 0]
    else:
        read_item = ReadItem(
            LoadItemType.TENSOR,
            read_item.dest_index,
            torch.Size([0]),
            read_item.storage_index,
            torch.Size([8]),
            torch.Size([56]),
        )
        target = torch.zeros(56)
    committed: list[str] = []
    with path.open("rb") as stream:
        file = DataFile(stream, str(path), len(blob), (1 << 20, 1 << 10, 1 << 24))
        end = read_direct(
            file,
            [(read_item, SimpleNamespace(offset=0, length=len(blob)))],
            0,
            lambda ri: target,
            lambda o, n: None,
            lambda ri, t: committed.append(ri.storage_index.fqn),
        )
    assert (end, committed) == (0, [])
    assert not target.any()


def test_a_destination_taken_twice_ends_the_run(tmp_path: Path) -> None:
    """One tensor requested under two keys whose stored values differ: the second read
    would change the bytes the first item's checksum is computed on, so the run stops
    before it (the usual path reads it: no false checksum error)."""
    first, second = _tensor(0, 1), _tensor(0, 2)
    blobs = [saved_item(first), saved_item(second)]
    for blob in blobs:
        assert item_reader._match_template(lambda o, n, b=blob: b[o : o + n], len(blob))
    path = tmp_path / "data.distcp"
    path.write_bytes(b"".join(blobs))
    shared = torch.zeros(64)
    spans = [(0, len(blobs[0])), (len(blobs[0]), len(blobs[1]))]
    recorded = {o: ItemChecksum(o, n, [crc32c.crc32c(b)]) for (o, n), b in zip(spans, blobs)}
    items = [
        (whole_request(f"k{i}", (64,)), SimpleNamespace(offset=o, length=n))
        for i, (o, n) in enumerate(spans)
    ]
    committed: list[str] = []
    with path.open("rb") as stream:
        file = DataFile(stream, str(path), sum(len(b) for b in blobs), (1 << 20, 1 << 10, 1 << 24))
        end = read_direct(
            file,
            items,
            0,
            lambda ri: shared,
            lambda o, n: recorded[o],
            lambda ri, t: committed.append(ri.storage_index.fqn),
        )
    assert (end, committed) == (1, ["k0"])
    assert torch.equal(shared, first)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), max_size=30))
def test_overlapping_leaves_the_others_pairwise_disjoint(raw: list[tuple[int, int]]) -> None:
    starts, lengths = [lo for lo, _ in raw], [n for _, n in raw]
    flagged = overlapping(starts, lengths)
    spans = [(lo, lo + n) for lo, n in raw]

    def meet(a: tuple[int, int], b: tuple[int, int]) -> bool:  # empty spans meet nothing
        return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]

    kept = [spans[i] for i in range(len(spans)) if i not in flagged]
    assert not any(meet(kept[i], kept[j]) for j in range(len(kept)) for i in range(j))
    assert all(any(meet(spans[f], k) for k in kept) for f in flagged)  # none needlessly
    cut = flagged[0] if flagged else len(spans)  # a direct run stops there
    assert not any(meet(spans[i], spans[j]) for j in range(cut) for i in range(j))
