"""Fully parallel save and load of a replicated state, against the unwrapped strategies.

    torchrun --standalone --nproc_per_node=4 bench/fully_parallel.py [--size-mib 256]

Every rank holds the whole state (``--size-mib`` MiB in 16 float32 tensors): a
data-parallel replica group as large as the world. Unwrapped, the rank holding
the main replicas writes everything and every rank reads everything; fully
parallel, each tensor is written once by the rank a size-balanced assignment
picks, and read once in the group, then exchanged (``--exchange``).

Printed per method: seconds of the slowest rank (barrier to barrier), bytes
written and read per rank (min and max over ranks), and peak RSS of the largest
rank. Loads read from the page cache right after the saves, for both alike.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from common import bench_root, fmt_gbps, fmt_mib, fresh_dir, log, measured, rank, world

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

TENSORS = 16


def replicated(size_mib: int, empty: bool = False) -> dict[str, ShardedTensor]:
    numel = (size_mib << 20) // 4 // TENSORS
    out = {}
    for i in range(TENSORS):
        data = torch.empty(numel) if empty else torch.full((numel,), float(i))
        out[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", data, replica_id=rank())
    return out


class CountingLoad(TorchDistLoadShardedStrategy):
    """The torch_dist loader, counting the bytes each rank asks it to read."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        for sh in sharded_state_dict.values():
            self.bytes += sh.data.numel() * sh.data.element_size() if sh.data is not None else 0
        return super().load(sharded_state_dict, checkpoint_dir)


def bytes_written_by_rank(ckpt: str) -> list[int]:
    sizes = [0] * world()
    for name in os.listdir(ckpt):
        if name.endswith(".distcp"):
            sizes[int(name[2:].split("_")[0])] += os.path.getsize(os.path.join(ckpt, name))
    return sizes


def gather_int(value: int) -> list[int]:
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(world())]
    dist.all_gather(out, torch.tensor([value], dtype=torch.int64))
    return [int(t) for t in out]


def run(method: str, args: argparse.Namespace, ckpt: str) -> None:
    parallel = method == "fully_parallel"
    save: Any = TorchDistSaveShardedStrategy()
    counting = CountingLoad()
    load: Any = counting
    if parallel:
        save = FullyParallelSaveStrategyWrapper(save)
        load = FullyParallelLoadStrategyWrapper(counting, exchange_algo=args.exchange)
    state = replicated(args.size_mib)
    with measured() as saved:
        dc.save(state, ckpt, sharded_strategy=save)
    written = bytes_written_by_rank(ckpt)
    request = replicated(args.size_mib, empty=True)
    with measured() as loaded:
        dc.load(request, ckpt, sharded_strategy=load)
    read = gather_int(counting.bytes)
    total = args.size_mib << 20
    log(
        f"{method:>15} save {saved[0].seconds:7.3f} s ({fmt_gbps(total, saved[0].seconds)}), "
        f"written/rank {fmt_mib(min(written))}..{fmt_mib(max(written))} | "
        f"load {loaded[0].seconds:7.3f} s, read/rank {fmt_mib(min(read))}..{fmt_mib(max(read))} "
        f"| peak RSS {fmt_mib(max(saved[0].peak_rss, loaded[0].peak_rss))}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--exchange", default="broadcast")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    log(f"replicated state of {args.size_mib} MiB on {world()} ranks, exchange={args.exchange}")
    with bench_root("dist_ckpt_bench_fp", args.dir) as root:
        for method in ("plain", "fully_parallel"):
            run(method, args, fresh_dir(root, method))


if __name__ == "__main__":
    main()
