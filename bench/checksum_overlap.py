"""What verifying checksums costs a load from the page cache, with the hashing thread
and with the CRC inline, in one process and one run.

    python bench/checksum_overlap.py [--layout torch_dist|raw_bytes] [--case big|mid]
                                     [--repeat 8]

One rank (a 1-rank gloo group) saves the case once, then loads it ``--repeat`` times
in turn three ways: without verification, verified with the hashing thread
(``DIST_CKPT_CHECKSUM_THREAD=1``, the default) and verified inline (``=0``). It prints
the best and median time of each and the cost of verification on the best times.
Cases: ``big``, 16 float32 tensors of 32 MiB; ``mid``, 10,000 tensors of 4-64 KiB.
The thread can only hide the CRC where a core is free: run it on an otherwise idle
machine.
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

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.serialization import get_default_save_sharded_strategy

MID_KIB = (4, 8, 16, 32, 64)


def make_case(name: str) -> dict[str, torch.Tensor]:
    if name == "mid":
        return {f"t{i}": torch.randn(MID_KIB[i % 5] * 256) for i in range(10_000)}
    return {f"t{i}": torch.randn(8 << 20) for i in range(16)}


def sharded(tensors: dict[str, torch.Tensor]) -> dict[str, ShardedTensor]:
    return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layout", default="torch_dist", choices=("torch_dist", "raw_bytes"))
    parser.add_argument("--case", default="big", choices=("big", "mid"))
    parser.add_argument("--repeat", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    local = make_case(args.case)
    root = tempfile.mkdtemp(prefix="checksum_overlap_")
    try:
        strategy = get_default_save_sharded_strategy(args.layout, 1)
        dc.save(sharded(local), root, strategy)
        request = sharded({k: torch.empty_like(v) for k, v in local.items()})
        ways = (("no checks", False, "1"), ("thread", True, "1"), ("inline", True, "0"))
        times: dict[str, list[float]] = {name: [] for name, _, _ in ways}
        for _ in range(args.repeat):
            for name, verify, thread in ways:
                os.environ["DIST_CKPT_CHECKSUM_THREAD"] = thread
                start = time.perf_counter()
                dc.load(request, root, verify_checksums=verify)
                times[name].append(time.perf_counter() - start)
        base = min(times["no checks"])
        print(f"{args.layout}, {args.case}, best of {args.repeat} loads from the page cache:")
        for name, values in times.items():
            best = min(values)
            print(
                f"  {name:9s} best {best:.3f} s  median {statistics.median(values):.3f} s  "
                f"checksums cost {100 * (best / base - 1):+5.1f}%"
            )
    finally:
        os.environ.pop("DIST_CKPT_CHECKSUM_THREAD", None)
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
