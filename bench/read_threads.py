"""How fast one rank reads from the page cache with more threads than files, and what an
inline CRC32C of each piece costs: the measurement behind the reading threads'
defaults (``READ_THREADS``, :mod:`dist_checkpointing.engine.storage.read_spans`).

    python bench/read_threads.py [--procs 2] [--size-mib 1024] [--repeat 6]

Each process (a stand-in for a rank) writes ``--size-mib`` MiB in two files, reads them
once into the page cache, then reads them again and again into one preallocated tensor:
``raw``, two threads each reading a whole file with one call (the table's baseline);
then 2, 4 and 8 threads each reading an equal share of the bytes in pieces of 1 or 8 MiB,
without and with the CRC32C of each piece computed right after it landed (``inline``),
or handed to a pool of 4 hashing threads (``handoff``). Several processes run each
configuration at the same moment (a barrier). It prints the best and median time of the
slowest process. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from crc32c import crc32c

MIB = 1 << 20
FILES = 2

Config = tuple[str, int, int]  # (mode, threads, piece bytes)
CONFIGS: list[Config] = [("raw", FILES, 0)]
CONFIGS += [(m, t, p) for t in (2, 4, 8) for p in (MIB, 8 * MIB) for m in ("none", "inline")]
CONFIGS += [("handoff", 2, 8 * MIB), ("handoff", 4, 8 * MIB)]


def make_files(directory: str, tag: int, file_bytes: int) -> list[str]:
    paths = [os.path.join(directory, f"read_threads_{tag}_{i}.bin") for i in range(FILES)]
    for path in paths:
        with open(path, "wb") as f:
            for _ in range(file_bytes // (64 * MIB)):
                f.write(os.urandom(64 * MIB))
            f.write(os.urandom(file_bytes % (64 * MIB)))
        with open(path, "rb") as f:  # into the page cache
            while f.read(64 * MIB):
                pass
    return paths


def read_once(
    paths: list[str], view: memoryview, file_bytes: int, config: Config, hashers: Any
) -> float:
    mode, threads, piece = config
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    total = FILES * file_bytes
    pending: list[Future[int]] = []

    def share(lo: int, hi: int) -> None:
        value = 0
        for start in range(lo, hi, piece):
            end = min(hi, start + piece)
            f, at = divmod(start, file_bytes)
            os.preadv(fds[f], [view[start:end]], at)
            if mode == "inline":
                value = crc32c(view[start:end], value)
            elif mode == "handoff":
                pending.append(hashers.submit(crc32c, view[start:end]))

    def whole(i: int) -> None:
        part = view[i * file_bytes : (i + 1) * file_bytes]
        done = 0
        while done < len(part):
            done += os.preadv(fds[i], [part[done:]], done)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        if mode == "raw":
            list(pool.map(whole, range(FILES)))
        else:
            step = -(-total // threads)
            list(pool.map(lambda i: share(i * step, min(total, (i + 1) * step)), range(threads)))
    for job in pending:
        job.result()
    seconds = time.perf_counter() - start
    for fd in fds:
        os.close(fd)
    return seconds


def run(tag: int, args: argparse.Namespace, barrier: Any, results: Any) -> None:
    file_bytes = (args.size_mib * MIB) // FILES
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        paths = make_files(directory, tag, file_bytes)
        dest = torch.empty(FILES * file_bytes, dtype=torch.uint8)
        dest.fill_(1)  # touched: no page faults in the timed reads
        view = memoryview(dest.numpy()).cast("B")
        hashers = ThreadPoolExecutor(4)
        times: dict[Config, list[float]] = {}
        for _ in range(args.repeat):
            for config in CONFIGS:
                if barrier is not None:
                    barrier.wait()
                times.setdefault(config, []).append(
                    read_once(paths, view, file_bytes, config, hashers)
                )
        hashers.shutdown()
    results.put(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--procs", type=int, default=1, help="processes reading at once")
    parser.add_argument("--size-mib", type=int, default=1024, help="bytes per process")
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(args.procs) if args.procs > 1 else None
    procs = [ctx.Process(target=run, args=(i, args, barrier, results)) for i in range(args.procs)]
    for p in procs:
        p.start()
    every = [results.get() for _ in procs]
    for p in procs:
        p.join()
    print(f"{args.procs} process(es) x {args.size_mib} MiB in {FILES} files, {os.cpu_count()} CPUs")
    for config in CONFIGS:
        mode, threads, piece = config
        best = max(min(t[config]) for t in every)
        median = max(statistics.median(t[config]) for t in every)
        size = f"{piece // MIB} MiB pieces" if piece else "whole files"
        rate = args.size_mib * MIB / best / 1e9
        print(
            f"  {mode:8s} {threads} threads, {size:13s} best {best * 1e3:7.1f} ms "
            f"({rate:5.1f} GB/s)  median {median * 1e3:7.1f} ms"
        )


if __name__ == "__main__":
    main()
