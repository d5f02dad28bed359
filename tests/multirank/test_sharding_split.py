"""The sharding check split by key over real gloo ranks (``engine/sharding_split``):
the same verdict and message as one rank checking everything, on every rank; the
structure digest skips the check only while no rank's records change; the keys no rank
requests are found by the same owners."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing.engine.collectives import RankGroup
from dist_checkpointing.engine.sharding_check import sharding_integrity_problems
from dist_checkpointing.engine.sharding_split import (
    ValidatedStructure,
    keys_nobody_requested,
    structure_digest,
    validate_sharding_split,
)
from dist_checkpointing.errors import ShardingError
from dist_checkpointing.mapping import ShardedObject, ShardedTensor
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from dist_checkpointing.validation import gather_shard_records, local_shard_records
from tests.support.harness import run_distributed, world_sizes

TIMEOUT_S = 90.0


def _layout(rank: int, world: int, bad: bool) -> dict[str, Any]:
    """Many keys (so that every rank owns some); with ``bad``, rank 1 overlaps rank 0 on
    'w3', every rank claims the whole of 'b5' and rank 0 drops its object shard."""
    sd: dict[str, Any] = {}
    for i in range(12):
        block = 0 if bad and i == 3 and rank == 1 else rank
        sd[f"w{i}"] = ShardedTensor.from_rank_offsets(
            f"w{i}", torch.full((2, 3), float(rank)), (0, block, world)
        )
        replica = 0 if bad and i == 5 else rank
        sd[f"b{i}"] = ShardedTensor.from_rank_offsets(f"b{i}", torch.ones(3), replica_id=replica)
    if not (bad and rank == 0):
        sd["rng"] = ShardedObject("rng", {"rank": rank}, (world,), (rank,))
    return sd


def _check(bad: bool) -> tuple[str | None, str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = _layout(rank, world, bad)
    _, everything = gather_shard_records(sd)
    expected = "\n  ".join(sharding_integrity_problems(everything))
    try:
        validate_sharding_split(local_shard_records(sd), RankGroup())
    except ShardingError as e:
        return str(e), expected
    return None, expected


@world_sizes(2, 4)
def test_split_check_passes_a_valid_layout(world_size: int) -> None:
    results = run_distributed(_check, world_size, False, timeout=TIMEOUT_S)
    assert results == [(None, "")] * world_size


@world_sizes(2, 4)
def test_split_check_raises_the_single_rank_message_everywhere(world_size: int) -> None:
    results = run_distributed(_check, world_size, True, timeout=TIMEOUT_S)
    messages = {message for message, _ in results}
    assert len(messages) == 1, "every rank must raise the same error"
    message = messages.pop()
    assert message is not None
    assert message.endswith(results[0][1])  # word for word the centralized report
    assert "'w3': main replicas overlap at [0:2, 0:3] (rank 0 block [0:2, 0:3], rank 1" in message
    assert "'b5': main replicas overlap" in message
    assert "'rng': 1 of " in message and "object shards have no main replica" in message


def _strategy(kind: str) -> Any:
    if kind == "cached_metadata":
        return TorchDistSaveShardedStrategy(cached_metadata=True)
    if kind == "torch_dist":
        return TorchDistSaveShardedStrategy()  # the digest is kept without cached_metadata
    return get_default_save_sharded_strategy("raw_bytes", 1)


def _save_twice_then_break(tmp: str, kind: str) -> list[Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = _strategy(kind)
    assert strategy.validated_structure is not None
    strategy.validated_structure.digest = None  # a registered default may have saved before
    digests = []
    for i in range(2):
        dc.save(_layout(rank, world, False), f"{tmp}/{i}", strategy)
        digests.append(strategy.validated_structure.digest)
    # Only rank 1 changes its structure (to an invalid one): every rank must check again.
    sd = _layout(rank, world, rank == 1)
    try:
        dc.save(sd, f"{tmp}/2", strategy)
        outcome = "saved"
    except ShardingError as e:
        outcome = str(e)
    return [digests, outcome]


def _prepare_dirs(tmp: str) -> None:
    if dist.get_rank() == 0:
        import os

        for i in range(3):
            os.makedirs(f"{tmp}/{i}", exist_ok=True)
    dist.barrier()


def _cached_run(tmp: str, kind: str) -> list[Any]:
    _prepare_dirs(tmp)
    return _save_twice_then_break(tmp, kind)


@pytest.mark.parametrize("kind", ["cached_metadata", "torch_dist", "raw_bytes"])
@world_sizes(2)
def test_cached_structure_skips_only_while_unchanged(
    world_size: int, tmp_path: Any, kind: str
) -> None:
    results = run_distributed(_cached_run, world_size, str(tmp_path), kind, timeout=TIMEOUT_S)
    for digests, outcome in results:
        assert digests[0] is not None and digests[0] == digests[1]
        assert "'w3': main replicas overlap" in outcome
    assert len({outcome for _, outcome in results}) == 1


def _skip_is_one_vote() -> list[Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    records = local_shard_records(_layout(rank, world, False))
    cache = ValidatedStructure()
    validate_sharding_split(records, RankGroup(), cache)
    first = cache.digest
    # A cache that claims an invalid structure was validated is believed only while the
    # records are unchanged on every rank: change one rank's records and it checks again.
    bad = local_shard_records(_layout(rank, world, True))
    outcomes = []
    for claimed in (None if rank == 0 else first, structure_digest(bad, rank, world)):
        cache.digest = claimed
        try:
            validate_sharding_split(bad, RankGroup(), cache)
            outcomes.append("passed")
        except ShardingError:
            outcomes.append("raised")
    return [first, outcomes]


@world_sizes(2, 4)
def test_one_changed_rank_makes_every_rank_check(world_size: int) -> None:
    results = run_distributed(_skip_is_one_vote, world_size, timeout=TIMEOUT_S)
    # One rank's records differ from its validated digest: every rank checks and raises.
    # Every rank's digest matches (here: falsely claimed): the check is skipped.
    assert [outcome for _, outcome in results] == [["raised", "passed"]] * world_size
    assert len({first for first, _ in results}) == world_size  # rank and world in the digest


def _all_to_all() -> list[Any]:
    group = RankGroup()
    return group.all_to_all([(group.rank, dest, "x" * dest * 1000) for dest in range(group.world)])


@world_sizes(2, 4)
def test_all_to_all_delivers_each_rank_its_objects(world_size: int) -> None:
    results = run_distributed(_all_to_all, world_size, timeout=TIMEOUT_S)
    for rank, got in enumerate(results):
        assert got == [(src, rank, "x" * rank * 1000) for src in range(world_size)]


def _members() -> list[Any]:
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    mine = RankGroup(groups[rank // 2])
    rec = local_shard_records(_layout(mine.rank, mine.world, False))
    # What the check's digest includes: the same records, rank and size in another group
    # of partners give another digest (compared within this process).
    own = structure_digest(rec, mine.rank, mine.world, mine.members)
    other = structure_digest(rec, mine.rank, mine.world, (0, 3))
    dist.barrier()
    return [RankGroup().members, mine.members, (mine.rank, mine.world), own != other]


@world_sizes(4)
def test_a_group_knows_its_members(world_size: int) -> None:
    results = run_distributed(_members, world_size, timeout=TIMEOUT_S)
    assert [r[0] for r in results] == [(0, 1, 2, 3)] * 4
    assert [r[1] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r[2] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert all(r[3] for r in results)


def _nobody_requested(world: int) -> list[Any]:
    """Three patterns of requests against 40 stored keys: every stored key requested by
    some rank (keys of one rank only among them), some by no rank, none requested."""
    rank = dist.get_rank()
    stored = [f"k{i}" for i in range(40)]
    out = []
    for pattern in range(3):
        if pattern == 0:  # each rank requests its own stride, plus keys that are not stored
            mine = [k for i, k in enumerate(stored) if i % world == rank] + [f"extra{rank}"]
        elif pattern == 1:  # only rank 0 requests, and not the keys of multiples of 7
            mine = [k for i, k in enumerate(stored) if i % 7 and rank == 0]
        else:
            mine = []
        found = keys_nobody_requested(stored, mine, RankGroup(None))
        out.append((sorted(found), sorted(mine)))
    return out


@world_sizes(2, 4)
def test_keys_nobody_requested_are_found_by_key_owners(world_size: int) -> None:
    results = run_distributed(_nobody_requested, world_size, world_size, timeout=TIMEOUT_S)
    stored = {f"k{i}" for i in range(40)}
    for pattern in range(3):
        requested = {k for rank_result in results for k in rank_result[pattern][1]}
        expected = sorted(stored - requested)  # built here from every rank's request
        assert [r[pattern][0] for r in results] == [expected] * world_size, pattern
    assert results[0][0][0] == [] and results[0][2][0] == sorted(stored)
    assert set(results[0][1][0]) == {f"k{i}" for i in range(0, 40, 7)}
