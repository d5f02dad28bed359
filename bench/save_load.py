"""Save/load speed against a raw-write baseline and plain torch.distributed.checkpoint.

    torchrun --standalone --nproc_per_node=2 bench/save_load.py [--size-mib 1024] [--small 10000]

Two cases, each sharded over all ranks (tensor-parallel style, axis 0):
- ``big``: ``--size-mib`` MiB in total (default 1 GiB), 16 float32 tensors;
- ``small``: ``--small`` float32 tensors of 64 elements per rank each.

For each case and method it prints the time of the slowest rank (barrier to
barrier), the throughput, and the peak RSS of the largest rank (with its child
processes). Methods: ``raw`` (this rank's bytes in as many files as we write,
one pass of 1 MiB writes + fsync each, read back into a preallocated buffer), ``dcp``
(plain DCP with DTensors of the same layout), ``ours`` (dist_checkpointing).
Loads read from the page cache right after the saves, for every method alike; with
``--cold`` each checkpoint's files are dropped from the page cache first, so loads
read from the disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import (
    Measurement,
    bench_root,
    evict,
    fmt_mib,
    host_buffer,
    log,
    log_table,
    measured,
    rank,
    raw_blob,
    raw_read,
    raw_write,
    row_sharded,
    world,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import dist_checkpointing as dc
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

THREAD_COUNT = 2  # files per rank, for us and for the raw baseline


# raw: one pass of 1 MiB writes + fsync per file; dcp: plain torch.distributed.checkpoint;
# ours: default settings (checksums written and verified); nocrc: ours without them.
METHODS = ("raw", "dcp", "ours", "nocrc")


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


def dcp_state_dict(local: dict[str, torch.Tensor], mesh: object) -> dict[str, DTensor]:
    return {k: DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for k, t in local.items()}


def best_of(
    repeat: int, phase: Callable[[int], None], before: Callable[[int], None] | None = None
) -> Measurement:
    """The fastest of ``repeat`` runs of ``phase(i)`` (with the peak RSS of that run);
    ``before(i)`` runs first, outside the timed region."""
    runs = []
    for i in range(repeat):
        if before is not None:
            before(i)
        with measured() as m:
            phase(i)
        runs.append(m[0])
    return min(runs, key=lambda m: m.seconds)


def _raw_save(
    local: dict[str, torch.Tensor], repeat: int, path: Callable[[int], str]
) -> Measurement:
    blob = raw_blob(list(local.values()))
    return best_of(repeat, lambda i: raw_write(path(i), blob, THREAD_COUNT))


def evicting(path: Callable[[int], str], cold: bool) -> Callable[[int], None] | None:
    """With ``cold``, what drops run i's files from the page cache before its load."""
    return (lambda i: evict(path(i))) if cold else None


def measure_raw(
    local: dict[str, torch.Tensor],
    repeat: int,
    path: Callable[[int], str],
    nbytes: int,
    cold: bool = False,
) -> dict[str, Measurement]:
    save = _raw_save(local, repeat, path)  # the blob is freed before the loads
    into = host_buffer(nbytes)  # allocated outside the timed region, as tensors are
    load = best_of(repeat, lambda i: raw_read(path(i), into, THREAD_COUNT), evicting(path, cold))
    return {"save": save, "load": load}


def measure_dcp(
    local: dict[str, torch.Tensor],
    repeat: int,
    path: Callable[[int], str],
    mesh: object,
    cold: bool = False,
) -> dict[str, Measurement]:
    save = best_of(repeat, lambda i: dcp.save(dcp_state_dict(local, mesh), checkpoint_id=path(i)))
    target = dcp_state_dict({k: torch.empty_like(t) for k, t in local.items()}, mesh)
    load = best_of(repeat, lambda i: dcp.load(target, checkpoint_id=path(i)), evicting(path, cold))
    return {"save": save, "load": load}


