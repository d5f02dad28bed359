"""Distributing shards over the ranks of a group and exchanging what they loaded.

Megatron-Core's ``dist_checkpointing.exchange_utils`` module path. Used by the
fully parallel strategies (:mod:`.strategies.fully_parallel`):

1. every rank of the group learns which ranks hold the shards it holds and every
   shard that several ranks hold, and the bytes each rank holds alone
   (:func:`~.engine.shard_distribution.distribute`: each shard's row goes to the rank
   that owns its key, never to every rank; the data-less ShardedTensor of a shard
   several ranks hold only travels to the ranks that lack it, in a gather made only
   where some shard is held by several ranks but not by all);
2. every rank computes the same size-balanced assignment of each shard to one of the
   ranks that hold it, the greedy of :func:`distribute_shards_to_ranks` (deterministic,
   so nothing else is exchanged);
3. at load, each shard is read by its assigned rank only, then sent to the other
   ranks that need it (:func:`exchange_by_distribution`: ``broadcast``, the default,
   packs the shards of each loading rank into broadcasts of up to
   ``EXCHANGE_BUCKET_BYTES``; ``gather_object`` or ``gather_rounds``).

Collectives run on the group's device (CUDA for NCCL, CPU for gloo) and move
each tensor as its bytes, so every dtype travels (gloo refuses FP8 tensors);
exchanged tensors arrive on the CPU.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections import defaultdict
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from itertools import zip_longest
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from ._shard_transfer import as_bytes, deliver, direct_target, shard_shape
from .dict_utils import nested_values
from .engine import knobs
from .engine.collectives import RankGroup
from .engine.shard_distribution import Shared, distribute
from .errors import CheckpointingException, InvalidArgumentError
from .mapping import ShardedStateDict, ShardedTensor, is_main_replica
from .utils import _sharded_tensor_shard_id, _ShardId

logger = logging.getLogger(__name__)

# Whether Transformer Engine (whose Float8Tensor this module recognises) is installed;
# only looked up, never imported.
HAVE_TE_FLOAT8TENSOR = importlib.util.find_spec("transformer_engine") is not None


def is_float8tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a Transformer Engine ``Float8Tensor`` (recognised by its
    class, without importing Transformer Engine). Plain tensors of a float8 dtype are
    not: they exchange like any other tensor."""
    return any(
        cls.__name__ == "Float8Tensor" and cls.__module__.startswith("transformer_engine")
        for cls in type(tensor).__mro__
    )


T = TypeVar("T")

ProcessGroup = dist.ProcessGroup | None


class ShardDistribution(NamedTuple):
    """Which rank of a parallelization group handles each shard.

    ``main_rank_for_shard``: the group rank that saves (or loads) each shard;
    ``shards_in_this_group``: the shards whose main replica is in this group;
    ``shard_to_metadata``: a data-less ShardedTensor describing each shard;
    ``all_ranks_for_shard``: the group ranks that hold (or need) each shard.

    Each rank's distribution lists the shards it holds and every shard that several
    ranks of the group hold; not a shard another rank alone holds (that rank handles
    it, and nothing about it is exchanged). Megatron-Core lists every shard of the
    group on every rank, which costs every rank ``O(ranks x shards)``.
    """

    main_rank_for_shard: dict[_ShardId, int]
    shards_in_this_group: set[_ShardId]
    shard_to_metadata: dict[_ShardId, ShardedTensor]
    all_ranks_for_shard: dict[_ShardId, list[int]]


def _shard_size(sh_ten: ShardedTensor) -> int:
    """Bytes of one shard's data."""
    return math.prod(shard_shape(sh_ten)) * sh_ten.dtype.itemsize


