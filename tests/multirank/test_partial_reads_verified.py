"""Verified reads of any region of a stored tensor, both layouts.

Regression: a read that started inside a checksum block whose first bytes were not held
(not in the item's zip header) and ended where the zip directory's bytes complete that
block was checked as if it started at the block's start, and failed with a false
``ChecksumMismatchError``. Reachable with the default settings: a 1.5 MiB tensor resharded
into four row blocks (the last one starts inside the item's last block), and every item of
256 KiB-1 MiB read in part once such items were read straight into their tensors.

The checkpoint is saved by ``dist_checkpointing.save`` (checksums recorded in the commit
record) in one process, for two checksum block sizes; each example reads one random
region of one item through :class:`FileSystemReader` with verification on, with items
read through a window or straight into the destination and the CRCs computed inline or on
the hashing thread, and compares every byte. The same for a ``raw_bytes`` entry, read
through its loader (whole checksum blocks around the region, then copied).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.checkpoint import reading
from dist_checkpointing.engine.raw import load as raw_load
from dist_checkpointing.engine.storage.location import CheckpointDir
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from tests.multirank.test_filesystem_reader import _assert_bit_equal, _read
from tests.support.faults import file_property
from tests.support.harness import run_distributed

KIB = 1024
# Items of about 20 KiB, 260 KiB, 520 KiB, 1.5 MiB and 2.3 MiB (float32, 256 columns).
ROWS = {"small": 20, "quarter": 260, "half": 520, "odd": 1536, "large": 2356}
COLS = 256


# Each example reads one region of a checkpoint saved once per module.
_PROPERTY = file_property(70)


def _tensor(key: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(len(key) * 7919 + ROWS[key])
    return torch.randn(ROWS[key], COLS, generator=gen)


def _save_all(tmp: pytest.TempPathFactory, block: int, backend: str) -> Path:
    """Every tensor of :data:`ROWS`, saved whole with checksum blocks of ``block`` bytes."""
    ckpt = tmp.mktemp(f"{backend}{block}") / "ckpt"
    ckpt.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIST_CKPT_CHECKSUM_BLOCK_BYTES", str(block))
        state = {k: ShardedTensor.from_rank_offsets(k, _tensor(k)) for k in ROWS}
        dc.save(state, ckpt, get_default_save_sharded_strategy(backend, 1))
    return ckpt


@pytest.fixture(scope="module", params=[4096, 1 << 20], ids=["4KiB-blocks", "1MiB-blocks"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_all(tmp_path_factory, request.param, "torch_dist")


def _verified_read(ckpt: Path, key: str, rows: tuple[int, int], cols: tuple[int, int]) -> Any:
    location = CheckpointDir.of(ckpt)
    assert reading.open_for_read(location) is not None  # checksums come from the record
    lengths = (rows[1] - rows[0], cols[1] - cols[0])
    target = torch.zeros(lengths)
    _read(location, [("dst", key, (rows[0], cols[0]), lengths, target)])  # type: ignore[arg-type]
    return target


def _region(draw: Any, size: int) -> tuple[int, int]:
    start = draw(st.integers(0, size - 1))
    return start, draw(st.integers(start + 1, size))


@st.composite
def _requests(draw: Any) -> tuple[str, tuple[int, int], tuple[int, int], int, str]:
    key = draw(st.sampled_from(sorted(ROWS)))
    n = ROWS[key]
    kind = draw(st.sampled_from(["block of four", "whole", "any"]))
    if kind == "block of four":  # a resharded row block: ends where the data ends or not
        q = draw(st.integers(0, 3))
        rows = (q * n // 4, (q + 1) * n // 4)
    else:
        rows = (0, n) if kind == "whole" else _region(draw, n)
    cols = (0, COLS) if draw(st.booleans()) else _region(draw, COLS)
    window = draw(st.sampled_from([0, 256 * KIB, 1 << 20, 4 << 20]))
    hashing = draw(st.sampled_from(["0", "1"]))  # CRCs inline or on the hashing thread
    return key, rows, cols, window, hashing


@_PROPERTY
@given(request=_requests())
def test_any_region_of_an_item_reads_verified_and_bit_exact(
    saved: Path, request: tuple[str, tuple[int, int], tuple[int, int], int, str]
) -> None:
    key, rows, cols, window, hashing = request
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIST_CKPT_READ_SMALL_ITEM_BYTES", str(window))
        mp.setenv("DIST_CKPT_CHECKSUM_THREAD", hashing)
        got = _verified_read(saved, key, rows, cols)
    _assert_bit_equal(got, _tensor(key)[rows[0] : rows[1], cols[0] : cols[1]], key)


@pytest.mark.parametrize("part", range(4))
@pytest.mark.parametrize("key", ["odd", "quarter"])
def test_the_four_row_blocks_of_a_resharded_item(saved: Path, key: str, part: int) -> None:
    """The default settings: each of four row blocks of one item (TP 1 -> 4)."""
    rows = (part * ROWS[key] // 4, (part + 1) * ROWS[key] // 4)
    got = _verified_read(saved, key, rows, (0, COLS))
    _assert_bit_equal(got, _tensor(key)[rows[0] : rows[1]], key)


# ----------------------------------------------------------------------------- raw_bytes


@pytest.fixture(scope="module", params=[4096, 1 << 20], ids=["4KiB-blocks", "1MiB-blocks"])
def saved_raw(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_all(tmp_path_factory, request.param, "raw_bytes")


def _verified_raw_read(ckpt: Path, sh: ShardedTensor) -> None:
    location = CheckpointDir.of(ckpt)
    assert reading.open_for_read(location) is not None
    assert raw_load.verifying(location)
    raw_load.load_leaves([sh], location, lambda data, where: None)


@st.composite
def _raw_requests(draw: Any) -> tuple[str, tuple[int, int, int, int] | tuple[int, int], str]:
    """A grid block (row quarter, column half: ``(q, parts, c, col_parts)``) or any flat
    range ``(start, stop)`` of the whole tensor's elements."""
    key = draw(st.sampled_from(sorted(ROWS)))
    hashing = draw(st.sampled_from(["0", "1"]))
    if draw(st.booleans()):
        parts, col_parts = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2]))
        grid = (draw(st.integers(0, parts - 1)), parts, draw(st.integers(0, col_parts - 1)))
        return key, (*grid, col_parts), hashing
    start = draw(st.integers(0, ROWS[key] * COLS - 1))
    return key, (start, draw(st.integers(start + 1, ROWS[key] * COLS))), hashing


