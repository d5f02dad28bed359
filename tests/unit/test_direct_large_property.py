"""Property: :func:`read_large` over a file of ``torch.save`` items, intact or with one
byte flipped anywhere, reads every item whole and finds exactly the damage there is.

* intact: each item lands bit-exactly in its destination and its check passes;
* a flipped byte in an item's records (before the tensor bytes, or a constant stretch
  after them): that item is not taken (the caller reads it the usual way);
* elsewhere in the item (its tensor bytes, the crcs and serialization id of its zip
  directory): the item is taken; with checksums its check names the item, the file and
  the first byte of the damaged block; without, the destination holds the file's bytes;
* inline or on a hashing thread, in pieces of any number of blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.planner import ReadItem

from dist_checkpointing.engine.storage import direct_large, item_reader
from dist_checkpointing.engine.storage.byte_ranges import DataFile
from dist_checkpointing.engine.storage.checksums import block_crcs, whole_blocks
from dist_checkpointing.engine.storage.direct_items import direct_runs
from dist_checkpointing.engine.storage.direct_large import (
    choose_layout,
    fits,
    read_large,
    region_of,
)
from dist_checkpointing.engine.storage.item_checksums import ItemChecksum
from dist_checkpointing.errors import ChecksumMismatchError, CorruptCheckpointError
from tests.support.item_files import (
    fresh_layouts,  # noqa: F401 - an autouse fixture
    in_records,
    item_file,
    region_request,
    saved_item,
    whole_request,
)

_KINDS = [
    (torch.float32, (3000,)),
    (torch.float32, (60, 50)),  # same length as (3000,), another data.pkl
    (torch.bfloat16, (50, 70)),
    (torch.int64, (1000,)),
    (torch.uint8, (5001,)),  # tensor bytes of no round size
]
_HASHER = ThreadPoolExecutor(2, thread_name_prefix="test-crc")


def _tensor(kind: int, seed: int) -> torch.Tensor:
    dtype, shape = _KINDS[kind]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 200, shape, generator=g).to(dtype)


def _layout(length: int, tensor: torch.Tensor, read_item: ReadItem) -> item_reader.KnownLayout:
    (layout,) = [k for k in item_reader.known_layouts(length) if fits(read_item, k, tensor)]
    return layout


@contextmanager
def _opened(path: Path, size: int, piece_bytes: int) -> Iterator[DataFile]:
    """``path`` (``size`` bytes) open as a data file, the direct path reading it in
    pieces of ``piece_bytes`` (inline and threaded alike)."""
    saved = direct_large._CACHE_PIECE, direct_large._THREAD_PIECE
    direct_large._CACHE_PIECE = direct_large._THREAD_PIECE = piece_bytes
    try:
        with path.open("rb") as stream:
            yield DataFile(stream, str(path), size, (0, 0, 0))
    finally:
        direct_large._CACHE_PIECE, direct_large._THREAD_PIECE = saved


def _whole(layout: item_reader.KnownLayout) -> tuple[int, int]:
    """The region of all the tensor bytes of an item of ``layout``."""
    return len(layout.head), layout.record.data_length


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kinds=st.lists(st.integers(0, len(_KINDS) - 1), min_size=1, max_size=5),
    gaps=st.lists(st.integers(0, 3000), min_size=5, max_size=5),
    flip=st.one_of(st.none(), st.floats(0, 1, exclude_max=True)),
    verify=st.booleans(),
    block_bytes=st.sampled_from([4096, 8192, 1 << 20]),
    piece_blocks=st.integers(1, 4),
    threaded=st.booleans(),
)
@example(
    kinds=[0, 1], gaps=[0] * 5, flip=0.3, verify=True, block_bytes=4096, piece_blocks=1,
    threaded=False,
)  # fmt: skip
@example(
    kinds=[4], gaps=[0] * 5, flip=0.999, verify=True, block_bytes=4096, piece_blocks=2,
    threaded=True,
)  # fmt: skip
def test_read_large_finds_exactly_the_damage_there_is(
    tmp_path: Path,
    kinds: list[int],
    gaps: list[int],
    flip: float | None,
    verify: bool,
    block_bytes: int,
    piece_blocks: int,
    threaded: bool,
) -> None:
    item_reader._KNOWN.clear()
    tensors = [_tensor(k, i) for i, k in enumerate(kinds)]
    # The layouts are known, as after a first load.
    path, content, spans, blobs, flipped = item_file(tmp_path / "data.distcp", tensors, gaps, flip)
    with _opened(path, len(content), piece_blocks * block_bytes) as file:
        for i, (t, (offset, length), blob) in enumerate(zip(tensors, spans, blobs)):
            read_item = whole_request(f"k{i}", tuple(t.shape))
            target = torch.zeros_like(t)
            layout = _layout(length, target, read_item)
            checksum = ItemChecksum(offset, length, block_crcs(blob, block_bytes))
            check = read_large(
                file,
                read_item,
                (offset, length),
                target,
                (layout, _whole(layout)),
                checksum if verify else None,
                block_bytes,
                _HASHER if threaded else None,
            )
            rel = None if flipped is None else flipped - offset
            damaged = rel is not None and 0 <= rel < length
            if damaged and in_records(layout, length, rel):
                assert check is None, (i, rel)
                continue
            assert check is not None, (i, rel)
            start = len(layout.head)
            stored = bytes(content[offset + start : offset + start + t.nbytes])
            assert target.view(torch.uint8).flatten().numpy().tobytes() == stored
            if not damaged:
                check.verify()
                assert torch.equal(target.view(torch.uint8), t.view(torch.uint8))
            elif verify:
                assert rel is not None
                with pytest.raises(ChecksumMismatchError) as err:
                    check.verify()
                assert err.value.key == f"k{i}" and err.value.file == str(path)
                assert err.value.offset == offset + rel // block_bytes * block_bytes
            else:
                check.verify()  # nothing recorded to compare


def test_a_file_that_ends_early_names_the_item(tmp_path: Path) -> None:
    t = _tensor(0, 0)
    blob = saved_item(t)
    assert item_reader._match_template(lambda o, n: blob[o : o + n], len(blob))
    path = tmp_path / "data.distcp"
    path.write_bytes(blob[: len(blob) // 2])  # shrunk after the reader sized it
    read_item = whole_request("k0", tuple(t.shape))
    target = torch.zeros_like(t)
    checksum = ItemChecksum(0, len(blob), block_crcs(blob, 4096))
    for recorded in (checksum, None):
        with path.open("rb") as stream:
            file = DataFile(stream, str(path), len(blob), (0, 0, 0))
            with pytest.raises(CorruptCheckpointError, match=r"short read at byte .*'k0'"):
                layout = _layout(len(blob), target, read_item)
                read_large(
                    file,
                    read_item,
                    (0, len(blob)),
                    target,
                    (layout, _whole(layout)),
                    recorded,
                    4096,
                    None,
                )


def test_one_destination_under_two_keys_is_hashed_before_it_is_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planner that gives two keys one memory (as plain DCP's does for tied weights),
    the checksums on the hashing thread, slowed down: the second item's bytes must not
    land before the first item's hashes are done (a false mismatch), so the check before
    it is verified first."""
    first, second = _tensor(0, 1), _tensor(0, 2)
    blobs = [saved_item(first), saved_item(second)]
    for blob in blobs:
        assert item_reader._match_template(lambda o, n, b=blob: b[o : o + n], len(blob))
    path = tmp_path / "data.distcp"
    path.write_bytes(b"".join(blobs))
    spans = [(0, len(blobs[0])), (len(blobs[0]), len(blobs[1]))]
    recorded = {o: ItemChecksum(o, n, block_crcs(b, 4096)) for (o, n), b in zip(spans, blobs)}
    items = [
        (whole_request(f"k{i}", (3000,)), SimpleNamespace(offset=o, length=n))
        for i, (o, n) in enumerate(spans)
    ]
    shared = torch.zeros(3000)
    planner: Any = SimpleNamespace(resolve_tensor=lambda ri: shared, commit_tensor=lambda *a: None)
    monkeypatch.setenv("DIST_CKPT_CHECKSUM_THREAD", "1")
    crcs = direct_large._piece_crcs

    def slow(*args: Any) -> list[int]:
        time.sleep(0.05)
        return crcs(*args)

    monkeypatch.setattr(direct_large, "_piece_crcs", slow)
    checks: list[direct_large.LargeCheck] = []
    done: list[direct_large.LargeCheck] = []

    def before() -> None:  # as the reader's: verify the item handed over last
        for check in checks:
            if check not in done:
                done.append(check)
                check.verify()

    def hand_over(check: direct_large.LargeCheck) -> None:
        before()
        checks.append(check)

    with path.open("rb") as stream:
        file = DataFile(stream, str(path), sum(len(b) for b in blobs), (4096, 0, 0))
        run = direct_runs(file, planner, nullcontext(), recorded.get, 4096, 0)
        assert run(items, 0, before, hand_over) == 1
        assert run(items, 1, before, hand_over) == 2
    before()
    assert len(done) == 2 and torch.equal(shared, second)


