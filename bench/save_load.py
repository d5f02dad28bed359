"""Save/load speed against a raw-write baseline and plain torch.distributed.checkpoint.

    torchrun --standalone --nproc_per_node=2 bench/save_load.py [--size-mib 1024] [--small 10000]

Two cases, each sharded over all ranks (tensor-parallel style, axis 0):
- ``big``: ``--size-mib`` MiB in total (default 1 GiB), 16 float32 tensors;
- ``small``: ``--small`` float32 tensors of 64 elements per rank each.

For each case and method it prints the time of the slowest rank (barrier to
barrier), the throughput, and the peak RSS of the largest rank (with its child
processes). Methods: ``raw`` (this rank's bytes in as many files as we write,
one large write + fsync each, read back into a preallocated buffer), ``dcp``
(plain DCP with DTensors of the same layout), ``ours`` (dist_checkpointing).
Loads read from the page cache right after the saves, for every method alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import (
    Measurement,
    fmt_gbps,
    fmt_mib,
    log,
    measured,
    rank,
    raw_blob,
    raw_read,
    raw_write,
    world,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

THREAD_COUNT = 2  # files per rank, for us and for the raw baseline


def make_case(name: str, size_mib: int, small: int) -> dict[str, torch.Tensor]:
    """This rank's local tensors of the case, by key (deterministic values)."""
    gen = torch.Generator().manual_seed(1000 + rank())
    if name == "big":
        count = 16
        per_rank = size_mib * 2**20 // 4 // count // world()
        cols = 1024
        rows = max(per_rank // cols, 1)
        return {f"big.{i}": torch.randn(rows, cols, generator=gen) for i in range(count)}
    return {f"small.{i}": torch.randn(64, generator=gen) for i in range(small)}


def ours_state_dict(local: dict[str, torch.Tensor]) -> dict[str, ShardedTensor]:
    return {
        k: ShardedTensor.from_rank_offsets(k, t, (0, rank(), world())) for k, t in local.items()
    }


def dcp_state_dict(local: dict[str, torch.Tensor], mesh: object) -> dict[str, DTensor]:
    return {k: DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for k, t in local.items()}


def run_case(name: str, args: argparse.Namespace, root: str, mesh: object) -> None:
    local = make_case(name, args.size_mib, args.small)
    nbytes_rank = sum(t.numel() * t.element_size() for t in local.values())
    total = torch.tensor([nbytes_rank], dtype=torch.int64)
    dist.all_reduce(total)
    nbytes = int(total)
    dirs = {m: os.path.join(root, f"{name}_{m}") for m in ("raw", "dcp", "ours")}
    if rank() == 0:
        for d in dirs.values():
            os.makedirs(d)
    dist.barrier()
    results: dict[str, dict[str, Measurement]] = {m: {} for m in dirs}

    blob = raw_blob(list(local.values()))
    with measured() as m:
        raw_write(dirs["raw"], blob, THREAD_COUNT)
    results["raw"]["save"] = m[0]
    del blob
    with measured() as m:
        raw_read(dirs["raw"], nbytes_rank, THREAD_COUNT)
    results["raw"]["load"] = m[0]

    with measured() as m:
        dcp.save(dcp_state_dict(local, mesh), checkpoint_id=dirs["dcp"])
    results["dcp"]["save"] = m[0]
    target = dcp_state_dict({k: torch.empty_like(t) for k, t in local.items()}, mesh)
    with measured() as m:
        dcp.load(target, checkpoint_id=dirs["dcp"])
    results["dcp"]["load"] = m[0]
    del target

    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=THREAD_COUNT)
    with measured() as m:
        dc.save(ours_state_dict(local), dirs["ours"], sharded_strategy=strategy)
    results["ours"]["save"] = m[0]
    request = ours_state_dict({k: torch.empty_like(t) for k, t in local.items()})
    with measured() as m:
        loaded = dc.load(request, dirs["ours"])
    results["ours"]["load"] = m[0]
    mismatched = [k for k, t in local.items() if not torch.equal(loaded[k], t)]
    if mismatched:
        raise RuntimeError(f"rank {rank()}: loaded values differ for {mismatched[:5]}")
    del loaded, request

    report(name, nbytes, len(local), results)
    dist.barrier()
    if rank() == 0:
        for d in dirs.values():
            shutil.rmtree(d)


def report(name: str, nbytes: int, count: int, r: dict[str, dict[str, Measurement]]) -> None:
    log(
        f"\n== {name}: {fmt_mib(nbytes).strip()} in total, {count} tensors per rank, "
        f"{world()} ranks, {THREAD_COUNT} files per rank =="
    )
    log(f"{'method':6} {'op':5} {'seconds':>8} {'throughput':>12} {'peak RSS/rank':>14}")
    for method, ops in r.items():
        for op, m in ops.items():
            log(
                f"{method:6} {op:5} {m.seconds:8.3f} {fmt_gbps(nbytes, m.seconds):>12} "
                f"{fmt_mib(m.peak_rss):>14}"
            )
    for op in ("save", "load"):
        ours, raw, base = r["ours"][op], r["raw"][op], r["dcp"][op]
        log(
            f"{op}: ours at {100 * raw.seconds / ours.seconds:5.1f}% of the raw baseline's "
            f"throughput; {base.seconds / ours.seconds:5.2f}x plain DCP's speed"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--cases", default="big,small")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world(),))
    root = args.dir or tempfile.gettempdir()
    root = os.path.join(root, "dist_ckpt_bench")
    if rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()
    try:
        for name in args.cases.split(","):
            run_case(name, args, root, mesh)
    finally:
        dist.barrier()
        if rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
