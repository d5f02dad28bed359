"""Where a synchronous save's (or hot load's) time goes: cProfile of one rank.

    torchrun --standalone --nproc_per_node=1 bench/profile_save.py [--device cuda] \
        [--layout torch_dist] [--size-mib 1024] [--tensors 64] [--op save|load] [--top 30]

The rank holds ``--size-mib`` MiB of float32 state on ``--device`` in ``--tensors``
tensors, saves it once as a warm-up, then saves (or loads into the same tensors) once
under cProfile and prints the wall time and the ``--top`` functions by own time and by
cumulative time. Threads other than the caller's are not profiled: their work shows as
waits in the caller.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.distributed as dist
from common import bench_root, fresh_dir, log, rank, world

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor

MIB = 2**20


def sharded(size_mib: int, tensors: int, device: torch.device) -> dict[str, ShardedTensor]:
    cols = 1024
    rows = max(size_mib * MIB // 4 // tensors // world() // cols, 1)
    return {
        f"layer{i}.weight": ShardedTensor.from_rank_offsets(
            f"layer{i}.weight", torch.randn(rows, cols, device=device), (0, rank(), world())
        )
        for i in range(tensors)
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--layout", default="torch_dist", choices=("torch_dist", "raw_bytes"))
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--op", default="save", choices=("save", "load"))
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    dist.init_process_group("gloo")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank() % torch.cuda.device_count())
    state = sharded(args.size_mib, args.tensors, device)
    strategy = dc.serialization.get_default_save_sharded_strategy(args.layout)
    with bench_root("profile_save") as root:
        path = fresh_dir(root, "ckpt")
        dc.save(state, path, strategy)  # warm-up: pools, threads, page cache
        if args.op == "save":
            path = fresh_dir(root, "ckpt2")
        profiler = cProfile.Profile()
        dist.barrier()
        start = time.perf_counter()
        profiler.enable()
        if args.op == "save":
            dc.save(state, path, strategy)
        else:
            dc.load(state, path)
        profiler.disable()
        dist.barrier()
        seconds = time.perf_counter() - start
    log(f"{args.layout} {args.op}, {args.size_mib} MiB on {device.type}: {seconds:.3f} s")
    if rank() == 0:
        for order in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(args.top)
            print(out.getvalue())


if __name__ == "__main__":
    main()