# ----------------------------------------------------------------- a region of an item

_REGION_KINDS = [
    (torch.float32, (40, 30)),
    (torch.bfloat16, (64, 50)),
    (torch.int64, (3000,)),
    (torch.uint8, (7, 11, 13)),
]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.integers(0, len(_REGION_KINDS) - 1),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    gap=st.integers(0, 5000),
    flip=st.one_of(st.none(), st.floats(0, 1, exclude_max=True)),
    verify=st.booleans(),
    block_bytes=st.sampled_from([4096, 8192, 1 << 20]),
    piece_blocks=st.integers(1, 3),
    threaded=st.booleans(),
)
def test_a_region_read_finds_the_damage_in_what_it_reads(
    tmp_path: Path,
    kind: int,
    cut: tuple[float, float],
    gap: int,
    flip: float | None,
    verify: bool,
    block_bytes: int,
    piece_blocks: int,
    threaded: bool,
) -> None:
    """A range of the rows (of the first axis; for a 3-D tensor, of the second axis at
    one index of the first): read with the rest of the checksum blocks it touches and
    the records before the tensor bytes. Damage to those records: not taken; in a block
    read, with checksums: named; anywhere else: the region loads as stored."""
    item_reader._KNOWN.clear()
    dtype, shape = _REGION_KINDS[kind]
    t = torch.randint(0, 200, shape, generator=torch.Generator().manual_seed(kind)).to(dtype)
    path, content, spans, blobs, flipped = item_file(tmp_path / "data.distcp", [t], [gap], flip)
    (offset, length), blob = spans[0], blobs[0]
    axis = 1 if len(shape) == 3 else 0
    n = shape[axis]
    a = min(int(cut[0] * n), n - 1)
    b = a + 1 + int(cut[1] * (n - 1 - a))
    at = [0] * len(shape)
    lengths = list(shape)
    if axis == 1:
        at[0], lengths[0] = 2, 1
    at[axis], lengths[axis] = a, b - a
    read_item = region_request("k0", shape, tuple(at), tuple(lengths))
    target = torch.zeros(lengths, dtype=dtype)
    layout = _layout(length, t, whole_request("k0", shape))
    region = region_of(read_item, layout, target)
    assert region is not None
    start, nbytes = region
    expected = t[tuple(slice(o, o + n) for o, n in zip(at, lengths))]
    checksum = ItemChecksum(offset, length, block_crcs(blob, block_bytes))
    with _opened(path, len(content), piece_blocks * block_bytes) as file:
        chosen = choose_layout(file, read_item, (offset, length), target, [layout])
        check = None
        if chosen is not None:
            assert chosen == (layout, region)
            check = read_large(
                file,
                read_item,
                (offset, length),
                target,
                chosen,
                checksum if verify else None,
                block_bytes,
                _HASHER if threaded else None,
            )
    rel = None if flipped is None else flipped - offset
    whole = start == len(layout.head) and start + nbytes + layout.tail_length == length
    if verify or whole:
        lo, hi = (0, length) if whole else whole_blocks(start, start + nbytes, block_bytes, length)
    else:
        lo, hi = start, start + nbytes
    if rel is not None and 0 <= rel < len(layout.head):
        assert check is None
        return
    if rel is not None and whole and in_records(layout, length, rel):
        assert check is None
        return
    assert check is not None
    got = target.view(torch.uint8).flatten().numpy().tobytes()
    assert got == bytes(content[offset + start : offset + start + nbytes])
    if verify and rel is not None and lo <= rel < hi:
        with pytest.raises(ChecksumMismatchError) as err:
            check.verify()
        assert err.value.key == "k0" and err.value.file == str(path)
        assert err.value.offset == offset + rel // block_bytes * block_bytes
        return
    check.verify()
    if rel is None or not start <= rel < start + nbytes:
        assert torch.equal(target.view(torch.uint8), expected.contiguous().view(torch.uint8))


