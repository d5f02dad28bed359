"""Resharding loads: a checkpoint saved by one number of ranks, loaded by others.

    python bench/reshard_load.py [--save-ranks 2] [--load-ranks 1,2,4] [--mib 512]
        [--count 64] [--cases grid,flat] [--methods torch_dist,raw_bytes,megatron]
        [--loads 3] [--root DIR]

``--count`` matrices of 1,024 rows (``--mib`` in all, float32) are saved by
``--save-ranks`` ranks and loaded by each ``--load-ranks`` count (the same layout where
it equals the save's), split over the ranks as the case says:

- ``grid``: into blocks of rows (even tensors) or of columns (odd ones), as tensor
  parallelism splits a transformer's weights. Loading on fewer ranks joins the blocks (a
  rank's column blocks land in strided destinations); on more, it cuts them;
- ``flat``: each tensor's flattening cut into a range per rank, the cuts a little off
  the even ones and different for each tensor, as a distributed optimizer shards its
  state over data-parallel ranks.

Each load runs ``--loads`` times into the same destinations after one that warms the
page cache and the allocator, and is compared bit for bit with the tensors built
independently.

Per row: the median load (slowest rank, barrier to barrier), the checkpoint's bytes over
it, and ``RSS +``: how far the largest rank's RSS rose above where it was before its
loads (sampled every millisecond), the memory a load needs beyond its destinations.

Methods: our two layouts (``torch_dist`` and ``raw_bytes``, saved with
``dist_checkpointing``) and ``megatron``: Megatron-Core's ``dist_checkpointing`` (its
``torch_dist`` strategy) saving and loading, where ``megatron.core`` can be imported (for
example ``PYTHONPATH=.mcore-site/0.16.1``, which ``make test`` installs; else the row says
so). Plain DCP has no row: it reshards DTensor and ShardedTensor state dicts only.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

import dist_checkpointing as dc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mcore_compat import stand_ins  # noqa: E402

ROWS = 1024


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-ranks", type=int, default=2)
    parser.add_argument("--load-ranks", default="1,2,4")
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--cases", default="grid,flat")
    parser.add_argument("--methods", default="torch_dist,raw_bytes,megatron")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--root", default=None, help="where to save (default: a temp dir)")
    parser.add_argument("--worker", choices=["save", "load"], help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args()


def _cols(args: argparse.Namespace) -> int:
    cols = (args.mib << 20) // 4 // args.count // ROWS
    return max(16, cols - cols % 16)


def _full(i: int, cols: int) -> torch.Tensor:
    return torch.randn(ROWS, cols, generator=torch.Generator().manual_seed(i))


def _range(i: int, numel: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s range of tensor ``i``'s flattening (``flat`` case)."""
    cuts = [0, *(numel * k // world + (i * 37) % 101 for k in range(1, world)), numel]
    return slice(cuts[rank], cuts[rank + 1])


def _part(case: str, t: torch.Tensor, i: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of tensor ``i`` (``t``, whole)."""
    if case == "flat":
        return t.reshape(-1)[_range(i, t.numel(), rank, world)]
    return t.chunk(world, dim=i % 2)[rank]


def _library(method: str) -> Any:
    """The ``dist_checkpointing`` package that saves and loads for ``method``."""
    if method == "megatron":
        return importlib.import_module("megatron.core.dist_checkpointing")
    return dc


def _request(args: argparse.Namespace, data: dict[int, torch.Tensor]) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = _library(args.method).ShardedTensor
    if args.case == "flat":
        shape = (ROWS, _cols(args))
        return {
            f"w{i}": sharded.from_rank_offsets_flat(
                f"w{i}", t, shape, flattened_range=_range(i, ROWS * shape[1], rank, world)
            )
            for i, t in data.items()
        }
    return {
        f"w{i}": sharded.from_rank_offsets(f"w{i}", t, (i % 2, rank, world))
        for i, t in data.items()
    }


def _save(args: argparse.Namespace, state: dict[str, Any]) -> None:
    if args.method != "megatron":
        dc.save(state, args.root, (args.method, 1))
        return
    strategies = importlib.import_module("megatron.core.dist_checkpointing.strategies.torch")
    strategy = strategies.TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=2)
    with stand_ins():
        _library("megatron").save(state, args.root, sharded_strategy=strategy)


def _load(args: argparse.Namespace, state: dict[str, Any]) -> None:
    with stand_ins():
        loaded = _library(args.method).load(state, args.root)
    for key, sh in state.items():  # a library may return other tensors: into the destinations
        if loaded[key].data_ptr() != sh.data.data_ptr():
            sh.data.copy_(loaded[key])


def _unavailable(method: str, case: str) -> str | None:
    if method != "megatron":
        return None
    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return "n/a (megatron.core not installed)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = hasattr(_library(method).ShardedTensor, "from_rank_offsets_flat")
    return None if flat or case != "flat" else "n/a (this Megatron-Core has no flat ranges)"


class _PeakRss:
    """The largest RSS of this process while it runs (sampled every millisecond)."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.start = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.start


def worker(args: argparse.Namespace) -> None:
    if args.method == "megatron":  # its imports warn about optional packages, its load too
        warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cols = _cols(args)
    if args.worker == "save":
        data = {
            i: _part(args.case, _full(i, cols), i, rank, world).contiguous()
            for i in range(args.count)
        }
        _save(args, _request(args, data))
        dist.destroy_process_group()
        return
    shapes = [
        _part(args.case, torch.empty(ROWS, cols, device="meta"), i, rank, world).shape
        for i in range(args.count)
    ]
    targets = {i: torch.empty(s) for i, s in enumerate(shapes)}
    _load(args, _request(args, targets))  # warms the page cache and the allocator
    times = []
    rss = _PeakRss()
    for _ in range(args.loads):
        request = _request(args, targets)
        dist.barrier()
        start = time.perf_counter()
        _load(args, request)
        dist.barrier()
        times.append(time.perf_counter() - start)
    rise = rss.stop()
    bad = [
        i
        for i, t in targets.items()
        if not torch.equal(t, _part(args.case, _full(i, cols), i, rank, world))
    ]
    assert not bad, f"rank {rank}: tensors {bad} differ from the ones saved"
    rises = [0] * world
    dist.all_gather_object(rises, rise)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"times": times, "rss": max(rises)}))
    dist.destroy_process_group()