def distribute_shards_to_ranks(
    shard_to_ranks: dict[T, list[int]],
    shard_to_size: dict[T, int],
    num_ranks: int,
    cross_parallelization_group_loads: AbstractSet[T] = frozenset(),
) -> dict[T, int]:
    """Assign each shard to one of the ranks that have it, balancing bytes per rank.

    Greedy and deterministic (every rank computes the same result): shards in
    ``cross_parallelization_group_loads`` (loads whose main replica lies in another
    group) last, so that load and save assignments stay alike; then shards
    available on fewer ranks first, then larger shards first, then by id; each
    goes to the least loaded of its ranks (ties to the lowest rank).
    """
    load = [0] * num_ranks
    assignment: dict[T, int] = {}
    cross = cross_parallelization_group_loads
    order = sorted(
        shard_to_ranks.items(),
        key=lambda kv: (int(kv[0] in cross), len(kv[1]), -shard_to_size[kv[0]], kv[0]),
    )
    for shard_id, ranks in order:
        rank = min(set(ranks), key=lambda r: (load[r], r))
        assignment[shard_id] = rank
        load[rank] += shard_to_size[shard_id]
    logger.debug("shard distribution: bytes per rank %s", load)
    return assignment


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group: ProcessGroup,
    ignore_groups: bool = False,
) -> ShardDistribution | None:
    """The distribution of this state dict's ShardedTensors over the group (collective).

    Args:
        sharded_state_dict: this rank's state dict.
        parallelization_group: the ranks that share the work.
        ignore_groups: distribute every shard held in the group, also those whose
            main replica is elsewhere (for loads: every replica must be filled).

    Returns:
        The distribution, or None for a group of one rank.
    """
    group = RankGroup(parallelization_group)
    if not group.distributed:
        return None
    local: dict[_ShardId, ShardedTensor] = {}
    main: dict[_ShardId, bool] = {}
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            shard_id = _sharded_tensor_shard_id(sh)
            local.setdefault(shard_id, sh)
            main[shard_id] = main.get(shard_id, False) or is_main_replica(sh.replica_id)
    rows = [(shard_id, _shard_size(sh), main[shard_id]) for shard_id, sh in local.items()]
    found = distribute(rows, group, ignore_groups)
    metadata = _shard_metadata(local, found.partial, group)
    return ShardDistribution(found.main_rank, set(found.main_rank), metadata, found.holders)


def _shard_metadata(
    local: dict[_ShardId, ShardedTensor],
    partial: list[Shared[_ShardId]],
    group: RankGroup,
) -> dict[_ShardId, ShardedTensor]:
    """A data-less ShardedTensor for every shard this rank holds and every shard several
    ranks hold: for those some rank lacks (``partial``), the one sent by their lowest
    holding rank (one ``all_gather_object``, made only where there are such shards;
    every rank decides that alike, from the same shared shards)."""
    metadata = {shard_id: sh.without_data() for shard_id, sh in local.items()}
    if not partial:
        return metadata
    mine = {s.shard_id: metadata[s.shard_id] for s in partial if s.holders[0] == group.rank}
    for sent in group.all_gather(mine):
        for shard_id, sh in sent.items():
            metadata.setdefault(shard_id, sh)
    return metadata


# --------------------------------------------------------------------------- exchange


def _exchanged(distribution: ShardDistribution) -> list[tuple[_ShardId, int]]:
    """``(shard, loading rank)`` of every shard needed by more than its loading rank,
    in an order every rank agrees on."""
    return sorted(
        (shard_id, rank)
        for shard_id, rank in distribution.main_rank_for_shard.items()
        if len(distribution.all_ranks_for_shard[shard_id]) > 1
    )


# Shards packed into one broadcast start at multiples of this (any dtype views them).
_ALIGN = 64
# A shard at least this large (or a sixteenth of the bucket size) travels alone, straight
# from the loaded tensor into the destination tensor, with no packing copy.
_DIRECT_BYTES = 4 << 20

_Bucket = tuple[int, int, list[tuple[_ShardId, int, int]]]


