"""Async saves in a simulated training loop: how long the loop is blocked, how fast the
background writes, how much memory it takes.

    torchrun --standalone --nproc_per_node=2 bench/async_save.py [--size-mib 1024] \
        [--steps 4] [--compute-seconds 3] [--compute sleep|matmul] [--device cpu|cuda]

The state (``--size-mib`` MiB in total, 16 float32 tensors sharded over the ranks on
axis 0) is saved at the end of every step, asynchronously, to a new directory, the way
Megatron-Core trains with ``--async-save``::

    for step in range(steps):
        for iteration in range(compute_seconds / iter_seconds):
            compute()  # sleep, or a matmul loop
            queue.maybe_finalize_async_calls(blocking=False)  # every iteration
        request = dist_checkpointing.save(sd, step_dir, async_sharded_save=True)  # blocked
        queue.schedule_async_request(request)  # blocked (staging)
    queue.maybe_finalize_async_calls(blocking=True)

For each caller kind (``temporal``: one forked process per save; ``persistent``: one
spawned worker per rank) it prints:

- blocked: the time of ``save()`` + ``schedule_async_request`` (slowest rank, per save),
  against a synchronous save of the same state measured in the same run. Target: at most
  10% of the synchronous save, and persistent below temporal.
- background: the bytes saved / the time from ``schedule_async_request`` to the end of
  the finalization (slowest rank), against the raw baseline (``common.raw_write`` of the
  same bytes in as many files, with fsync). Target: at least 80% of raw. Measured in the
  loop (finalization noticed at the next iteration, so up to ``--iter-seconds`` late) and
  isolated (one more save, finalized with ``blocking=True`` right away).
- peak memory of the largest rank, with its children (writer processes): RSS, which
  counts pages a forked writer shares with its rank once per process, and with ``--pss``
  also PSS, which splits them (sampling it costs kernel time: use a separate run for
  timings); and the rank's memory before the loop, for reference.

Timings on a shared machine are noisy: the baselines are the median of ``--repeats``
runs (after a warm-up), and every async save is listed, so that outliers show.

Run with torchrun (2 or 4 ranks). ``--device cuda`` puts the state on the GPU (staging to
pinned host memory becomes the blocking part); it needs one GPU per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist
from common import (
    PeakSampler,
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
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

TENSORS = 16
COLS = 1024
# name -> (persistent, snapshot_cpu_tensors). "persistent-shared" hands the live CPU
# tensors to the worker (no copy): valid only if training does not modify them before
# the save is finalized (true for accelerator state, whose staged copies are private).
CALLERS = {
    "temporal": (False, True),
    "persistent": (True, True),
    "persistent-shared": (True, False),
}
BLOCKED_TARGET = 0.10  # of the synchronous save
THROUGHPUT_TARGET = 0.80  # of the raw baseline


# --------------------------------------------------------------------------- state


def make_state(size_mib: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's local tensors, by key (deterministic values)."""
    gen = torch.Generator().manual_seed(2000 + rank())
    per_tensor = size_mib * 2**20 // 4 // TENSORS // world()
    rows = max(per_tensor // COLS, 1)
    return {
        f"layer{i}.weight": torch.randn(rows, COLS, generator=gen).to(device)
        for i in range(TENSORS)
    }


def verify(local: dict[str, torch.Tensor], ckpt: str) -> None:
    """Load ``ckpt`` and compare every byte with the state."""
    request = row_sharded({k: torch.empty_like(t) for k, t in local.items()})
    loaded = dc.load(request, ckpt)
    bad = [k for k, t in local.items() if not torch.equal(loaded[k], t)]
    if bad:
        raise RuntimeError(f"rank {rank()}: {ckpt}: loaded values differ for {bad[:5]}")


# --------------------------------------------------------------------------- memory


def _tree_memory(proc: psutil.Process, pss: bool) -> tuple[int, int]:
    """(RSS, PSS or 0) of a process and its children. PSS walks every page table (kernel
    time, noticeable on a small machine), so it is measured only when asked for."""
    rss = proportional = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            if pss:
                info = p.memory_full_info()
                rss += info.rss
                proportional += info.pss
            else:
                rss += p.memory_info().rss
    return rss, proportional


class PeakMemory(PeakSampler):
    """Samples this rank's (and its children's) RSS, and optionally PSS, in a thread."""

    def __init__(self, interval_s: float, with_pss: bool) -> None:
        proc = psutil.Process()
        super().__init__(lambda: _tree_memory(proc, with_pss), interval_s)

    @property
    def rss(self) -> int:
        return self.top[0]

    @property
    def pss(self) -> int:
        return self.top[1]


# --------------------------------------------------------------------------- helpers


def max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def make_compute(kind: str, device: torch.device) -> Callable[[float], None]:
    """A function that keeps this rank busy for about the given seconds."""
    if kind == "sleep":
        return time.sleep
    a = torch.randn(512, 512, device=device)
    b = torch.randn(512, 512, device=device)

    def matmul(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            torch.mm(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    return matmul


def raw_once(local: dict[str, torch.Tensor], root: str, name: str, files: int) -> float:
    """One raw-write baseline of this state (slowest rank, seconds)."""
    path = fresh_dir(root, name)
    blob = raw_blob([t.cpu() for t in local.values()])  # outside the timed region
    with measured() as m:
        raw_write(path, blob, files)
    del blob
    drop_dir(path)
    return m[0].seconds


@dataclass
class SaveTimes:
    """One async save on this rank (perf_counter seconds)."""

    start: float  # save() called
    saved: float = 0.0  # save() returned, schedule_async_request called
    scheduled: float = 0.0  # schedule_async_request returned
    finalized: float = 0.0  # maybe_finalize_async_calls returned its id

    @property
    def blocked(self) -> float:
        return self.scheduled - self.start

    @property
    def background(self) -> float:
        return self.finalized - self.saved


@dataclass
class Result:
    """What one caller kind's run measured (slowest rank, seconds)."""

    blocked: list[float]  # per save of the loop
    save_part: list[float]
    schedule_part: list[float]
    background: list[float]
    iso_blocked: list[float]  # per isolated save
    iso_background: list[float]
    iso_raw: list[float]  # the raw write measured just before each isolated save
    base_rss: int
    peak_rss: int
    peak_pss: int
    seconds: float


class Trainer:
    """The simulated training loop of one caller kind, then isolated saves."""

    def __init__(self, args: argparse.Namespace, local: dict[str, torch.Tensor], root: str):
        self.args = args
        self.local = local
        self.root = root
        self.strategy = TorchDistSaveShardedStrategy(
            thread_count=args.thread_count, cached_metadata=args.cached_metadata
        )
        self.compute = make_compute(args.compute, local[next(iter(local))].device)
        self.times: dict[int, SaveTimes] = {}
        self.dirs: dict[int, str] = {}
        self.keep = args.steps - 1  # the loop's last checkpoint is verified at the end

    def _save(self, queue: AsyncCallsQueue, path: str) -> int:
        times = SaveTimes(time.perf_counter())
        request = dc.save(row_sharded(self.local), path, self.strategy, async_sharded_save=True)
        assert isinstance(request, AsyncRequest)
        times.saved = time.perf_counter()
        idx = queue.schedule_async_request(request)
        times.scheduled = time.perf_counter()
        self.times[idx] = times
        self.dirs[idx] = path
        return idx

    def _finalize(self, queue: AsyncCallsQueue, blocking: bool) -> None:
        done = queue.maybe_finalize_async_calls(blocking=blocking)
        now = time.perf_counter()
        for idx in done:
            self.times[idx].finalized = now
            if rank() == 0 and idx != self.keep:  # every rank is past the call's last barrier
                shutil.rmtree(self.dirs[idx])

    def _loop(self, queue: AsyncCallsQueue, name: str) -> float:
        args = self.args
        iterations = max(1, round(args.compute_seconds / args.iter_seconds))
        start = time.perf_counter()
        for step in range(args.steps):
            for _ in range(iterations):
                self.compute(args.iter_seconds)
                self._finalize(queue, blocking=False)
            self._save(queue, fresh_dir(self.root, f"{name}_step{step}"))
        self._finalize(queue, blocking=True)
        return time.perf_counter() - start

    def run(self, name: str, caller: tuple[bool, bool]) -> Result:
        args = self.args
        persistent, snapshot = caller
        queue = AsyncCallsQueue(persistent=persistent, snapshot_cpu_tensors=snapshot)
        base_rss, _ = _tree_memory(psutil.Process(), pss=False)
        with PeakMemory(args.memory_interval, args.pss) as memory:
            seconds = self._loop(queue, name)
        # Isolated saves, each right after a raw write of the same bytes (the disk's speed
        # drifts on a shared machine; neighbouring measurements compare best).
        iso, raw = [], []
        for i in range(args.repeats):
            raw.append(raw_once(self.local, self.root, f"{name}_raw{i}", args.thread_count))
            iso.append(self._save(queue, fresh_dir(self.root, f"{name}_isolated{i}")))
            self._finalize(queue, blocking=True)
        queue.close()
        if not args.no_verify:
            verify(self.local, self.dirs[self.keep])
        drop_dir(self.dirs[self.keep])
        loop = [self.times[i] for i in range(args.steps)]
        n, r = args.steps, args.repeats
        values = max_over_ranks(
            [t.blocked for t in loop]
            + [t.saved - t.start for t in loop]
            + [t.scheduled - t.saved for t in loop]
            + [t.background for t in loop]
            + [self.times[i].blocked for i in iso]
            + [self.times[i].background for i in iso]
            + [seconds, float(base_rss), float(memory.rss), float(memory.pss)]
        )
        tail = values[4 * n + 2 * r :]
        return Result(
            blocked=values[:n],
            save_part=values[n : 2 * n],
            schedule_part=values[2 * n : 3 * n],
            background=values[3 * n : 4 * n],
            iso_blocked=values[4 * n : 4 * n + r],
            iso_background=values[4 * n + r : 4 * n + 2 * r],
            iso_raw=raw,
            seconds=tail[0],
            base_rss=int(tail[1]),
            peak_rss=int(tail[2]),
            peak_pss=int(tail[3]),
        )


# --------------------------------------------------------------------------- report


@dataclass
class Baselines:
    """Raw writes and synchronous saves, measured in pairs (slowest rank, seconds)."""

    raw: list[float]
    sync: list[float]
    sync_rss: int

    @property
    def sync_s(self) -> float:
        return statistics.median(self.sync)

    @property
    def raw_s(self) -> float:
        return statistics.median(self.raw)


def baselines(local: dict[str, torch.Tensor], root: str, args: argparse.Namespace) -> Baselines:
    """A warm-up of each, then ``--repeats`` pairs (raw write, synchronous save)."""
    strategy = TorchDistSaveShardedStrategy(thread_count=args.thread_count)
    raw, sync, peak = [], [], 0
    for i in range(args.repeats + 1):
        raw_s = raw_once(local, root, f"raw{i}", args.thread_count)
        path = fresh_dir(root, f"sync{i}")
        with measured() as m:
            dc.save(row_sharded(local), path, strategy)
        drop_dir(path)
        if i > 0:  # the first pair warms up (imports, first-call costs, the page cache)
            raw.append(raw_s)
            sync.append(m[0].seconds)
            peak = max(peak, m[0].peak_rss)
    return Baselines(raw, sync, peak)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f} ms"


def _list(seconds: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in seconds) + "] s"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:5.1f}%"


def _median_ratio(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerators, denominators))


