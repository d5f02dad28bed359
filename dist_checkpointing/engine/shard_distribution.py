"""Which rank of a group handles each shard, computed without any rank seeing every
rank's shards.

The fully parallel strategies split the work on the shards a group's ranks hold: each
shard goes to one of its holders, balancing bytes with the greedy of
:func:`~dist_checkpointing.exchange_utils.distribute_shards_to_ranks` (shards held by
fewer ranks first, then larger ones, then by id; each to its least loaded holder, ties
to the lowest rank). That greedy needs little of the whole picture: a shard that one
rank alone holds goes to that rank whatever the loads, and all such shards come first
in its order, so they only add their bytes to their holder's load; the shards held by
several ranks (few: replicated parameters, not a distributed optimizer's ranges) are
the only ones whose ids every rank has to know.

Collective steps of :func:`distribute` (every rank of the group makes each call):

1. ``all_to_all``: each rank sends the row ``(id, bytes, main replica)`` of each of
   its shards to the shard's *owner*, the rank :func:`~.sharding_split.key_owner`
   gives its key (:func:`rows_by_owner`);
2. each owner groups the rows it received (:func:`owned`): the shards every rank holds
   (``Everyone``: id, bytes, whether it is distributed), those held by several ranks but
   not all (:class:`Shared`, with their holders), and, by holder, the bytes of the
   shards one rank alone holds;
3. ``all_reduce`` of those bytes by holder (``world`` integers);
4. ``all_gather`` of the owners' shared shards (plain tuples);
5. every rank runs the same greedy over the shared shards from those loads
   (:func:`assign_shared`): the same assignment as the greedy over every shard. The
   shards every rank holds come last in its order, and for them the least loaded rank
   is the top of a heap of the ranks' loads.

Cost per rank, with ``T`` its shards, ``S`` the shards held by several ranks and ``W``
the ranks: ``O(T + S log S + S log W + W)`` work and ``O(T + S + W)`` objects (a shard
every rank holds carries no list of holders; its ``all_ranks_for_shard`` entry is one
list shared by all such shards). Gathering every rank's rows, as before (and as
Megatron-Core gathers every rank's ShardedTensors), made every rank unpickle and walk
``W x T`` rows.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from .collectives import RankGroup
from .sharding_split import key_owner

Id = TypeVar("Id", bound=Hashable)

# A shard's row: (id, bytes, whether the sending rank holds its main replica). An id is
# a tuple whose first element is the shard's key (the owner is chosen by the key).
Row = tuple[Id, int, bool]

# A shard every rank of the group holds: (id, bytes, distributed). Plain tuples: an
# owner sends one per replicated parameter, and they pickle several times faster than
# objects of a class.
Everyone = tuple[Id, int, bool]


class Shared(NamedTuple, Generic[Id]):
    """A shard held by more than one rank of the group, but not by all."""

    shard_id: Id
    size: int  # bytes (as the lowest holding rank counts them)
    holders: tuple[int, ...]  # group ranks, ascending
    distributed: bool  # its main replica is in the group, or the caller ignores groups


@dataclass
class Owned(Generic[Id]):
    """What one owner found among the rows of its keys (step 2)."""

    everyone: list[Everyone[Id]] = field(default_factory=list)
    partial: list[Shared[Id]] = field(default_factory=list)


@dataclass
class Distribution(Generic[Id]):
    """One rank's result of :func:`distribute`: the handling rank of each distributed
    shard this rank holds, and of each distributed shard several ranks hold (with their
    holders); ``shared``: the ids of every shard several ranks hold, distributed or not;
    ``partial``: those not every rank holds. The shards every rank holds share one
    holders list (read it, do not change it)."""

    main_rank: dict[Id, int]
    holders: dict[Id, list[int]]
    shared: set[Id]
    partial: list[Shared[Id]]


def rows_by_owner(rows: Sequence[Row[Id]], world: int) -> list[list[Row[Id]]]:
    """Step 1: this rank's rows, one list per owner rank."""
    out: list[list[Row[Id]]] = [[] for _ in range(world)]
    for row in rows:
        out[key_owner(row[0][0], world)].append(row)  # type: ignore[index]
    return out