def _broadcast_buckets(distribution: ShardDistribution) -> list[_Bucket]:
    """The broadcasts of an exchange: ``(owner, bytes, [(shard, offset, size), ...])``,
    each the consecutive shards of one loading rank up to ``EXCHANGE_BUCKET_BYTES``; a
    large shard alone. Every rank computes the same list."""
    by_owner: dict[int, list[_ShardId]] = defaultdict(list)
    for shard_id, owner in _exchanged(distribution):
        by_owner[owner].append(shard_id)
    limit = knobs.EXCHANGE_BUCKET_BYTES.get()
    alone = min(_DIRECT_BYTES, max(1, limit // 16))
    buckets: list[_Bucket] = []
    for owner in sorted(by_owner):
        entries: list[tuple[_ShardId, int, int]] = []
        pos = 0
        for shard_id in by_owner[owner]:
            size = _shard_size(distribution.shard_to_metadata[shard_id])
            if size >= alone:
                buckets.append((owner, size, [(shard_id, 0, size)]))
                continue
            if entries and pos + size > limit:
                buckets.append((owner, pos, entries))
                entries, pos = [], 0
            entries.append((shard_id, pos, size))
            pos += -(-size // _ALIGN) * _ALIGN
        if entries:
            buckets.append((owner, pos, entries))
    return buckets


def _send_or_receive_alone(
    owner: int,
    shard_id: _ShardId,
    size: int,
    loaded_tensors: dict[_ShardId, torch.Tensor],
    unloaded_shards: dict[_ShardId, ShardedTensor],
    group: RankGroup,
    result: dict[_ShardId, torch.Tensor],
) -> None:
    """One broadcast of one large shard: from the loaded tensor, into the destination."""
    if owner == group.rank:
        data = as_bytes(loaded_tensors[shard_id]).to(group.device)
        dist.broadcast(data, src=group.global_rank(owner), group=group.group)
        return
    sh = unloaded_shards.get(shard_id)
    target = direct_target(sh, size, group.device)
    buffer = (
        as_bytes(target)
        if target is not None
        else torch.empty(size, dtype=torch.uint8, device=group.device)
    )
    dist.broadcast(buffer, src=group.global_rank(owner), group=group.group)
    if target is not None:
        result[shard_id] = target
    elif sh is not None:  # a strided or host destination: copied into it
        deliver(buffer, [(shard_id, 0, size)], {shard_id: sh}, result)


@torch.no_grad()
def exchange_loaded_tensors_broadcast(
    loaded_tensors: dict[_ShardId, torch.Tensor],
    unloaded_shards: dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: ProcessGroup = None,
) -> dict[_ShardId, torch.Tensor]:
    """Broadcasts from the rank that loaded each shard that several ranks need: small
    shards of one rank packed together up to ``EXCHANGE_BUCKET_BYTES`` per broadcast (one
    collective per shard costs milliseconds each on gloo: minutes for 100,000), large ones
    alone, received straight into their destination tensor where it is contiguous.

    Returns ``loaded_tensors`` plus every shard of ``unloaded_shards``: its destination
    tensor, filled, where the request has one; else a tensor on the CPU.
    """
    group = RankGroup(parallelization_group)
    result = dict(loaded_tensors)
    for owner, total, entries in _broadcast_buckets(shard_distribution):
        if len(entries) == 1:  # one shard (every rank sees the same): no packing
            shard_id, _, size = entries[0]
            _send_or_receive_alone(
                owner, shard_id, size, loaded_tensors, unloaded_shards, group, result
            )
            continue
        bucket = torch.empty(total, dtype=torch.uint8, device=group.device)
        if owner == group.rank:
            for shard_id, offset, size in entries:
                bucket[offset : offset + size].copy_(as_bytes(loaded_tensors[shard_id]))
        dist.broadcast(bucket, src=group.global_rank(owner), group=parallelization_group)
        if owner == group.rank:
            continue
        deliver(bucket, entries, unloaded_shards, result)
    return result


def _merge_once(per_rank: list[dict[_ShardId, T]], what: str) -> dict[_ShardId, T]:
    """One dict of every rank's entries; an id loaded by two ranks is an error."""
    everything: dict[_ShardId, T] = {}
    for entries in per_rank:
        duplicates = set(everything) & set(entries)
        if duplicates:
            raise CheckpointingException(
                f"{what} loaded by more than one rank: {sorted(map(str, duplicates))[:5]}"
            )
        everything.update(entries)
    return everything


def exchange_loaded_tensors_gather_object(
    loaded_tensors: dict[_ShardId, torch.Tensor],
    unloaded_shards: dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: ProcessGroup = None,
) -> dict[_ShardId, torch.Tensor]:
    """Every rank's loaded tensors to every rank in one ``all_gather_object`` (simple,
    memory hungry: meant for debugging and small states)."""
    group = RankGroup(parallelization_group)
    # Bytes, not tensors: some dtypes (FP8) do not pickle through the object collectives.
    shared = {k: bytes(as_bytes(v).cpu().numpy()) for k, v in loaded_tensors.items()}
    everything: dict[_ShardId, bytes] = _merge_once(group.all_gather(shared), "shards")
    result = dict(loaded_tensors)
    for shard_id, sh in unloaded_shards.items():
        if shard_id in everything:
            data = everything[shard_id]
            raw = (  # (frombuffer refuses an empty buffer: a tensor with a 0-size dim)
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if data
                else torch.empty(0, dtype=torch.uint8)
            )
            deliver(raw, [(shard_id, 0, len(data))], {shard_id: sh}, result)
    return result


def exchange_loaded_objects_gather_object(
    loaded_objects: dict[_ShardId, Any], *, parallelization_group: ProcessGroup = None
) -> dict[_ShardId, Any]:
    """Every rank's loaded ShardedObject payloads to every rank (``all_gather_object``).

    Raises:
        CheckpointingException: two ranks loaded the same object.
    """
    gathered = RankGroup(parallelization_group).all_gather(loaded_objects)
    return _merge_once(gathered, "objects")


@torch.no_grad()
def exchange_loaded_tensors_gather_rounds(
    loaded_tensors: dict[_ShardId, torch.Tensor],
    unloaded_shards: dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution | None = None,
    parallelization_group: ProcessGroup = None,
) -> dict[_ShardId, torch.Tensor]:
    """Exchange in rounds of ``all_gather``: in round ``i`` every rank contributes the
    bytes of its ``i``-th shard (padded to the round's largest)."""
    if shard_distribution is None:
        raise InvalidArgumentError("exchange_loaded_tensors_gather_rounds needs a distribution")
    group = RankGroup(parallelization_group)
    result = dict(loaded_tensors)
    metadata = shard_distribution.shard_to_metadata
    # Every tensor travels as bytes, so one sequence of rounds serves all dtypes.
    by_rank: list[list[_ShardId]] = [[] for _ in range(group.world)]
    for shard_id, owner in _exchanged(shard_distribution):
        by_rank[owner].append(shard_id)
    for round_ids in zip_longest(*by_rank):
        _gather_round(round_ids, loaded_tensors, unloaded_shards, metadata, group, result)
    return result


def _gather_round(
    round_ids: tuple[_ShardId | None, ...],
    loaded_tensors: dict[_ShardId, torch.Tensor],
    unloaded_shards: dict[_ShardId, ShardedTensor],
    metadata: dict[_ShardId, ShardedTensor],
    group: RankGroup,
    result: dict[_ShardId, torch.Tensor],
) -> None:
    """One all-gather: rank ``r`` contributes the bytes of ``round_ids[r]``, padded to
    the round's largest shard."""
    sizes = [0 if s is None else _shard_size(metadata[s]) for s in round_ids]
    width = max(sizes)
    buffers = [torch.zeros(width, dtype=torch.uint8, device=group.device) for _ in round_ids]
    mine = round_ids[group.rank]
    if mine is not None:
        buffers[group.rank][: sizes[group.rank]].copy_(as_bytes(loaded_tensors[mine]))
    dist.all_gather(buffers, buffers[group.rank], group=group.group)
    for rank, shard_id in enumerate(round_ids):
        if shard_id is None or rank == group.rank or shard_id not in unloaded_shards:
            continue
        entry = [(shard_id, 0, sizes[rank])]
        deliver(buffers[rank], entry, {shard_id: unloaded_shards[shard_id]}, result)


_EXCHANGES: dict[str, Callable[..., dict[_ShardId, torch.Tensor]]] = {
    "broadcast": exchange_loaded_tensors_broadcast,
    "gather_object": exchange_loaded_tensors_gather_object,
    "gather_rounds": exchange_loaded_tensors_gather_rounds,
}


def exchange_by_distribution(
    loaded_tensors: dict[_ShardId, torch.Tensor],
    unloaded_shards: dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: ProcessGroup = None,
    exchange_algo: str = "broadcast",
) -> dict[_ShardId, torch.Tensor]:
    """Exchange loaded tensors with ``exchange_algo`` (``broadcast``, ``gather_object``
    or ``gather_rounds``); returns the tensors this rank needs, by shard id."""
    exchange = _EXCHANGES.get(exchange_algo)
    if exchange is None:
        raise InvalidArgumentError(
            f"unknown exchange_algo {exchange_algo!r}; choose one of {sorted(_EXCHANGES)}"
        )
    return exchange(loaded_tensors, unloaded_shards, shard_distribution, parallelization_group)


__all__ = [
    "ShardDistribution",
    "determine_main_replica_uniform_distribution",
    "distribute_shards_to_ranks",
    "exchange_by_distribution",
    "exchange_loaded_objects_gather_object",
    "exchange_loaded_tensors_broadcast",
    "exchange_loaded_tensors_gather_object",
    "exchange_loaded_tensors_gather_rounds",
]