def test_a_strided_region_is_left_to_the_usual_path() -> None:
    t = torch.zeros(40, 30)
    blob = saved_item(t)
    assert item_reader._match_template(lambda o, n: blob[o : o + n], len(blob))
    layout = _layout(len(blob), t, whole_request("k0", (40, 30)))
    columns = region_request("k0", (40, 30), (0, 5), (40, 10))
    assert region_of(columns, layout, torch.zeros(40, 10)) is None
    rows = region_request("k0", (40, 30), (5, 0), (10, 30))
    assert region_of(rows, layout, torch.zeros(10, 30)) == (len(layout.head) + 5 * 30 * 4, 1200)
    assert region_of(rows, layout, torch.zeros(10, 30, dtype=torch.int32)) is None
    assert region_of(rows, layout, torch.zeros(30, 10)) is None


def test_the_records_tell_apart_layouts_of_one_length(tmp_path: Path) -> None:
    """Flat tensors of 5,001 and of a few bytes fewer make items of one length (the zip
    records pad the difference): a range of either is read with its own layout, chosen
    by the records before the tensor bytes; a damaged record there chooses none."""
    first = torch.arange(5001, dtype=torch.int32).to(torch.uint8)
    length = len(saved_item(first))
    second = next(
        t
        for n in range(5000, 4900, -1)
        if len(saved_item(t := torch.arange(n, dtype=torch.int32).to(torch.uint8) + 1)) == length
    )
    path, content, spans, _, _ = item_file(tmp_path / "data.distcp", [first, second], [0, 0], None)
    layouts = item_reader.known_layouts(length)
    assert len(layouts) == 2
    for i, t in enumerate((first, second)):
        read_item = region_request(f"k{i}", tuple(t.shape), (10,), (4000,))
        target = torch.zeros(4000, dtype=torch.uint8)
        with path.open("rb") as stream:
            file = DataFile(stream, str(path), len(content), (0, 0, 0))
            chosen = choose_layout(file, read_item, spans[i], target, layouts)
            assert chosen is not None and chosen[0].record.shape == tuple(t.shape)
            check = read_large(file, read_item, spans[i], target, chosen, None, 0, None)
        assert check is not None and torch.equal(target, t[10:4010])
    damaged = bytearray(content)
    damaged[spans[1][0] + 40] ^= 0x01  # a byte of the zip header before the tensor bytes
    path.write_bytes(bytes(damaged))
    with path.open("rb") as stream:
        file = DataFile(stream, str(path), len(damaged), (0, 0, 0))
        read_item = region_request("k1", tuple(second.shape), (10,), (4000,))
        target = torch.zeros(4000, dtype=torch.uint8)
        assert choose_layout(file, read_item, spans[1], target, layouts) is None