def report(name: str, r: Result, nbytes: int, base: Baselines, args: argparse.Namespace) -> None:
    sync_s, raw_s = base.sync_s, base.raw_s
    log(f"\n-- {name} caller: {args.steps} saves in a loop of {r.seconds:.1f} s --")
    log(
        f"{'save':>5} {'blocked':>11} {'= save()':>11} {'+ schedule':>11} {'% sync':>7} "
        f"{'background':>11} {'throughput':>11} {'% raw':>7}"
    )
    for i in range(args.steps):
        log(
            f"{i:>5} {_ms(r.blocked[i])} {_ms(r.save_part[i])} {_ms(r.schedule_part[i])} "
            f"{_pct(r.blocked[i], sync_s):>7} {_ms(r.background[i])} "
            f"{fmt_gbps(nbytes, r.background[i]):>11} {_pct(raw_s, r.background[i]):>7}"
        )
    for i in range(args.repeats):  # % of the raw write measured just before
        log(
            f"{'iso' + str(i):>5} {_ms(r.iso_blocked[i])} {'':23} "
            f"{_pct(r.iso_blocked[i], sync_s):>7} {_ms(r.iso_background[i])} "
            f"{fmt_gbps(nbytes, r.iso_background[i]):>11} "
            f"{_pct(r.iso_raw[i], r.iso_background[i]):>7}"
        )
    # Save 0 pays one-time costs (the persistent worker's start, moving tensors to shared
    # memory); the steady state is saves 1.. and the isolated saves.
    steady = (r.blocked[1:] or r.blocked) + r.iso_blocked
    blocked = statistics.median(steady)
    met = "met" if blocked <= BLOCKED_TARGET * sync_s else "MISSED"
    log(
        f"blocked per save (median of saves 1.. and iso): {_ms(blocked).strip()} = "
        f"{_pct(blocked, sync_s).strip()} of the sync save (max {_ms(max(steady)).strip()}) "
        f"[target <= {BLOCKED_TARGET:.0%}: {met}]"
    )
    iso = _median_ratio(r.iso_raw, r.iso_background)
    loop = raw_s / statistics.median(r.background[1:] or r.background)
    met = "met" if iso >= THROUGHPUT_TARGET else "MISSED"
    log(
        f"background throughput: isolated {100 * iso:.1f}% of raw (median of pairs), in the "
        f"loop {100 * loop:.1f}% (median of saves 1.., against the median raw) "
        f"[target >= {THROUGHPUT_TARGET:.0%}: {met} (isolated)]"
    )
    if args.memory_interval > 0:
        pss = f", peak PSS {fmt_mib(r.peak_pss).strip()}" if args.pss else ""
        log(
            f"memory per rank (largest, loop only): before {fmt_mib(r.base_rss).strip()}, "
            f"peak RSS {fmt_mib(r.peak_rss).strip()}{pss} (rank with its children, sampled "
            f"every {args.memory_interval:g} s)"
        )