def owned(
    received: Sequence[Sequence[Row[Id]]], world: int, ignore_groups: bool
) -> tuple[Owned[Id], list[int]]:
    """Step 2, on an owner: ``received[r]`` is what rank ``r`` sent it. Returns the shards
    held by several ranks, and the bytes by holder of the distributed shards that one
    rank alone holds."""
    holders: dict[Id, list[int]] = {}
    first: dict[Id, tuple[int, bool]] = {}  # bytes (the lowest holder's), any main replica
    for rank, rows in enumerate(received):
        for shard_id, nbytes, is_main in rows:
            ranks = holders.get(shard_id)
            if ranks is None:
                holders[shard_id] = [rank]
                first[shard_id] = (nbytes, is_main)
            elif ranks[-1] != rank:  # a rank lists each shard once, but be safe
                ranks.append(rank)
                if is_main:
                    first[shard_id] = (first[shard_id][0], True)
    loads = [0] * world
    out: Owned[Id] = Owned()
    for shard_id, ranks in holders.items():
        size, main = first[shard_id]
        distributed = ignore_groups or main
        if len(ranks) == world and world > 1:
            out.everyone.append((shard_id, size, distributed))
        elif len(ranks) > 1:
            out.partial.append(Shared(shard_id, size, tuple(ranks), distributed))
        elif distributed:
            loads[ranks[0]] += size
    return out, loads


def _partial_order(s: Shared[Id]) -> tuple[int, int, Id]:
    return (len(s.holders), -s.size, s.shard_id)


def _everyone_order(e: Everyone[Id]) -> tuple[int, Id]:
    return (-e[1], e[0])


def assign_shared(
    partial: Sequence[Shared[Id]], everyone: Sequence[Everyone[Id]], loads: Sequence[int]
) -> dict[Id, int]:
    """Step 5: the handling rank of each distributed shared shard, starting from the
    ``loads`` (bytes by rank) of the shards one rank alone holds: the greedy's order
    (fewer holders first, then larger, then by id), so the shards all ranks hold come
    last. Every rank computes the same result from the same input, in any order."""
    world = len(loads)
    load = list(loads)
    out: dict[Id, int] = {}
    for s in sorted((s for s in partial if s.distributed), key=_partial_order):
        rank = min(s.holders, key=load.__getitem__)  # ascending: ties to the lowest rank
        out[s.shard_id] = rank
        load[rank] += s.size
    # Every rank a candidate: the least loaded, ties to the lowest, is the heap's top.
    heap = [(load[r], r) for r in range(world)]
    heapq.heapify(heap)
    for shard_id, size, distributed in sorted(everyone, key=_everyone_order):
        if not distributed:
            continue
        total, rank = heap[0]
        out[shard_id] = rank
        heapq.heapreplace(heap, (total + size, rank))
    return out


def combine(
    rows: Sequence[Row[Id]],
    parts: Sequence[Owned[Id]],
    loads: Sequence[int],
    rank: int,
    ignore_groups: bool,
) -> Distribution[Id]:
    """Rank ``rank``'s :class:`Distribution`, from its own ``rows``, every owner's
    shared shards (``parts``) and the summed ``loads`` (steps 4 and 5)."""
    everyone = [e for part in parts for e in part.everyone]
    partial = [s for part in parts for s in part.partial]
    main_rank = assign_shared(partial, everyone, loads)
    all_ranks = list(range(len(loads)))  # one list for every shard all ranks hold
    holders = {e[0]: all_ranks for e in everyone if e[2]}
    holders.update((s.shard_id, list(s.holders)) for s in partial if s.distributed)
    shared = {e[0] for e in everyone}
    shared.update(s.shard_id for s in partial)
    for shard_id, _, is_main in rows:  # held by this rank alone: handled by it
        if (ignore_groups or is_main) and shard_id not in shared:
            main_rank[shard_id] = rank
            holders[shard_id] = [rank]
    return Distribution(main_rank, holders, shared, partial)


def distribute(rows: Sequence[Row[Id]], group: RankGroup, ignore_groups: bool) -> Distribution[Id]:
    """(Collective) This rank's view of the distribution of the shards the group's
    ranks hold, from this rank's ``rows`` (one per shard it holds); see the module
    docstring."""
    received = group.all_to_all(rows_by_owner(rows, group.world))
    mine, loads = owned(received, group.world, ignore_groups)
    loads = group.all_reduce_ints(loads)
    parts = group.all_gather((mine.everyone, mine.partial))
    return combine(rows, [Owned(e, p) for e, p in parts], loads, group.rank, ignore_groups)


__all__ = [
    "Distribution",
    "Everyone",
    "Owned",
    "Row",
    "Shared",
    "assign_shared",
    "combine",
    "distribute",
    "owned",
    "rows_by_owner",
]
