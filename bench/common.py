"""Shared pieces of the benchmarks: timing across ranks, peak RSS, the raw baseline.

Run the benchmarks with torchrun (``make bench`` does), e.g.
``torchrun --standalone --nproc_per_node=2 bench/save_load.py``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def row_sharded(local: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Each tensor as this rank's block, on axis 0, of a global tensor over the ranks.

    The rank and world size are asked once (``dist.get_rank`` costs about a
    microsecond: per tensor it would be timed as part of every save and load)."""
    from dist_checkpointing import ShardedTensor

    where = (0, rank(), world())
    return {k: ShardedTensor.from_rank_offsets(k, t, where) for k, t in local.items()}


def init_gloo(default_port: int) -> None:
    """Join the gloo group torchrun set up, or (plain ``python``) a group of this one
    process on 127.0.0.1 (``MASTER_PORT`` or ``default_port``)."""
    if "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(default_port))
    dist.init_process_group("gloo", rank=0, world_size=1)


def log(msg: str) -> None:
    if rank() == 0:
        print(msg, flush=True)


class _TreeRSS:
    """RSS of a process and its children (writer workers count too).

    Listing the children scans every process of the machine (about 1.8 ms of CPU here,
    mostly holding the GIL): sampled every 5 ms, that took a quarter of a core from
    the Python-bound method being timed. So the list is refreshed only every
    ``children_every_s``; each sample reads the known processes' RSS (tens of us)."""

    def __init__(self, proc: psutil.Process, children_every_s: float = 0.1) -> None:
        self.proc = proc
        self.every = children_every_s
        self.children: list[psutil.Process] = []
        self.listed = -math.inf

    def __call__(self) -> int:
        now = time.monotonic()
        if now - self.listed >= self.every:
            with contextlib.suppress(psutil.Error):
                self.children = self.proc.children(recursive=True)
            self.listed = now
        total = 0
        for p in (self.proc, *self.children):
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total


class PeakSampler:
    """Samples ``measure()`` (a tuple of ints) in a background thread every ``interval_s``
    (0: only on entry, and on exit with ``on_exit``) and keeps the largest of each value
    (``top``); ``first`` holds the values on entry."""

    def __init__(
        self, measure: Callable[[], tuple[int, ...]], interval_s: float, on_exit: bool = False
    ) -> None:
        self.measure = measure
        self.interval_s = interval_s
        self.on_exit = on_exit
        self.first: tuple[int, ...] = ()
        self.top: tuple[int, ...] = ()
        self._stop = threading.Event()

    def _update(self) -> None:
        self.top = tuple(map(max, self.top, self.measure()))

    def __enter__(self) -> PeakSampler:
        self.first = self.top = self.measure()
        if self.interval_s <= 0:  # off: the timings are then free of the sampling's cost
            self._stop.set()

        def sample() -> None:
            while not self._stop.wait(self.interval_s):
                self._update()

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.on_exit:
            self._update()


class PeakRSS(PeakSampler):
    """This rank's (and its children's) peak RSS, sampled in a background thread."""

    def __init__(self, interval_s: float = 0.005) -> None:
        tree = _TreeRSS(psutil.Process())
        super().__init__(lambda: (tree(),), interval_s)

    @property
    def peak(self) -> int:
        return self.top[0]


@dataclass
class Measurement:
    seconds: float  # slowest rank, between two barriers
    peak_rss: int  # largest over ranks
    rss_growth: int = 0  # peak RSS above the RSS at the start, largest over ranks