# --------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=1024, help="state size, all ranks")
    parser.add_argument("--steps", type=int, default=4, help="saves per caller kind")
    parser.add_argument("--compute-seconds", type=float, default=3.0, help="per step")
    parser.add_argument("--iter-seconds", type=float, default=0.05, help="per iteration")
    parser.add_argument("--compute", choices=("sleep", "matmul"), default="sleep")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--thread-count", type=int, default=2, help="files per rank")
    parser.add_argument("--cached-metadata", action="store_true")
    parser.add_argument("--callers", default="temporal,persistent,persistent-shared")
    parser.add_argument("--repeats", type=int, default=3, help="baseline and isolated pairs")
    parser.add_argument("--memory-interval", type=float, default=0.02, help="seconds, 0: off")
    parser.add_argument("--pss", action="store_true", help="also sample PSS (perturbs timings)")
    parser.add_argument("--no-verify", action="store_true", help="skip the load check")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    return parser.parse_args()


@contextlib.contextmanager
def process_group(device: str) -> Iterator[torch.device]:
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl")
        yield torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo")
        yield torch.device("cpu")
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    with process_group(args.device) as device:
        root = os.path.join(args.dir or tempfile.gettempdir(), "dist_ckpt_async_bench")
        if rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
        dist.barrier()
        try:
            local = make_state(args.size_mib, device)
            nbytes_rank = sum(t.numel() * t.element_size() for t in local.values())
            total = torch.tensor([nbytes_rank], dtype=torch.int64)
            dist.all_reduce(total)
            nbytes = int(total)
            base = baselines(local, root, args)
            log(
                f"== async save: {fmt_mib(nbytes).strip()} in total, {TENSORS} tensors per rank "
                f"on {args.device}, {world()} ranks, {args.thread_count} files per rank, "
                f"{args.steps} steps of {args.compute_seconds:g} s ({args.compute}) =="
            )
            log(
                f"raw write: median {base.raw_s:.3f} s ({fmt_gbps(nbytes, base.raw_s).strip()}) "
                f"of {_list(base.raw)}; sync save: median {base.sync_s:.3f} s "
                f"({fmt_gbps(nbytes, base.sync_s).strip()}) of {_list(base.sync)}, "
                f"{100 * _median_ratio(base.raw, base.sync):.1f}% of raw (median of pairs), "
                f"peak RSS {fmt_mib(base.sync_rss).strip()} per rank"
            )
            results: dict[str, Result] = {}
            for name in args.callers.split(","):
                results[name] = Trainer(args, local, root).run(name, CALLERS[name])
                report(name, results[name], nbytes, base, args)
            if {"temporal", "persistent"} <= set(results):
                med = {
                    n: statistics.median((r.blocked[1:] or r.blocked) + r.iso_blocked)
                    for n, r in results.items()
                }
                verdict = "met" if med["persistent"] < med["temporal"] else "MISSED"
                log(
                    f"\nblocked per save (median of saves 1.. and iso): persistent "
                    f"{_ms(med['persistent']).strip()}, temporal {_ms(med['temporal']).strip()} "
                    f"[target: persistent below temporal: {verdict}]"
                )
        finally:
            dist.barrier()
            if rank() == 0:
                shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
