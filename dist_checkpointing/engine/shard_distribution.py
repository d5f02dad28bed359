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
2. each owner groups the rows it received (:func:`owned`): the shards held by more than
   one rank (:class:`Shared`: id, bytes, holders, whether it is distributed), and, by
   holder, the bytes of the shards one rank alone holds;
3. ``all_reduce`` of those bytes by holder (``world`` integers);
4. ``all_gather`` of the owners' shared shards;
5. every rank runs the same greedy over the shared shards from those loads
   (:func:`assign_shared`): the same assignment as the greedy over every shard.

Cost per rank, with ``T`` its shards, ``S`` the shards held by several ranks and ``W``
the ranks: ``O(T + S log S + W)`` work and objects (the holders of a shard every rank
holds are ``range(W)``, sent and kept in constant space), plus an ``argmin`` over ``W``
loads (numpy) for each shard every rank holds. Gathering every rank's rows, as before
(and as Megatron-Core gathers every rank's ShardedTensors), made every rank unpickle and
walk ``W x T`` rows.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from .collectives import RankGroup
from .sharding_split import key_owner

Id = TypeVar("Id", bound=Hashable)

# A shard's row: (id, bytes, whether the sending rank holds its main replica). An id is
# a tuple whose first element is the shard's key (the owner is chosen by the key).
Row = tuple[Id, int, bool]

# Above this many holders, the least loaded one is found with numpy.
_VECTOR_HOLDERS = 32


@dataclass(frozen=True)
class Shared(Generic[Id]):
    """A shard held by more than one rank of the group."""

    shard_id: Id
    size: int  # bytes (as the lowest holding rank counts them)
    # Group ranks, ascending: ``range(world)`` for a shard every rank holds (a
    # replicated parameter), which travels and is kept in O(1), not O(world).
    holders: tuple[int, ...] | range
    distributed: bool  # its main replica is in the group, or the caller ignores groups


@dataclass
class Distribution(Generic[Id]):
    """One rank's result of :func:`distribute`: the handling rank of each distributed
    shard this rank holds, and of each distributed shard several ranks hold (with their
    holders); ``shared`` lists every shard several ranks hold, distributed or not.
    The shards every rank holds share one holders list (read it, do not change it)."""

    main_rank: dict[Id, int]
    holders: dict[Id, list[int]]
    shared: list[Shared[Id]]


def rows_by_owner(rows: Sequence[Row[Id]], world: int) -> list[list[Row[Id]]]:
    """Step 1: this rank's rows, one list per owner rank."""
    out: list[list[Row[Id]]] = [[] for _ in range(world)]
    for row in rows:
        out[key_owner(row[0][0], world)].append(row)  # type: ignore[index]
    return out


def owned(
    received: Sequence[Sequence[Row[Id]]], world: int, ignore_groups: bool
) -> tuple[list[Shared[Id]], list[int]]:
    """Step 2, on an owner: ``received[r]`` is what rank ``r`` sent it. Returns the shards
    held by several ranks, and the bytes by holder of the distributed shards that one
    rank alone holds."""
    holders: dict[Id, list[int]] = {}
    size: dict[Id, int] = {}
    main: dict[Id, bool] = {}
    for rank, rows in enumerate(received):
        for shard_id, nbytes, is_main in rows:
            ranks = holders.get(shard_id)
            if ranks is None:
                holders[shard_id] = [rank]
                size[shard_id] = nbytes
                main[shard_id] = is_main
                continue
            if ranks[-1] != rank:  # a rank lists each shard once, but be safe
                ranks.append(rank)
            main[shard_id] = main[shard_id] or is_main
    loads = [0] * world
    shared: list[Shared[Id]] = []
    for shard_id, ranks in holders.items():
        distributed = ignore_groups or main[shard_id]
        if len(ranks) > 1:
            held = range(world) if len(ranks) == world else tuple(ranks)
            shared.append(Shared(shard_id, size[shard_id], held, distributed))
        elif distributed:
            loads[ranks[0]] += size[shard_id]
    return shared, loads


def _order(s: Shared[Id]) -> tuple[int, int, Id]:
    return (len(s.holders), -s.size, s.shard_id)


def assign_shared(shared: Sequence[Shared[Id]], loads: Sequence[int]) -> dict[Id, int]:
    """Step 5: the handling rank of each distributed shared shard, starting from the
    ``loads`` (bytes by rank) of the shards one rank alone holds. Every rank computes the
    same result from the same input, in any order."""
    world = len(loads)
    load = np.asarray(loads, dtype=np.int64)
    out: dict[Id, int] = {}
    for s in sorted((s for s in shared if s.distributed), key=_order):
        h = s.holders
        if len(h) == world:
            rank = int(np.argmin(load))  # the first least loaded: ties to the lowest rank
        elif len(h) > _VECTOR_HOLDERS:
            rank = h[int(np.argmin(load[np.asarray(h)]))]
        else:
            rank = min(h, key=lambda r: (load[r], r))
        out[s.shard_id] = rank
        load[rank] += s.size
    return out


def combine(
    rows: Sequence[Row[Id]],
    shared: Sequence[Shared[Id]],
    loads: Sequence[int],
    rank: int,
    ignore_groups: bool,
) -> Distribution[Id]:
    """Rank ``rank``'s :class:`Distribution`, from its own ``rows``, every owner's
    ``shared`` shards and the summed ``loads`` (steps 4 and 5)."""
    main_rank = assign_shared(shared, loads)
    everyone = list(range(len(loads)))  # one list for every shard all ranks hold
    holders = {
        s.shard_id: everyone if isinstance(s.holders, range) else list(s.holders)
        for s in shared
        if s.distributed
    }
    several = {s.shard_id for s in shared}
    for shard_id, _, is_main in rows:  # held by this rank alone: handled by it
        if (ignore_groups or is_main) and shard_id not in several:
            main_rank[shard_id] = rank
            holders[shard_id] = [rank]
    return Distribution(main_rank, holders, list(shared))


def distribute(rows: Sequence[Row[Id]], group: RankGroup, ignore_groups: bool) -> Distribution[Id]:
    """(Collective) This rank's view of the distribution of the shards the group's
    ranks hold, from this rank's ``rows`` (one per shard it holds); see the module
    docstring."""
    received = group.all_to_all(rows_by_owner(rows, group.world))
    shared, loads = owned(received, group.world, ignore_groups)
    loads = group.all_reduce_ints(loads)
    every_shared = [s for part in group.all_gather(shared) for s in part]
    return combine(rows, every_shared, loads, group.rank, ignore_groups)


__all__ = [
    "Distribution",
    "Row",
    "Shared",
    "assign_shared",
    "combine",
    "distribute",
    "owned",
    "rows_by_owner",
]
