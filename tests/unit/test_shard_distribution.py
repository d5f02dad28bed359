"""The fully parallel distribution computed by key owners
(:mod:`dist_checkpointing.engine.shard_distribution`), simulated for many ranks in one
process, against the greedy over the whole group
(:func:`~dist_checkpointing.exchange_utils.distribute_shards_to_ranks`) run on every
rank's shards at once. The collectives themselves run in
``tests/multirank/test_fully_parallel.py``."""

from __future__ import annotations

import pickle
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing.engine.shard_distribution import (
    Distribution,
    Owned,
    Row,
    combine,
    owned,
    rows_by_owner,
)
from dist_checkpointing.exchange_utils import distribute_shards_to_ranks

ShardId = tuple[str, tuple[int, ...], tuple[int, ...]]


def simulate(per_rank: list[list[Row[Any]]], ignore_groups: bool) -> list[Distribution[Any]]:
    """Every rank's result, the collectives done by hand: the all-to-all is a transpose,
    the all-reduce a sum, the all-gather a concatenation (through pickle, as they go)."""
    world = len(per_rank)
    outgoing = [rows_by_owner(rows, world) for rows in per_rank]
    results = [
        owned([outgoing[r][o] for r in range(world)], world, ignore_groups) for o in range(world)
    ]
    loads = [sum(part[1][r] for part in results) for r in range(world)]
    sent = [pickle.loads(pickle.dumps((p.everyone, p.partial))) for p, _ in results]
    parts = [Owned(e, p) for e, p in sent]
    return [combine(per_rank[r], parts, loads, r, ignore_groups) for r in range(world)]


# A shard: which ranks hold it (a bitmask over up to 6 ranks), its bytes, and which of
# its holders holds the main replica (an index into its holders, or none).
_shards = st.lists(
    st.tuples(
        st.integers(1, 63),
        st.integers(0, 4).map(lambda e: 1 << (4 * e)),
        st.integers(-1, 5),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(world=st.integers(1, 6), shards=_shards, ignore_groups=st.booleans(), keys=st.integers(1, 5))
def test_owners_give_the_greedy_over_the_whole_group(
    world: int, shards: list[tuple[int, int, int]], ignore_groups: bool, keys: int
) -> None:
    per_rank: list[list[Row[Any]]] = [[] for _ in range(world)]
    holders: dict[ShardId, list[int]] = {}
    sizes: dict[ShardId, int] = {}
    in_group: set[ShardId] = set()
    for i, (mask, size, main_at) in enumerate(shards):
        ranks = [r for r in range(world) if mask >> r & 1] or [mask % world]
        shard_id: ShardId = (f"k{i % keys}", (i,), ())  # several shards share a key
        holders[shard_id], sizes[shard_id] = ranks, size
        for n, r in enumerate(ranks):
            per_rank[r].append((shard_id, size, n == main_at))
        if ignore_groups or 0 <= main_at < len(ranks):
            in_group.add(shard_id)
    expected = distribute_shards_to_ranks({s: holders[s] for s in in_group}, sizes, world)
    for rank, got in enumerate(simulate(per_rank, ignore_groups)):
        known = {s for s, ranks in holders.items() if rank in ranks or len(ranks) > 1}
        assert got.main_rank == {s: r for s, r in expected.items() if s in known}
        assert got.holders == {s: holders[s] for s in in_group if s in known}
        assert got.shared == {s for s, ranks in holders.items() if len(ranks) > 1}
        assert {s.shard_id for s in got.partial} == {
            s for s, ranks in holders.items() if 1 < len(ranks) < world
        }


def test_a_rank_alone_holding_many_bytes_gets_no_shared_shard() -> None:
    """The bytes a rank alone holds count in the balance although the other ranks never
    see those shards: rank 0 holds 1 GB alone, so both shared shards go to rank 1."""
    alone: Row[Any] = (("big", (0,), ()), 1 << 30, True)
    a: Row[Any] = (("a", (0,), ()), 10, True)
    b: Row[Any] = (("b", (0,), ()), 10, True)
    got = simulate([[alone, a, b], [a, b]], ignore_groups=False)
    assert got[0].main_rank == {alone[0]: 0, a[0]: 1, b[0]: 1}
    assert got[1].main_rank == {a[0]: 1, b[0]: 1}  # rank 1 never hears of "big"


def test_no_rank_receives_every_rank_rows() -> None:
    """With 64 ranks holding 50 shards of their own each and 10 shared by all, an owner
    receives the rows of its keys only, and every rank learns 10 shared shards, not
    64 x 50 rows."""
    world = 64
    shared_rows: list[Row[Any]] = [((f"p{i}", (0,), ()), 100, False) for i in range(10)]
    per_rank = [
        [((f"opt{r}.{i}", (0,), ()), 4, True) for i in range(50)] + shared_rows
        for r in range(world)
    ]
    outgoing = [rows_by_owner(rows, world) for rows in per_rank]
    busiest = max(sum(len(outgoing[r][o]) for r in range(world)) for o in range(world))
    assert busiest < world * 60 // 4
    for got in simulate(per_rank, ignore_groups=True):
        assert len(got.shared) == 10
        assert len(got.main_rank) == 60
        # Held by every rank: no list of holders travels (nor is kept) for each.
        assert got.partial == []
        assert all(got.holders[s] is got.holders[shared_rows[0][0]] for s in got.shared)