def _torchrun(ranks: int, argv: list[str]) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", f"--nproc_per_node={ranks}", __file__, *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    root = Path(args.root or tempfile.mkdtemp(prefix="dist_ckpt_reshard_"))
    cols = _cols(args)
    total = args.count * ROWS * cols * 4
    print(
        f"{args.count} tensors of ({ROWS}, {cols}) float32, {total / 2**20:.0f} MiB, "
        f"saved by {args.save_ranks} rank(s)"
    )
    print(
        f"{'case':>5} {'method':>10} {'ranks':>5} {'load s':>8} {'GB/s':>6} {'RSS +MiB':>8} "
        f"{'state MiB':>9}"
    )
    for case, method in ((c, m) for c in args.cases.split(",") for m in args.methods.split(",")):
        missing = _unavailable(method, case)
        if missing:
            print(f"{case:>5} {method:>10} {missing}")
            continue
        ckpt = root / f"{case}_{method}"
        shutil.rmtree(ckpt, ignore_errors=True)
        ckpt.mkdir(parents=True)
        common = [
            "--root",
            str(ckpt),
            "--method",
            method,
            "--case",
            case,
            "--mib",
            str(args.mib),
            "--count",
            str(args.count),
        ]
        _torchrun(args.save_ranks, ["--worker", "save", *common])
        for ranks in (int(r) for r in args.load_ranks.split(",")):
            out = root / "result.json"
            _torchrun(
                ranks, ["--worker", "load", "--out", str(out), "--loads", str(args.loads), *common]
            )
            res = json.loads(out.read_text())
            median = statistics.median(res["times"])
            print(
                f"{case:>5} {method:>10} {ranks:>5} {median:8.3f} {total / median / 1e9:6.2f} "
                f"{res['rss'] / 2**20:8.0f} {total / ranks / 2**20:9.0f}",
                flush=True,
            )
        shutil.rmtree(ckpt, ignore_errors=True)
    if args.root is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
