"""Multi-rank tests of the collective parts of dist_checkpointing.validation (real gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dist_checkpointing.engine.collectives import raise_on_all_ranks
from dist_checkpointing.errors import RankFailureError, ShardingError
from dist_checkpointing.mapping import ShardedObject, ShardedTensor
from dist_checkpointing.validation import (
    determine_global_metadata,
    validate_sharding_integrity_on_all_ranks,
)
from tests.support.harness import run_distributed, world_sizes

TIMEOUT_S = 60.0


def _sharded_state_dict(rank: int, world_size: int, overlap: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s part: a row block of 'w' (with ``overlap``, every rank claims block 0),
    a replicated bias saved by rank 0, a per-rank object and a non-sharded value."""
    block = 0 if overlap else rank
    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", torch.full((2, 3), float(rank)), (0, block, world_size)
        ),
        "bias": ShardedTensor.from_rank_offsets("bias", torch.ones(3), replica_id=rank),
        "rng": ShardedObject("rng", {"rank": rank}, (world_size,), (rank,)),
        "step": 10,
    }


def _gather_metadata() -> tuple[list, list]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local, global_md = determine_global_metadata(_sharded_state_dict(rank, world_size))
    return local, global_md


@world_sizes(2, 4)
def test_determine_global_metadata_gathers_every_rank(world_size: int) -> None:
    results = run_distributed(_gather_metadata, world_size, timeout=TIMEOUT_S)
    expected = [
        sorted(
            (
                sh.without_data()
                for sh in _sharded_state_dict(r, world_size).values()
                if isinstance(sh, (ShardedTensor, ShardedObject))
            ),
            key=lambda sh: sh.key,
        )
        for r in range(world_size)
    ]
    for rank, (local, global_md) in enumerate(results):
        assert len(global_md) == world_size
        for r in range(world_size):
            got = sorted(global_md[r], key=lambda sh: sh.key)
            assert got == expected[r], (rank, r)
            assert all(sh.data is None for sh in got)
        assert sorted(local, key=lambda sh: sh.key) == expected[rank]
    # Every rank sees the same global metadata.
    assert all(global_md == results[0][1] for _, global_md in results)
    w_offsets = [next(sh for sh in md if sh.key == "w").global_offset for md in results[0][1]]
    assert w_offsets == [(2 * r, 0) for r in range(world_size)]


def _validate(overlap: bool) -> tuple[str, str] | None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _, global_md = determine_global_metadata(_sharded_state_dict(rank, world_size, overlap))
    try:
        validate_sharding_integrity_on_all_ranks(global_md)
    except ShardingError as e:
        return type(e).__name__, str(e)
    return None


@world_sizes(2, 4)
def test_validate_on_all_ranks_passes_a_valid_layout(world_size: int) -> None:
    assert run_distributed(_validate, world_size, False, timeout=TIMEOUT_S) == [None] * world_size


@world_sizes(2, 4)
def test_validate_on_all_ranks_raises_everywhere(world_size: int) -> None:
    results = run_distributed(_validate, world_size, True, timeout=TIMEOUT_S)
    assert all(r is not None for r in results), results
    assert len({r for r in results}) == 1, "every rank must raise the same error"
    name, message = results[0]
    assert name == "ShardingError"
    assert "'w': main replicas overlap at [0:2, 0:3]" in message
    for rank in range(1, world_size):
        assert f"rank 0 block [0:2, 0:3], rank {rank} block [0:2, 0:3]" in message
    assert "'bias'" not in message and "'rng'" not in message


def _validate_in_subgroup() -> tuple[str, str] | None:
    # Only ranks 2 and 3 take part; their layout overlaps, the others' would be valid.
    rank = dist.get_rank()
    group = dist.new_group([2, 3])
    if rank < 2:
        return None
    sub_rank = rank - 2
    local = [ShardedTensor("sub", None, torch.float32, (4,), (4,), (0,), None)]
    if sub_rank == 0:
        local.append(ShardedTensor("only_on_2", None, torch.float32, (2,), (2,), (0,), None))
    _, global_md = determine_global_metadata({"x": local}, process_group=group)
    assert len(global_md) == 2
    try:
        validate_sharding_integrity_on_all_ranks(global_md, process_group=group)
    except ShardingError as e:
        return type(e).__name__, str(e)
    return None


def test_validate_on_all_ranks_in_a_subgroup() -> None:
    results = run_distributed(_validate_in_subgroup, 4, timeout=TIMEOUT_S)
    assert results[:2] == [None, None]
    assert results[2] == results[3] and results[2] is not None
    assert (
        "'sub': main replicas overlap at [0:4] (rank 0 block [0:4], rank 1 block [0:4])"
        in (results[2][1])
    )


def _raise_on_all(failing: tuple[int, ...]) -> tuple[str, str] | None:
    rank = dist.get_rank()
    local_error = OSError(f"disk full on rank {rank}") if rank in failing else None
    try:
        raise_on_all_ranks(local_error, what="save")
    except Exception as e:  # report whatever each rank raised
        if local_error is not None:
            assert e is local_error  # failing ranks re-raise their own exception
        return type(e).__name__, str(e)
    return None


@world_sizes(2, 4)
def test_raise_on_all_ranks_one_failure(world_size: int) -> None:
    failing = world_size - 1
    results = run_distributed(_raise_on_all, world_size, (failing,), timeout=TIMEOUT_S)
    assert results[failing] == ("OSError", f"disk full on rank {failing}")
    for rank in range(world_size - 1):
        assert results[rank] is not None, rank
        name, message = results[rank]
        assert name == RankFailureError.__name__
        assert message == (
            f"save failed on other rank(s):\nrank {failing}: OSError: disk full on rank {failing}"
        )


def test_raise_on_all_ranks_several_failures() -> None:
    results = run_distributed(_raise_on_all, 4, (1, 3), timeout=TIMEOUT_S)
    assert results[1] == ("OSError", "disk full on rank 1")
    assert results[3] == ("OSError", "disk full on rank 3")
    for rank in (0, 2):
        name, message = results[rank]  # type: ignore[misc]
        assert name == "RankFailureError"
        assert "rank 1: OSError: disk full on rank 1" in message
        assert "rank 3: OSError: disk full on rank 3" in message
        assert "rank 0:" not in message and "rank 2:" not in message


@world_sizes(2, 4)
def test_raise_on_all_ranks_without_failure(world_size: int) -> None:
    assert run_distributed(_raise_on_all, world_size, (), timeout=TIMEOUT_S) == [None] * world_size