def measure_ours(
    local: dict[str, torch.Tensor],
    repeat: int,
    path: Callable[[int], str],
    checksums: bool = True,
    cold: bool = False,
) -> dict[str, Measurement]:
    """Our save and load; ``checksums=False`` writes no item checksums and verifies
    nothing (the WRITE_CHECKSUMS knob off, ``verify_checksums=False``)."""
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=THREAD_COUNT)
    os.environ["DIST_CKPT_WRITE_CHECKSUMS"] = "1" if checksums else "0"
    try:
        save = best_of(
            repeat, lambda i: dc.save(row_sharded(local), path(i), sharded_strategy=strategy)
        )
    finally:
        os.environ.pop("DIST_CKPT_WRITE_CHECKSUMS", None)
    request = row_sharded({k: torch.empty_like(t) for k, t in local.items()})
    load = best_of(
        repeat,
        lambda i: dc.load(request, path(i), verify_checksums=checksums),
        evicting(path, cold),
    )
    loaded = dc.load(request, path(0))
    mismatched = [k for k, t in local.items() if not torch.equal(loaded[k], t)]
    if mismatched:
        raise RuntimeError(f"rank {rank()}: loaded values differ for {mismatched[:5]}")
    return {"save": save, "load": load}


def run_case(name: str, args: argparse.Namespace, root: str, mesh: object) -> None:
    local = make_case(name, args.size_mib, args.small)
    nbytes_rank = sum(t.numel() * t.element_size() for t in local.values())
    total = torch.tensor([nbytes_rank], dtype=torch.int64)
    dist.all_reduce(total)
    nbytes = int(total)
    repeat = args.repeat

    def path(method: str, i: int) -> str:
        return os.path.join(root, f"{name}_{method}_{i}")

    if rank() == 0:
        for method in METHODS:
            for i in range(repeat):
                os.makedirs(path(method, i))
    dist.barrier()
    results: dict[str, dict[str, Measurement]] = {m: {} for m in METHODS}

    cold = args.cold
    results["raw"] = measure_raw(local, repeat, partial(path, "raw"), nbytes_rank, cold)
    results["dcp"] = measure_dcp(local, repeat, partial(path, "dcp"), mesh, cold)
    results["ours"] = measure_ours(local, repeat, partial(path, "ours"), cold=cold)
    results["nocrc"] = measure_ours(local, repeat, partial(path, "nocrc"), False, cold)

    report(name, nbytes, len(local), results, repeat, cold)
    dist.barrier()
    if rank() == 0:
        for method in METHODS:
            for i in range(repeat):
                shutil.rmtree(path(method, i))


def report(
    name: str,
    nbytes: int,
    count: int,
    r: dict[str, dict[str, Measurement]],
    repeat: int,
    cold: bool,
) -> None:
    source = "the disk (cold page cache)" if cold else "the page cache"
    log(
        f"\n== {name}: {fmt_mib(nbytes).strip()} in total, {count} tensors per rank, "
        f"{world()} ranks, {THREAD_COUNT} files per rank, best of {repeat}; "
        f"loads from {source} =="
    )
    log_table(nbytes, r)
    for op in ("save", "load"):
        ours, raw, base = r["ours"][op], r["raw"][op], r["dcp"][op]
        log(
            f"{op}: ours at {100 * raw.seconds / ours.seconds:5.1f}% of the raw baseline's "
            f"throughput; {base.seconds / ours.seconds:5.2f}x plain DCP's speed"
        )
    for op in ("save", "load"):
        with_crc, without = r["ours"][op], r["nocrc"][op]
        log(
            f"{op}: checksums cost {100 * (with_crc.seconds / without.seconds - 1):+5.1f}% of "
            f"the time ({100 * without.seconds / with_crc.seconds:5.1f}% throughput kept)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--cases", default="big,small")
    parser.add_argument("--repeat", type=int, default=1, help="report the best of N runs")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="load from the disk: drop each checkpoint's files from the page cache "
        "(posix_fadvise DONTNEED) before its timed load, for every method alike",
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world(),))
    with bench_root("dist_ckpt_bench", args.dir) as root:
        for name in args.cases.split(","):
            run_case(name, args, root, mesh)


if __name__ == "__main__":
    main()
