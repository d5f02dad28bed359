"""What ``load(..., verify_integrity=True)`` adds to a load that every rank makes of the
whole checkpoint (every rank reads every data file): each data file is digested by one
of its readers (``integrity.verify_files_read``), not by every rank that reads it.

    torchrun --standalone --nproc_per_node=4 bench/integrity_load.py [--size-mib 256] [--repeat 3]

The ranks save ``--size-mib`` MiB in 16 float32 tensors, each split in row blocks over the
ranks, with ``verify_integrity=True``; then every rank loads every tensor whole (a replica
of it) from the page cache, without and with ``verify_integrity``, alternately,
``--repeat`` times each (after one untimed round). It prints the seconds of each load (slowest rank).
"""

from __future__ import annotations

import argparse

import torch
from common import bench_root, fresh_dir, init_gloo, log, measured, rank, row_sharded, world

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor

MIB = 1 << 20
TENSORS = 16


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    init_gloo(29571)
    cols = 1024
    rows = max(world(), args.size_mib * MIB // 4 // TENSORS // cols // world() * world())
    gen = torch.Generator().manual_seed(rank())
    local = {f"t{i}": torch.randn(rows // world(), cols, generator=gen) for i in range(TENSORS)}
    targets = {k: torch.empty(rows, cols) for k in local}
    with bench_root("integrity_load") as root:
        path = fresh_dir(root, "ckpt")
        dc.save(row_sharded(local), path, verify_integrity=True)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.repeat + 1):  # the first round warms up, untimed
            for verify in (False, True):
                request = {
                    k: ShardedTensor.from_rank_offsets(k, t, replica_id=rank())
                    for k, t in targets.items()
                }
                with measured() as m:
                    dc.load(request, path, validate_access_integrity=False, verify_integrity=verify)
                if i:
                    times[verify].append(m[0].seconds)
        total = TENSORS * rows * cols * 4 / MIB  # (printed before bench_root ends the group)
        log(f"{world()} rank(s), every rank reads all {total:.0f} MiB: load s (slowest rank)")
        for verify, values in times.items():
            label = "verify_integrity" if verify else "plain"
            log(f"  {label:17s} " + "  ".join(f"{t:6.3f}" for t in values))


if __name__ == "__main__":
    main()
