"""The GPU path: how long saving CUDA state blocks the trainer, against the time of copying
the same bytes to pinned host memory (the least a consistent snapshot can cost).

    torchrun --standalone --nproc_per_node=1 bench/gpu_staging.py [--size-mib 2048] \
        [--tensors 64] [--saves 4] [--layouts torch_dist,raw_bytes] [--dir DIR]

Each rank holds ``--size-mib / world`` MiB of float32 state on its GPU, in ``--tensors``
tensors sharded over the ranks on axis 0. It measures (slowest rank; medians of
``--repeats`` after a warm-up):

- the copies: device to pinned host memory into one preallocated buffer (the bound for the
  blocked time of an async save), device to pageable memory, pinned host to device;
- the raw baseline: the same bytes written from host memory (2 files per rank, fsync);
- per layout, a synchronous save (time, % of raw, peak RSS of the rank) and a hot load into
  CUDA targets (time, against the pinned host-to-device copy, and the process's first such
  load apart) and into CPU tensors, each checked byte for byte;
- per layout and async caller (``temporal``: a forked writer per save; ``persistent``: one
  worker that keeps its pinned segments), ``--saves`` saves: the time ``save()`` and
  ``schedule_async_request`` block the caller, as a multiple of the pinned copy, and the
  time until the save is finalized. The state is changed in place right after each save
  returns (as the next step would), and the last checkpoint must hold the values of its
  own step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from common import (
    bench_root,
    drop_dir,
    fmt_gbps,
    fmt_mib,
    fresh_dir,
    log,
    measured,
    rank,
    raw_blob,
    raw_write,
    row_sharded,
    world,
)

import dist_checkpointing as dc
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

MIB = 2**20
COLS = 1024
CALLERS = {"temporal": False, "persistent": True}


def make_state(size_mib: int, tensors: int, device: torch.device) -> dict[str, torch.Tensor]:
    rows = max(size_mib * MIB // 4 // tensors // world() // COLS, 1)
    gen = torch.Generator(device=device).manual_seed(7 + rank())
    return {
        f"layer{i}.weight": torch.randn(rows, COLS, generator=gen, device=device)
        for i in range(tensors)
    }


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def timed(fn: Callable[[], None], repeats: int) -> float:
    """Median over ``repeats`` runs (after one warm-up) of ``fn``, slowest rank."""
    out = []
    for i in range(repeats + 1):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i:
            out.append(slowest(time.perf_counter() - start))
    return statistics.median(out)


def copy_baselines(local: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    tensors = list(local.values())
    total = sum(t.numel() for t in tensors)
    pinned = torch.empty(total, dtype=torch.float32, pin_memory=True)
    pageable = torch.empty(total, dtype=torch.float32)
    pageable.fill_(0)  # resident: the copy measures the bus, not page faults

    def into(host: torch.Tensor, non_blocking: bool) -> Callable[[], None]:
        def run() -> None:
            pos = 0
            for t in tensors:
                host[pos : pos + t.numel()].copy_(t.view(-1), non_blocking=non_blocking)
                pos += t.numel()

        return run

    def back() -> None:
        pos = 0
        for t in tensors:
            t.view(-1).copy_(pinned[pos : pos + t.numel()], non_blocking=True)
            pos += t.numel()

    out = {
        "D2H pinned": timed(into(pinned, True), repeats),
        "D2H pageable": timed(into(pageable, False), repeats),
        "H2D pinned": timed(back, repeats),
    }
    return out


def raw_baseline(local: dict[str, torch.Tensor], root: str, repeats: int) -> float:
    blob = raw_blob([t.cpu() for t in local.values()])
    out = []
    for i in range(repeats + 1):
        path = fresh_dir(root, f"raw{i}")
        dist.barrier()
        start = time.perf_counter()
        raw_write(path, blob, 2)
        out.append(slowest(time.perf_counter() - start))
        drop_dir(path)
    return statistics.median(out[1:])


def check(expected: dict[str, torch.Tensor], path: str, device: str = "cuda") -> float:
    """Load ``path`` into targets on ``device``; every byte must match ``expected``.
    Seconds."""
    targets = {k: torch.empty_like(t, device=device) for k, t in expected.items()}
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    loaded = dc.load(row_sharded(targets), path)
    torch.cuda.synchronize()
    seconds = slowest(time.perf_counter() - start)
    bad = [k for k, t in expected.items() if not torch.equal(loaded[k].to(t.device), t)]
    if bad or any(t.device.type != device for t in loaded.values()):
        raise RuntimeError(f"rank {rank()}: {path}: loaded values differ for {bad[:5]}")
    return seconds


def sync_save(local: dict[str, torch.Tensor], root: str, layout: str, repeats: int) -> dict:
    strategy = dc.get_default_save_sharded_strategy(layout, 1)
    saves, loads, cpu_loads, peak = [], [], [], 0
    for i in range(repeats + 1):
        path = fresh_dir(root, f"sync_{layout}{i}")
        with measured() as m:
            dc.save(row_sharded(local), path, strategy)
        loads.append(check(local, path))
        cpu_loads.append(check(local, path, "cpu"))
        drop_dir(path)
        if i:
            saves.append(m[0].seconds)
            peak = max(peak, m[0].peak_rss)
    return {
        "save": statistics.median(saves),
        "loads": loads,
        "load": statistics.median(loads[1:]),
        "cpu_load": statistics.median(cpu_loads[1:]),
        "rss": peak,
    }


def async_saves(
    local: dict[str, torch.Tensor], root: str, layout: str, persistent: bool, saves: int
) -> dict:
    """``saves`` async saves; each one is finalized before the next (isolated)."""
    strategy = dc.get_default_save_sharded_strategy(layout, 1)
    queue = AsyncCallsQueue(persistent=persistent)
    blocked, background, paths = [], [], []
    expected: dict[str, torch.Tensor] = {}
    try:
        for i in range(saves):
            path = fresh_dir(root, f"async_{layout}_{persistent}{i}")
            paths.append(path)
            expected = {k: t.clone() for k, t in local.items()}
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            request = dc.save(row_sharded(local), path, strategy, async_sharded_save=True)
            assert isinstance(request, AsyncRequest)
            queue.schedule_async_request(request)
            scheduled = time.perf_counter()
            for t in local.values():  # the next step changes the state at once
                t.mul_(-1.0)
            queue.maybe_finalize_async_calls(blocking=True)
            blocked.append(slowest(scheduled - start))
            background.append(slowest(time.perf_counter() - scheduled))
        load_s = check(expected, paths[-1])
    finally:
        queue.close()
        for path in paths:
            drop_dir(path)
    return {"blocked": blocked, "background": background, "load": load_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=2048, help="state over all ranks")
    parser.add_argument("--tensors", type=int, default=64, help="tensors per rank")
    parser.add_argument("--saves", type=int, default=4, help="async saves per caller")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", default="torch_dist,raw_bytes")
    parser.add_argument("--callers", default="temporal,persistent")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    with bench_root("dist_ckpt_gpu_bench", args.dir) as root:
        local = make_state(args.size_mib, args.tensors, torch.device("cuda", local_rank))
        nbytes = world() * sum(t.numel() * t.element_size() for t in local.values())
        log(
            f"== GPU path: {fmt_mib(nbytes).strip()} in {args.tensors} tensors per rank, "
            f"{world()} rank(s), {torch.cuda.get_device_name()}, torch {torch.__version__} =="
        )
        copies = copy_baselines(local, args.repeats)
        for name, seconds in copies.items():
            log(f"{name:<13} {seconds * 1e3:8.1f} ms  {fmt_gbps(nbytes, seconds)}")
        raw_s = raw_baseline(local, root, args.repeats)
        log(f"{'raw write':<13} {raw_s * 1e3:8.1f} ms  {fmt_gbps(nbytes, raw_s)} (from host)")
        d2h, h2d = copies["D2H pinned"], copies["H2D pinned"]
        for layout in args.layouts.split(","):
            r = sync_save(local, root, layout, args.repeats)
            log(
                f"\n[{layout}] sync save {r['save']:.3f} s ({fmt_gbps(nbytes, r['save']).strip()},"
                f" {100 * raw_s / r['save']:.0f}% of raw), peak RSS {fmt_mib(r['rss']).strip()};"
                f" hot load into CUDA {r['load']:.3f} s ({fmt_gbps(nbytes, r['load']).strip()},"
                f" {r['load'] / h2d:.1f}x the pinned H2D copy; the first of the process "
                f"{r['loads'][0]:.3f} s), into CPU tensors {r['cpu_load']:.3f} s"
            )
            for caller in args.callers.split(","):
                a = async_saves(local, root, layout, CALLERS[caller], args.saves)
                steady = statistics.median(a["blocked"][1:] or a["blocked"])
                log(
                    f"[{layout}] async {caller:<10} blocked "
                    + ", ".join(f"{b * 1e3:.0f}" for b in a["blocked"])
                    + f" ms: steady {steady * 1e3:.0f} ms = {steady / d2h:.2f}x the pinned D2H"
                    f" copy ({100 * steady / r['save']:.0f}% of the sync save); until finalized "
                    + ", ".join(f"{b:.2f}" for b in a["background"])
                    + " s; last checkpoint byte-exact"
                )


if __name__ == "__main__":
    main()
