"""What verifying checksums costs a load from the page cache, with the hashing thread
and with the CRC inline, in one process and one run.

    python bench/checksum_overlap.py [--layout torch_dist|raw_bytes] [--case big|mid]
                                     [--repeat 8]
    torchrun --standalone --nproc_per_node=2 bench/checksum_overlap.py ...

The ranks (one process alone: a 1-rank gloo group) save the case once, each tensor
sharded over them, then load it ``--repeat`` times, in turn four ways: without
verification, verified with the hashing thread (``DIST_CKPT_CHECKSUM_THREAD=1``), verified
inline (``=0``) and the default (``=2``: the thread only where the host has a core more
than ranks). It prints the best and median time of the slowest rank for each and the cost
of verification on the best times. Cases: ``big``, 16 float32 tensors of 32 MiB per rank;
``mid``, 10,000 tensors of 4-64 KiB per rank; ``one``, one float32 tensor of 256 MiB per
rank (one item, whose read the reader cuts into parts for its threads). The thread can
only hide the CRC where a core is free: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from common import init_gloo, row_sharded

import dist_checkpointing as dc
from dist_checkpointing.serialization import get_default_save_sharded_strategy

MID_KIB = (4, 8, 16, 32, 64)


def make_case(name: str) -> dict[str, torch.Tensor]:
    if name == "mid":
        return {f"t{i}": torch.randn(MID_KIB[i % 5] * 256) for i in range(10_000)}
    if name == "one":
        return {"t0": torch.randn(64 << 20)}
    return {f"t{i}": torch.randn(8 << 20) for i in range(16)}


def slowest(seconds: float) -> float:
    """The slowest rank's time."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layout", default="torch_dist", choices=("torch_dist", "raw_bytes"))
    parser.add_argument("--case", default="big", choices=("big", "mid", "one"))
    parser.add_argument("--repeat", type=int, default=8)
    args = parser.parse_args()
    init_gloo(29561)
    local = make_case(args.case)
    holder = [tempfile.mkdtemp(prefix="checksum_overlap_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(holder)
    root = holder[0]
    try:
        strategy = get_default_save_sharded_strategy(args.layout, 1)
        dc.save(row_sharded(local), root, strategy)
        request = row_sharded({k: torch.empty_like(v) for k, v in local.items()})
        ways = (
            ("no checks", False, "1"),
            ("thread", True, "1"),
            ("inline", True, "0"),
            ("default", True, "2"),
        )
        times: dict[str, list[float]] = {name: [] for name, _, _ in ways}
        for _ in range(args.repeat):
            for name, verify, thread in ways:
                os.environ["DIST_CKPT_CHECKSUM_THREAD"] = thread
                dist.barrier()
                start = time.perf_counter()
                dc.load(request, root, verify_checksums=verify)
                times[name].append(slowest(time.perf_counter() - start))
        base = min(times["no checks"])
        if dist.get_rank() != 0:
            return
        print(
            f"{args.layout}, {args.case}, {dist.get_world_size()} rank(s), best of "
            f"{args.repeat} loads from the page cache:"
        )
        for name, values in times.items():
            best = min(values)
            print(
                f"  {name:9s} best {best:.3f} s  median {statistics.median(values):.3f} s  "
                f"checksums cost {100 * (best / base - 1):+5.1f}%"
            )
    finally:
        os.environ.pop("DIST_CKPT_CHECKSUM_THREAD", None)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
