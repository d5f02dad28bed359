"""The fully parallel distribution at scale, simulated in one process.

    python bench/fp_distribution_scale.py [--ranks 64 256 1024 4096] [--tensors 1000]
                                          [--optimizer [every-rank|buffer]] [--no-memory]
                                          [--skip-old]

A fully parallel save or load first decides which rank of the parallelization group
(the data-parallel group: here ``ranks / 8`` ranks, with TP=8) handles each shard
(``determine_main_replica_uniform_distribution``). The layout is
``planning_scale.py``'s: every data-parallel rank holds the same row block of each
model tensor (main replica on data-parallel rank 0), and with ``--optimizer`` two
distributed-optimizer flat ranges of each that it alone holds (``--optimizer buffer``:
of the blocks its part of Megatron-Core's optimizer buffer meets). For each step this
prints the CPU time of the rank that does the most work and (unless ``--no-memory``)
the peak memory the step allocates (tracemalloc, a second pass); the collectives'
transfers are not simulated, their bytes are printed.

- ``rows (rank)``: one rank's rows, binned by owner and pickled for the all-to-all
  (``rows_by_owner``);
- ``owner (busiest)``: the owner receiving the most rows unpickles them and groups
  them (``owned``);
- ``combine (rank)``: a rank unpickles every owner's shared shards and runs the
  greedy over them (``combine``);
- ``= distribution (rank)``: the sum of the three;
- ``gathered (old)``: the distribution as it was (and as Megatron-Core computes it):
  every rank unpickles every rank's rows, groups them by shard and runs
  ``distribute_shards_to_ranks`` over every shard of the group (the script checks that
  it assigns the shards a rank knows as the owners' way does).
"""

from __future__ import annotations

import math
import pickle
from collections import defaultdict
from typing import Any

from planning_scale import TP, measure, param_keys, rank_records, row, scale_args

from dist_checkpointing.engine.shard_distribution import Owned, Row, combine, owned, rows_by_owner
from dist_checkpointing.exchange_utils import distribute_shards_to_ranks


def group_rows(dp: int, dp_size: int, keys: list[str], optimizer: bool) -> list[Row[Any]]:
    """The rows of data-parallel rank ``dp`` of the group of tensor-parallel rank 0."""
    out = []
    for r in rank_records(dp * TP, dp_size * TP, keys, optimizer):
        flat = () if r.flat is None else tuple(r.flat)
        numel = flat[1] - flat[0] if flat else math.prod(r.chunk_shape)
        out.append(((r.key, tuple(r.global_offset), flat), numel * 4, bool(r.is_main)))
    return out


def old_way(gathered: list[bytes], world: int) -> dict[Any, int]:
    shard_to_ranks: dict[Any, list[int]] = defaultdict(list)
    size: dict[Any, int] = {}
    in_group: set[Any] = set()
    for rank, blob in enumerate(gathered):
        for shard_id, nbytes, is_main in pickle.loads(blob):
            shard_to_ranks[shard_id].append(rank)
            size.setdefault(shard_id, nbytes)
            if is_main:
                in_group.add(shard_id)
    ranks = {k: v for k, v in shard_to_ranks.items() if k in in_group}
    return distribute_shards_to_ranks(ranks, size, world)


def run(world: int, keys: list[str], optimizer: bool, memory: bool, old: bool) -> None:
    group = world // TP
    per_rank = [group_rows(d, group, keys, optimizer) for d in range(group)]
    blobs = [pickle.dumps(rows, protocol=5) for rows in per_rank]
    mine = per_rank[0]
    seconds, peak, _ = measure(
        lambda: [pickle.dumps(p, protocol=5) for p in rows_by_owner(mine, group)], memory
    )
    row(world, "rows (rank)", seconds, peak)
    total = seconds
    outgoing = [rows_by_owner(rows, group) for rows in per_rank]
    received = [sum(len(outgoing[r][o]) for r in range(group)) for o in range(group)]
    busiest = max(range(group), key=received.__getitem__)
    inbox = [pickle.dumps(outgoing[r][busiest], protocol=5) for r in range(group)]
    seconds, peak, _ = measure(
        lambda: owned([pickle.loads(b) for b in inbox], group, False), memory
    )
    row(world, f"owner ({received[busiest]} rows)", seconds, peak)
    total += seconds
    parts = [owned([outgoing[r][o] for r in range(group)], group, False) for o in range(group)]
    loads = [sum(p[1][r] for p in parts) for r in range(group)]
    shared = [pickle.dumps((p[0].everyone, p[0].partial), protocol=5) for p in parts]

    def finish() -> Any:
        received = [Owned(*pickle.loads(blob)) for blob in shared]
        return combine(mine, received, loads, 0, False)

    seconds, peak, got = measure(finish, memory)
    row(world, f"combine ({sum(map(len, shared)) >> 10} KiB in)", seconds, peak)
    row(world, "= distribution (rank)", total + seconds, None)
    if old:  # last: its memory pass would slow the steps after it
        seconds, peak, expected = measure(lambda: old_way(blobs, group), memory)
        row(world, f"gathered (old, {sum(map(len, blobs)) >> 20} MiB)", seconds, peak)
        known = {s for s, _, _ in mine} | got.shared
        assert got.main_rank == {s: r for s, r in expected.items() if s in known}


def main() -> None:
    args = scale_args(__doc__ or "", "the gathered distribution")
    if args is None:
        return
    keys = param_keys(args.tensors)
    for world in args.ranks:
        if world % TP or world < 2 * TP:
            raise SystemExit(f"--ranks must be multiples of {TP}, at least {2 * TP}")
        run(world, keys, args.optimizer, not args.no_memory, not args.skip_old)


if __name__ == "__main__":
    main()
