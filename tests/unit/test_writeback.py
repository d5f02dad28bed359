"""Write-back of a data file is started while it is written (Linux ``sync_file_range``);
the bytes saved are the same, and a file system that refuses the call only loses the
head start."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.storage import item_writer, writeback
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from tests.support.layouts import same_bits

pytestmark = pytest.mark.skipif(
    writeback._sync_file_range is None, reason="no sync_file_range on this platform"
)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every sync_file_range call (file, offset, length), still made for real."""
    real = writeback._sync_file_range
    seen: list[tuple[str, int, int]] = []

    def record(fd: int, offset: int, length: int, flags: int) -> int:
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        return int(real(fd, offset, length, flags))

    monkeypatch.setattr(writeback, "_sync_file_range", record)
    return seen


def test_started_after_each_threshold_of_bytes(tmp_path: Path, calls: list[Any]) -> None:
    with open(tmp_path / "f", "wb", buffering=0) as f:
        wb = writeback.Writeback(f.fileno(), 64 << 10)
        for i in range(1, 6):
            f.write(bytes(40 << 10))
            wb.advance(i * (40 << 10))
    ranges = [(offset, length) for _, offset, length in calls]
    assert ranges == [(0, 80 << 10), (80 << 10, 80 << 10)]  # after 80 KiB and 160 KiB


def test_a_refused_call_turns_it_off_without_an_error(calls: list[Any]) -> None:
    read_end, write_end = os.pipe()  # sync_file_range fails on a pipe (ESPIPE)
    try:
        wb = writeback.Writeback(write_end, 10)
        wb.advance(100)
        wb.advance(200)
        assert len(calls) == 1  # asked once, then never again
    finally:
        os.close(read_end)
        os.close(write_end)


def test_off_without_descriptor_or_with_the_knob_at_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert writeback.writeback_for(None) is None
    with open(tmp_path / "f", "wb") as f:
        assert writeback.writeback_for(f.fileno()) is not None
        monkeypatch.setenv("DIST_CKPT_WRITEBACK_BYTES", "0")
        assert writeback.writeback_for(f.fileno()) is None


@pytest.mark.parametrize("layout", ["torch_dist", "raw_bytes"])
def test_saves_start_the_write_back_of_their_data_files(
    tmp_path: Path, layout: str, calls: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DIST_CKPT_WRITEBACK_BYTES", str(64 << 10))
    gen = torch.Generator().manual_seed(7)
    full = {f"t{i}": torch.randn(50_000 + 999 * i, generator=gen) for i in range(8)}
    state = {k: ShardedTensor.from_rank_offsets(k, v, (0, 0, 1)) for k, v in full.items()}
    dc.save(state, tmp_path, get_default_save_sharded_strategy(layout, 1))
    started = {os.path.basename(path) for path, _, _ in calls}
    data_files = {n for n in os.listdir(tmp_path) if n.startswith("__0_")}
    assert data_files and started == data_files
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in full.items()}
    loaded = dc.load(request, tmp_path)
    assert all(same_bits(loaded[k], full[k]) for k in full)


def test_a_large_torch_dist_item_starts_its_write_back_piece_by_piece(
    tmp_path: Path, calls: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not only once the item is written: a 1 GiB tensor would otherwise reach the disk
    only at the fsync."""
    monkeypatch.setenv("DIST_CKPT_WRITEBACK_BYTES", str(256 << 10))
    monkeypatch.setattr(item_writer, "_spare_cores", lambda: False)  # 1 MiB pieces
    full = torch.arange(3 << 18, dtype=torch.float32)  # 3 MiB
    dc.save({"w": ShardedTensor.from_rank_offsets("w", full)}, tmp_path)
    ranges = [(offset, length) for path, offset, length in calls if "__0_" in path]
    assert len(ranges) >= 3 and ranges[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))  # back to back
    loaded = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(full))}, tmp_path)
    assert same_bits(loaded["w"], full)
