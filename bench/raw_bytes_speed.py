"""Per-tensor cost and throughput of the raw_bytes layout against torch_dist and raw I/O.

    torchrun --standalone --nproc_per_node=2 bench/raw_bytes_speed.py [--small 10000] \
        [--size-mib 1024] [--repeat 3] [--cases small,big]

Cases (each sharded over all ranks on axis 0, as in ``save_load.py``):
- ``small``: ``--small`` float32 tensors of 64 elements per rank;
- ``big``: ``--size-mib`` MiB in total, 16 float32 tensors.

For each case it prints the best of ``--repeat`` runs (slowest rank, barrier to
barrier) of: ``raw`` (this rank's bytes in as many files, one pass of 1 MiB
writes + fsync each, read back), ``torch_dist`` and ``raw_bytes`` (``dist_checkpointing``
save and load, checksums written and verified) and ``raw_bytes_nv`` (the same with
``validate_access_integrity=False``: without the sharding check, which every layout
shares), with microseconds per tensor per rank and GB/s. Loads read from the page cache right after the saves.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from common import Measurement, log, log_table, rank, row_sharded, world
from save_load import THREAD_COUNT, best_of, make_case, measure_raw

import dist_checkpointing as dc
from dist_checkpointing.serialization import get_default_save_sharded_strategy

# raw_bytes_nv: raw_bytes with validate_access_integrity=False (the sharding check, which
# is the same for every layout, left out: what the layout itself costs).
METHODS = ("raw", "torch_dist", "raw_bytes", "raw_bytes_nv")


def measure(
    method: str, local: dict[str, torch.Tensor], repeat: int, root: str
) -> dict[str, Measurement]:
    backend = method.removesuffix("_nv")
    validate = not method.endswith("_nv")
    strategy = get_default_save_sharded_strategy(backend, 1)

    def path(i: int) -> str:
        return os.path.join(root, f"{method}_{i}")

    def save(i: int) -> None:
        dc.save(row_sharded(local), path(i), strategy, validate_access_integrity=validate)

    saved = best_of(repeat, save)
    request = row_sharded({k: torch.empty_like(t) for k, t in local.items()})
    load = best_of(repeat, lambda i: dc.load(request, path(i), validate_access_integrity=validate))
    loaded = dc.load(row_sharded({k: torch.empty_like(t) for k, t in local.items()}), path(0))
    bad = [k for k, t in local.items() if not torch.equal(loaded[k], t)]
    if bad:
        raise RuntimeError(f"rank {rank()}: {method} loaded wrong values for {bad[:5]}")
    return {"save": saved, "load": load}


def run_case(name: str, args: argparse.Namespace, root: str) -> None:
    local = make_case(name, args.size_mib, args.small)
    nbytes_rank = sum(t.numel() * t.element_size() for t in local.values())
    total = torch.tensor([nbytes_rank], dtype=torch.int64)
    dist.all_reduce(total)
    if rank() == 0:
        for method in METHODS:
            for i in range(args.repeat):
                os.makedirs(os.path.join(root, f"{method}_{i}"))
    dist.barrier()
    results: dict[str, dict[str, Measurement]] = {}

    def raw_path(i: int) -> str:
        return os.path.join(root, f"raw_{i}")

    results["raw"] = measure_raw(local, args.repeat, raw_path, nbytes_rank)
    for method in METHODS[1:]:
        results[method] = measure(method, local, args.repeat, root)
    log(f"case {name}: {len(local)} tensors per rank, {world()} ranks, {int(total)} bytes")
    log_table(int(total), results, width=12)
    for method in METHODS:
        for op, m in results[method].items():
            log(f"  {method:12} {op:5} {m.seconds / len(local) * 1e6:9.1f} us/tensor/rank")
    for op in ("save", "load"):
        ratio = results["raw"][op].seconds / results["raw_bytes"][op].seconds
        log(f"  raw_bytes {op} throughput = {ratio:.0%} of raw")
    dist.barrier()
    if rank() == 0:
        for method in METHODS:
            for i in range(args.repeat):
                shutil.rmtree(os.path.join(root, f"{method}_{i}"), ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", type=int, default=10000)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", default="small,big")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    root = args.dir or tempfile.gettempdir()
    root = os.path.join(root, "raw_bytes_speed")
    if rank() == 0:
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    log(f"{world()} ranks, {THREAD_COUNT} files per rank, {os.cpu_count()} CPUs")
    for name in args.cases.split(","):
        run_case(name, args, root)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
