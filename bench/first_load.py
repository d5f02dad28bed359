"""A process's first load against its later ones, ``torch_dist`` layout.

    torchrun --standalone --nproc_per_node=N bench/first_load.py [--tensors 10000]
        [--sizes-kib 4,8,16,32,64] [--loads 3] [--root DIR]

Each rank saves its share of ``--tensors`` tensors (sizes cycling through
``--sizes-kib``), then loads them ``--loads`` times into the same destinations, in the
same process. The first load of a process learns the item layouts it reads (see
``engine/storage/direct_items.py``) and touches its destinations for the first time; the
benchmark table (``bench/table.py``) repeats loads in one process, so its medians are of
later loads. A training job loads once per process: this prints each load's seconds
(the slowest rank's, between barriers) and microseconds per tensor per rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=10000)
    parser.add_argument("--sizes-kib", default="4,8,16,32,64")
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--root", default=None, help="where to save (default: a temp dir)")
    return parser.parse_args()


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [int(s) * 256 for s in args.sizes_kib.split(",")]  # float32 elements
    local = {f"t{i}": torch.randn(sizes[i % len(sizes)]) for i in range(rank, args.tensors, world)}
    root = args.root or os.path.join(tempfile.gettempdir(), "dist_ckpt_first_load")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    dc.save({k: ShardedTensor.from_rank_offsets(k, t) for k, t in local.items()}, root, strategy)
    targets = {k: torch.empty_like(t) for k, t in local.items()}
    times = []
    for _ in range(args.loads):
        request = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in targets.items()}
        dist.barrier()
        start = time.perf_counter()
        dc.load(request, root)
        dist.barrier()
        times.append(time.perf_counter() - start)
    for k, t in local.items():
        assert torch.equal(targets[k], t), k
    if rank == 0:
        per_rank = max(1, args.tensors // world)
        print(f"{args.tensors} tensors, {world} rank(s)")
        print(f"{'load':>6} {'s':>8} {'us/t':>8}")
        for i, seconds in enumerate(times, 1):
            print(f"{i:>6} {seconds:8.3f} {seconds / per_rank * 1e6:8.1f}")
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
