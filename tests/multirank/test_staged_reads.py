"""Staged reads of a resharding load: bounded memory, bit-exact, verified, and one memory
under two keys.

A stored chunk that a request needs only part of, where those bytes are not one
contiguous run of the destination (column blocks, or a strided destination), is read
into staging memory and the wanted elements copied out. ``raw_bytes`` allocated every
such buffer when the load was planned, so a resharding load held a second copy of most
of what it read (plus the destinations); its reader now lands staged reads in a buffer of
at most ``STAGING_BUFFER_BYTES`` per reading thread, reused, and copies out of it as soon
as the bytes are verified. ``torch_dist`` allocated a buffer per region read (its page
faults, and the allocator kept much of it); a reading thread now reuses one of that size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import ChecksumMismatchError
from tests.support.harness import run_distributed
from tests.support.memory import PeakRss

MIB = 1 << 20


def _full(i: int, rows: int, cols: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + i)
    return torch.randn(rows, cols, generator=gen)


def _save_column_blocks(
    root: str, shapes: list[tuple[int, int]], backend: str = "raw_bytes"
) -> None:
    """Rank function: tensor ``i`` of ``shapes`` split into column blocks over the world."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {}
    for i, (rows, cols) in enumerate(shapes):
        part = _full(i, rows, cols).chunk(world, dim=1)[rank].contiguous()
        state[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", part, (1, rank, world))
    dc.save(state, root, (backend, 1))


def _load_whole(root: str, shapes: list[tuple[int, int]], cap: int | None) -> dict[str, Any]:
    """Rank function (one rank): load every tensor whole (each stored column block is a
    staged read of whole rows); the RSS the load added, and the tensors that differ."""
    if cap is not None:
        os.environ["DIST_CKPT_STAGING_BUFFER_BYTES"] = str(cap)
    targets = {f"t{i}": torch.full(s, float("nan")) for i, s in enumerate(shapes)}
    state = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in targets.items()}
    dc.load(state, root)  # once to warm the allocator and the page cache
    for t in targets.values():
        t.fill_(float("nan"))
    with PeakRss() as rss:
        dc.load(state, root)
    bad = [
        k for i, (k, t) in enumerate(targets.items()) if not torch.equal(t, _full(i, *shapes[i]))
    ]
    return {"added": rss.added, "bad": bad}


@pytest.mark.parametrize("backend", ["raw_bytes", "torch_dist"])
def test_a_resharding_load_stages_through_bounded_memory(tmp_path: Path, backend: str) -> None:
    shapes = [(1024, 1024)] * 16  # 64 MiB, each tensor stored as two 2 MiB column blocks
    run_distributed(_save_column_blocks, 2, str(tmp_path), shapes, backend, timeout=180.0)
    (res,) = run_distributed(_load_whole, 1, str(tmp_path), shapes, 4 * MIB, timeout=180.0)
    assert res["bad"] == []
    # Staging every read at once added the whole 64 MiB (raw_bytes: the rows of every
    # block); a buffer per region read, 20-40 MiB (torch_dist: the allocator kept much of
    # it). Two reading threads with 4 MiB each, and the process's own noise: 6-10 MiB.
    assert res["added"] < 16 * MIB, res["added"] / MIB


