"""One large ``torch_dist`` item read by several threads (its read cut into parts).

A load shares a rank's bytes among its reading threads (:mod:`.read_spans`); an item of
1.5 runs or more is cut into parts at checksum block boundaries, each read (and its blocks
checksummed) on a thread of its own. The values must be byte-exact, the parts must really
be read on several threads, and damage anywhere must be reported exactly as a load on one
thread reports it (same key, file and offset), for any region of the item, any number of
threads and any run size, with 64 KiB and 1 MiB checksum blocks.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.storage.byte_ranges import DataFile, ItemBytes
from dist_checkpointing.errors import ChecksumMismatchError, CorruptCheckpointError
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from tests.multirank.test_partial_reads_verified import _verified_read
from tests.support.faults import file_property, flip_byte
from tests.support.layouts import same_bits

pytestmark = pytest.mark.timeout(300)

ROWS, COLS = 2048, 1024  # 8 MiB of float32: one item


def _full() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module", params=[64 << 10, 1 << 20], ids=["64KiB-blocks", "1MiB-blocks"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("parts") / "ckpt"
    ckpt.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIST_CKPT_CHECKSUM_BLOCK_BYTES", str(request.param))
        state = {"w": ShardedTensor.from_rank_offsets("w", _full())}
        dc.save(state, ckpt, get_default_save_sharded_strategy("torch_dist", 1))
    return ckpt


def _item_file(ckpt: Path) -> Path:
    (path,) = [p for p in ckpt.iterdir() if p.suffix == ".distcp" and p.stat().st_size]
    return path


def _part_threads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The threads that read parts of an item (filled as loads run)."""
    names: set[str] = set()
    real = DataFile.pread_into

    def spy(self: DataFile, offset: int, buf: memoryview, read_item: ReadItem) -> None:
        names.add(threading.current_thread().name)
        time.sleep(0.02)  # each part outlasts the submission of the others
        real(self, offset, buf, read_item)

    monkeypatch.setattr(DataFile, "pread_into", spy)
    return names


@pytest.mark.parametrize("verify", [True, False])
def test_one_item_is_read_by_several_threads(
    saved: Path, monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    """8 MiB on 4 threads: runs of 2 MiB, so the one item is read in four parts."""
    names = _part_threads(monkeypatch)
    monkeypatch.setenv("DIST_CKPT_READ_THREADS", "4")
    monkeypatch.setenv("DIST_CKPT_READ_SPAN_BYTES", str(1 << 20))
    target = torch.zeros(ROWS, COLS)
    out = dc.load(
        {"w": ShardedTensor.from_rank_offsets("w", target)}, saved, verify_checksums=verify
    )
    assert same_bits(out["w"], _full())
    assert len(names) >= 2 and all(n.startswith("dist-ckpt-part") for n in names), names
    names.clear()
    monkeypatch.setenv("DIST_CKPT_READ_THREADS", "1")  # one thread: read in one go
    dc.load({"w": ShardedTensor.from_rank_offsets("w", target)}, saved, verify_checksums=verify)
    assert not names


def _outcome(ckpt: Path, rows: tuple[int, int], cols: tuple[int, int]) -> tuple[Any, ...]:
    try:
        got = _verified_read(ckpt, "w", rows, cols)
    except ChecksumMismatchError as err:
        return ("mismatch", err.key, Path(err.file or "").name, err.offset)
    except CorruptCheckpointError as err:  # damage in the item's zip header or pickle
        return ("corrupt", str(err))
    expected = _full()[rows[0] : rows[1], cols[0] : cols[1]]
    return ("ok",) if same_bits(got, expected) else ("wrong values",)


@file_property(40)
@given(
    threads=st.integers(2, 8),
    span_kib=st.sampled_from([256, 1024, 1536, 3072]),
    rows=st.tuples(st.integers(0, ROWS - 1), st.integers(1, ROWS)).map(
        lambda r: (min(r[0], r[1] - 1), max(r[1], r[0] + 1))
    ),
    whole_rows=st.booleans(),
    damage=st.lists(st.floats(0.0, 0.9999), max_size=2),
)
def test_any_region_any_split_reads_as_one_thread_does(
    saved: Path,
    monkeypatch: pytest.MonkeyPatch,
    threads: int,
    span_kib: int,
    rows: tuple[int, int],
    whole_rows: bool,
    damage: list[float],
) -> None:
    cols = (0, COLS) if whole_rows else (3, COLS - 5)
    with tempfile.TemporaryDirectory(prefix="dcp-parts-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        shutil.copytree(saved, ckpt)
        path = _item_file(ckpt)
        for where in damage:
            flip_byte(path, int(path.stat().st_size * where))
        monkeypatch.setenv("DIST_CKPT_READ_SPAN_BYTES", str(span_kib << 10))
        monkeypatch.setenv("DIST_CKPT_READ_THREADS", "1")
        serial = _outcome(ckpt, rows, cols)
        monkeypatch.setenv("DIST_CKPT_READ_THREADS", str(threads))
        assert _outcome(ckpt, rows, cols) == serial
    if not damage:
        assert serial == ("ok",)


# ------------------------------------------------------------------ the cuts themselves


def _item(path: Path, length: int, part_bytes: int) -> ItemBytes:
    stream = open(path, "rb")  # noqa: SIM115 - closed by the caller's fixture
    file = DataFile(stream, str(path), length, (0, 0, 0))
    read_item = ReadItem(
        LoadItemType.TENSOR, MetadataIndex("w"), (0,), MetadataIndex("w"), (0,), (length,)
    )
    item = ItemBytes(file, 0, length, read_item)
    item.part_bytes = part_bytes
    return item


@settings(max_examples=300, deadline=None)
@given(
    offset=st.integers(0, 5 << 20),
    n=st.integers(1, 64 << 20),
    part_bytes=st.integers(1, 16 << 20),
)
def test_parts_cover_the_read_and_start_at_unit_boundaries(
    offset: int, n: int, part_bytes: int
) -> None:
    with tempfile.NamedTemporaryFile() as f:
        item = _item(Path(f.name), offset + n, part_bytes)
        try:
            parts = item._parts(offset, n)
        finally:
            item.file.stream.close()
    if parts is None:
        assert (n + part_bytes // 2) // part_bytes < 2 or n < 2 << 20
        return
    assert parts[0][0] == offset and parts[-1][1] == offset + n
    assert all(a < b for a, b in parts)
    assert all(b == c for (_, b), (c, _) in zip(parts, parts[1:]))
    assert all(a % (1 << 20) == 0 for a, _ in parts[1:])  # unverified: 1 MiB units
    assert 2 <= len(parts) <= (n + part_bytes // 2) // part_bytes


def test_a_short_read_is_reported_at_the_first_failing_part(tmp_path: Path) -> None:
    """The file shrinks under the load: each part that reads past the new end fails;
    the first in offset order is raised, as a read in one go reports it."""
    path = tmp_path / "data"
    path.write_bytes(os.urandom(8 << 20))
    with open(path, "r+b") as f:
        f.truncate(3 << 20)
    errors = []
    for part_bytes in (0, 2 << 20):
        item = _item(path, 8 << 20, part_bytes)
        with item.file.stream, pytest.raises(CorruptCheckpointError) as info:
            item.read_into_tensor(0, torch.empty(8 << 20, dtype=torch.uint8))
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "short read at byte 3145728" in errors[0], errors