@contextlib.contextmanager
def measured() -> Iterator[list[Measurement]]:
    """Time a collective phase (barrier to barrier, slowest rank) and its peak RSS.

    A full garbage collection runs first, outside the time: the phase then pays only for
    collections its own allocations cause. Otherwise a full pass over the heap that earlier
    phases left due (about 125 ms over this process's 250,000 objects on the development
    VM, one save in 3 to 8) lands in whichever phase happens to allocate next.
    """
    out: list[Measurement] = []
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
    with PeakRSS() as rss:
        before = rss.first[0]
        start = time.perf_counter()
        yield out
        if dist.is_initialized():
            dist.barrier()
        elapsed = time.perf_counter() - start
    t = torch.tensor([elapsed, float(rss.peak), float(rss.peak - before)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out.append(Measurement(float(t[0]), int(t[1]), max(int(t[2]), 0)))


def host_buffer(nbytes: int) -> Any:
    """A writable buffer of ``nbytes`` from torch's allocator, like the tensors the methods
    save and load. (Torch backs large allocations with transparent huge pages; into a
    ``bytearray``'s 4 KiB pages the baseline read 512 MiB from the page cache in 152-176 ms
    against 57-61 ms on the development VM, which flattered every method compared with
    it.)"""
    return torch.empty(nbytes, dtype=torch.uint8).numpy()


def raw_blob(tensors: list[torch.Tensor]) -> Any:
    """This rank's bytes in one buffer (built outside the timed region: the baseline
    measures the disk, not a copy; see :func:`host_buffer`)."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    blob = host_buffer(total)
    pos = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        blob[pos : pos + n] = memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())
        pos += n
    return blob


# The baseline writes each file in one sequential pass of 1 MiB writes, the size our
# writers use (the WRITE_CALL_BYTES knob): on the development VM, writes of 2 MiB or more
# from one buffer cost 2-5x the kernel time, erratically (1 GiB in two files with 8 MiB
# writes: 0.54-1.43 s; with 1 MiB writes: 0.54-0.55 s), which would flatter every method
# compared with it.
RAW_WRITE_PIECE = 1 << 20


def _per_file(view: memoryview, files: int) -> list[memoryview]:
    per_file = -(-len(view) // files)
    return [view[i * per_file : (i + 1) * per_file] for i in range(files)]


def _in_threads(fn: Callable[[int, memoryview], None], parts: list[memoryview]) -> None:
    """``fn(i, part)`` for every part, one thread each (as the writers under test do)."""
    threads = [threading.Thread(target=fn, args=(i, p)) for i, p in enumerate(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def raw_write(directory: str, blob: Any, files: int) -> None:
    """The baseline: this rank's bytes in ``files`` files, one thread per file, each
    written sequentially in large pieces and fsynced."""

    def write(i: int, chunk: memoryview) -> None:
        with open(os.path.join(directory, f"raw_{rank()}_{i}.bin"), "wb", buffering=0) as f:
            while chunk:
                chunk = chunk[f.write(chunk[:RAW_WRITE_PIECE]) :]
            os.fsync(f.fileno())

    _in_threads(write, _per_file(memoryview(blob), files))


def raw_read(directory: str, blob: Any, files: int) -> None:
    """Read the baseline's files back into ``blob`` (allocated by the caller, outside
    the timed region), one thread per file."""

    def read(i: int, chunk: memoryview) -> None:
        with open(os.path.join(directory, f"raw_{rank()}_{i}.bin"), "rb", buffering=0) as f:
            while chunk:
                n = f.readinto(chunk)
                if not n:
                    break
                chunk = chunk[n:]

    _in_threads(read, _per_file(memoryview(blob), files))


def evict(directory: str) -> None:
    """Drop ``directory``'s files from the page cache (they are flushed first), so that
    the next read comes from the disk: ``posix_fadvise(POSIX_FADV_DONTNEED)``, which
    needs no privileges. Every rank may call it on the same files."""
    for root, _dirs, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fresh_dir(root: str, name: str) -> str:
    """``root/name``, emptied by rank 0; every rank returns once it exists."""
    path = os.path.join(root, name)
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    if dist.is_initialized():
        dist.barrier()
    return path


def drop_dir(path: str) -> None:
    """Remove ``path`` (rank 0) once every rank is done with it."""
    if dist.is_initialized():
        dist.barrier()
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def bench_root(name: str, parent: str | None = None) -> Iterator[str]:
    """A fresh ``parent/name`` (default parent: the temp dir) for one benchmark run;
    at the end, once every rank is done, it is removed and the process group destroyed."""
    root = fresh_dir(parent or tempfile.gettempdir(), name)
    try:
        yield root
    finally:
        drop_dir(root)
        dist.destroy_process_group()


def fmt_gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:6.2f} GB/s"


def fmt_mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:7.0f} MiB"


def log_table(nbytes: int, results: dict[str, dict[str, Measurement]], width: int = 6) -> None:
    """One line per method and operation: seconds, throughput, peak RSS per rank."""
    log(f"{'method':{width}} {'op':5} {'seconds':>8} {'throughput':>12} {'peak RSS/rank':>14}")
    for method, ops in results.items():
        for op, m in ops.items():
            log(
                f"{method:{width}} {op:5} {m.seconds:8.3f} {fmt_gbps(nbytes, m.seconds):>12} "
                f"{fmt_mib(m.peak_rss):>14}"
            )
