"""Large ``torch_dist`` items read straight into their destinations
(:mod:`dist_checkpointing.engine.storage.direct_large`).

Once a layout is known, a large item is read from its first byte to its last, its
tensor bytes into the destination, with no parse and no edge reads. These tests use
4 KiB "small item" limits and checksum blocks, so that items of 7-20 KiB are large and
have several blocks. They check that the path is taken, that what it loads is
bit-exact (also resharded: into views of larger tensors, and ranges of rows or of a
flat tensor into tensors of their own), and that a damaged byte anywhere in a whole
item gets exactly the outcome it gets from the usual path, with the checksums computed
inline or on the hashing thread (damage and ranges: the unit property tests).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.support.harness import run_distributed
from tests.support.item_files import (
    count_large,
    damage_outcomes,
    load_blocks_whole,
    load_outcome,
)

_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]
# float32 (3000,) and (60, 50): one length, two layouts.
_SHAPES = [(3000,), (60, 50), (40, 90), (5001,)]


def _values(i: int) -> torch.Tensor:
    dtype, shape = _DTYPES[i % len(_DTYPES)], _SHAPES[i % len(_SHAPES)]
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 120, shape, generator=g).to(dtype)


def _state(count: int, zeros: bool) -> dict[str, Any]:
    out = {}
    for i in range(count):
        t = _values(i)
        out[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", torch.zeros_like(t) if zeros else t)
    return out


def _large_items(hashing_thread: bool) -> None:
    """Items over 4 KiB are large, in blocks of 4 KiB (set before the save); their
    checksums on the hashing thread or inline."""
    os.environ["DIST_CKPT_READ_SMALL_ITEM_BYTES"] = "4096"
    os.environ["DIST_CKPT_CHECKSUM_BLOCK_BYTES"] = "4096"
    os.environ["DIST_CKPT_CHECKSUM_THREAD"] = "1" if hashing_thread else "0"


def _save(state: dict[str, Any], root: str | Path) -> None:
    dc.save(state, root, TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))


def _round_trip(root: str, count: int, hashing_thread: bool) -> list[int]:
    _large_items(hashing_thread)
    _save(_state(count, zeros=False), root)
    taken = count_large()
    per_load = []
    for _ in range(2):
        before = sum(taken)
        loaded = dc.load(_state(count, zeros=True), root)
        for i in range(count):
            assert torch.equal(loaded[f"t{i}"].view(torch.uint8), _values(i).view(torch.uint8)), i
        per_load.append(sum(taken) - before)
    return per_load


@pytest.mark.parametrize("hashing_thread", [False, True], ids=["inline", "hashing-thread"])
def test_large_items_are_read_straight_into_their_destinations(
    tmp_path: Path, hashing_thread: bool
) -> None:
    ((first, second),) = run_distributed(
        _round_trip, 1, str(tmp_path), 40, hashing_thread, timeout=120.0
    )
    # The first load of the process parses the first item of each of the four layouts
    # (and learns it); every other item, and every item of the next load, goes directly.
    assert (first, second) == (40 - 4, 40), (first, second)


def _reshard(root: str, split_dim: int) -> int:
    """Row blocks are contiguous views of the destination (direct), columns are not."""
    _large_items(hashing_thread=False)
    return load_blocks_whole(root, split_dim, 12, _save, count_large())


@pytest.mark.parametrize("split_dim", [0, 1], ids=["rows", "columns"])
def test_resharded_loads_are_bit_exact(tmp_path: Path, split_dim: int) -> None:
    taken = run_distributed(_reshard, 2, str(tmp_path), split_dim, timeout=120.0)
    if split_dim == 0:  # rows: contiguous views, read directly (after the first of each)
        assert min(taken) >= 2 * 24 - 2, taken
    else:  # columns: strided views, read the usual way
        assert taken == [0, 0]


def _shared_destination(root: str) -> bool:
    """Keys 'a' and 'b' saved with different values, loaded into one tensor (tied
    weights), the checksums on the hashing thread (the planner gives each key memory of
    its own; one memory under two keys is tested in the unit tests of the path)."""
    _large_items(hashing_thread=True)
    a, b = torch.arange(3000.0), -torch.arange(3000.0)
    _save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in (("a", a), ("b", b))}, root)
    taken = count_large()
    dc.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(3000)) for k in "ab"}, root)
    shared = torch.zeros(3000)
    for _ in range(5):
        dc.load({k: ShardedTensor.from_rank_offsets(k, shared) for k in "ab"}, root)
    return sum(taken) > 5 and (torch.equal(shared, a) or torch.equal(shared, b))


def test_one_destination_requested_under_two_keys_loads(tmp_path: Path) -> None:
    assert run_distributed(_shared_destination, 1, str(tmp_path), timeout=120.0) == [True]


def _outcome(root: str, count: int, verify: bool) -> str:
    return load_outcome(_state(count, zeros=True), root, verify)


def _damage(root: str, count: int, hashing_thread: bool) -> tuple[dict[str, Any], int, int]:
    """For bytes across the data file: the outcome of a load with and without the direct
    paths, with checksums verified and not."""
    _large_items(hashing_thread)
    saved = Path(root) / "saved"
    saved.mkdir()
    _save(_state(count, zeros=False), saved)
    assert _outcome(str(saved), count, True).startswith("loaded")  # layouts now known
    taken = count_large()
    results, plain_taken = damage_outcomes(
        saved, Path(root), 31, lambda path, verify: _outcome(path, count, verify), taken
    )
    return results, sum(taken), plain_taken


@pytest.mark.parametrize("hashing_thread", [False, True], ids=["inline", "hashing-thread"])
def test_a_damaged_byte_has_the_outcome_of_the_usual_path(
    tmp_path: Path, hashing_thread: bool
) -> None:
    ((results, direct, plain_direct),) = run_distributed(
        _damage, 1, str(tmp_path), 16, hashing_thread, timeout=300.0
    )
    assert direct > 400 and plain_direct == 0, (direct, plain_direct)
    for where, (direct, plain) in results.items():
        assert direct == plain, (where, direct, plain)
        if "verify=True" in where:
            assert direct.startswith("ChecksumMismatchError"), (where, direct)


def _quarters(root: str) -> list[int]:
    """Matrices saved whole, each loaded as four row ranges (a rank loading a quarter of
    each, as after a change of the tensor-parallel size), and a flat tensor as four
    ranges: read directly, bit-exact; the matrices' column ranges go the usual way."""
    _large_items(hashing_thread=False)
    full = {f"m{i}": torch.arange(64 * 48, dtype=torch.float32).view(64, 48) + i for i in range(6)}
    full["flat"] = torch.arange(5000, dtype=torch.int64)
    _save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in full.items()}, root)
    taken = count_large()
    per_pass = []
    for axis in (0, 1):
        before = sum(taken)
        for part in range(4):
            request = {}
            for k, v in full.items():
                a = axis if v.dim() > 1 else 0
                chunk = v.chunk(4, a)[part]
                request[k] = ShardedTensor.from_rank_offsets(
                    k, torch.zeros_like(chunk), (a, part, 4)
                )
            loaded = dc.load(request, root, validate_access_integrity=False)
            for k, v in full.items():
                a = axis if v.dim() > 1 else 0
                assert torch.equal(loaded[k], v.chunk(4, a)[part]), (k, axis, part)
        per_pass.append(sum(taken) - before)
    return per_pass


def test_row_ranges_of_large_items_are_read_straight_into_their_destinations(
    tmp_path: Path,
) -> None:
    ((rows, columns),) = run_distributed(_quarters, 1, str(tmp_path), timeout=120.0)
    # Rows: every item but the first of each layout (learnt by the usual path), in each
    # of four loads; columns: only the flat tensor's ranges.
    assert rows >= 4 * 7 - 2 and columns == 4, (rows, columns)