def _load_blocks(root: str, shapes: list[tuple[int, int]], cap: int, verify: bool) -> list[str]:
    """Rank function: load this rank's column blocks (another world than the save's) and
    row blocks of them (rows of a stored block: read straight into the destination or
    staged); returns what differs from the full tensor built independently."""
    os.environ["DIST_CKPT_STAGING_BUFFER_BYTES"] = str(cap)
    rank, world = dist.get_rank(), dist.get_world_size()
    state, expected = {}, {}
    for i, (rows, cols) in enumerate(shapes):
        full = _full(i, rows, cols)
        axis = i % 2
        if full.shape[1 - axis] % world:  # not divisible: load it whole
            whole = torch.zeros(rows, cols)
            state[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", whole, replica_id=rank)
            expected[f"t{i}"] = full
            continue
        part = full.chunk(world, dim=1 - axis)[rank]
        request = torch.full_like(part, float("nan"))
        state[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", request, (1 - axis, rank, world))
        expected[f"t{i}"] = part
    loaded = dc.load(state, root, verify_checksums=verify)
    return [k for k, t in expected.items() if not torch.equal(loaded[k], t)]


# Small and large staged reads side by side: rows of 8 bytes to 1.5 MiB, tensors of 96 B
# to 6 MiB, so that batches fill the staging buffer and reads exceed it.
_SHAPES = [(3, 8), (1024, 6), (96, 512), (2, 393216), (40, 4096), (512, 3072), (8, 4), (6, 2)]


@pytest.mark.parametrize("cap", [4096, 256 << 10, 32 * MIB], ids=["4KiB", "256KiB", "32MiB"])
@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
@pytest.mark.parametrize("backend", ["raw_bytes", "torch_dist"])
def test_staged_reads_of_every_size_are_bit_exact(
    tmp_path: Path, cap: int, verify: bool, backend: str
) -> None:
    run_distributed(_save_column_blocks, 2, str(tmp_path), _SHAPES, backend, timeout=180.0)
    for world in (1, 4):
        results = run_distributed(
            _load_blocks, world, str(tmp_path), _SHAPES, cap, verify, timeout=180.0
        )
        assert results == [[]] * world, world


def _load_damaged(root: str, shapes: list[tuple[int, int]]) -> dict[str, Any]:
    targets = {f"t{i}": torch.full(s, float("nan")) for i, s in enumerate(shapes)}
    try:
        dc.load({k: ShardedTensor.from_rank_offsets(k, t) for k, t in targets.items()}, root)
    except ChecksumMismatchError as exc:
        damaged_block = targets["t1"][:, shapes[1][1] // 2 :]  # rank 1's columns
        return {"key": exc.key, "file": exc.file, "untouched": bool(damaged_block.isnan().all())}
    return {"key": None}


@pytest.mark.parametrize("backend", ["raw_bytes", "torch_dist"])
def test_a_damaged_staged_read_is_named(tmp_path: Path, backend: str) -> None:
    shapes = [(64, 64), (256, 1024), (64, 64)]
    run_distributed(_save_column_blocks, 2, str(tmp_path), shapes, backend, timeout=180.0)
    data = sorted(p for p in tmp_path.iterdir() if p.name.startswith("__1_"))
    # Rank 1's block of t1 (256 x 512 float32, 512 KiB) lies in one of its files: damage
    # every one of them in the middle of its largest item.
    for path in data:
        raw = bytearray(path.read_bytes())
        if len(raw) > 256 << 10:
            raw[len(raw) // 2] ^= 0xFF
            path.write_bytes(bytes(raw))
    (res,) = run_distributed(_load_damaged, 1, str(tmp_path), shapes, timeout=180.0)
    assert res["key"] == "t1"
    assert res["file"] is not None and Path(res["file"]).name.startswith("__1_")
    if backend == "raw_bytes":  # its staged rows are checked before any is copied out
        assert res["untouched"]


def _save_shared(root: str, n: int, whole_first: bool) -> None:
    """Rank function: t0 and t1 (n x n) in column blocks; with ``whole_first`` t0 whole
    (one entry, from rank 0)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {}
    for i in (0, 1):
        full = _full(i, n, n)
        if i == 0 and whole_first:
            state["t0"] = ShardedTensor.from_rank_offsets("t0", full, replica_id=rank)
            continue
        part = full.chunk(world, dim=1)[rank].contiguous()
        state[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", part, (1, rank, world))
    dc.save(state, root, ("raw_bytes", 1))


def _load_shared(root: str, n: int) -> list[str]:
    """Rank function (one rank): one memory requested whole under two keys whose stored
    values differ: t1's column blocks are staged reads, t0's too or one read straight
    into that memory (large: its checksums computed on the hashing thread)."""
    a, b = _full(0, n, n), _full(1, n, n)
    problems = []
    for _ in range(3):
        same = torch.zeros(n, n)
        dc.load({k: ShardedTensor.from_rank_offsets(k, same) for k in ("t0", "t1")}, root)
        if not (torch.equal(same, a) or torch.equal(same, b)):
            problems.append("same tensor: neither value")
    return problems


@pytest.mark.parametrize("whole_first", [False, True], ids=["staged", "direct-and-staged"])
@pytest.mark.parametrize("n", [64, 2048], ids=["16KiB", "16MiB"])
def test_one_memory_under_two_keys_resharded_loads_one_of_the_values(
    tmp_path: Path, n: int, whole_first: bool
) -> None:
    run_distributed(_save_shared, 2, str(tmp_path), n, whole_first, timeout=180.0)
    (problems,) = run_distributed(_load_shared, 1, str(tmp_path), n, timeout=180.0)
    assert problems == []