@_PROPERTY
@given(request=_raw_requests())
def test_any_region_of_a_raw_bytes_entry_reads_verified_and_bit_exact(
    saved_raw: Path, request: tuple[str, Any, str]
) -> None:
    key, region, hashing = request
    full = _tensor(key)
    if len(region) == 4:  # a block of the grid
        q, parts, c, col_parts = region
        rows, cols = ROWS[key] // parts, COLS // col_parts
        block = torch.zeros(rows, cols)
        sh = ShardedTensor.from_rank_offsets(key, block, (0, q, parts), (1, c, col_parts))
        expected = full[q * rows : (q + 1) * rows, c * cols : (c + 1) * cols]
    else:  # a flat range of the whole tensor (a distributed-optimizer shard)
        start, stop = region
        block = torch.zeros(stop - start)
        sh = ShardedTensor.from_rank_offsets_flat(
            key, block, (ROWS[key], COLS), flattened_range=slice(start, stop)
        )
        expected = full.reshape(-1)[start:stop]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIST_CKPT_CHECKSUM_THREAD", hashing)
        _verified_raw_read(saved_raw, sh)
    _assert_bit_equal(block, expected, key)


# ------------------------------------------------------------------------- end to end


def _reshard_one_to_four(ckpt: str, backend: str) -> bool:
    """Save the 1.5 MiB tensor whole (rank 0 the main replica), load it as four row
    blocks, verified (the default): what ``make demo`` hit, on real ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = _tensor("odd")
    state = {"odd": ShardedTensor.from_rank_offsets("odd", full.clone(), replica_id=rank)}
    dc.save(state, ckpt, get_default_save_sharded_strategy(backend, 1))
    rows = ROWS["odd"] // world
    block = torch.zeros(rows, COLS)
    request = {"odd": ShardedTensor.from_rank_offsets("odd", block, (0, rank, world))}
    out = dc.load(request, ckpt)
    return bool(torch.equal(out["odd"], full[rank * rows : (rank + 1) * rows]))


@pytest.mark.parametrize("backend", ["torch_dist", "raw_bytes"])
def test_a_tensor_saved_whole_loads_as_four_row_blocks(tmp_path: Path, backend: str) -> None:
    assert run_distributed(_reshard_one_to_four, 4, str(tmp_path), backend) == [True] * 4
