"""How fast each layout's writer turns many small tensors into one data file.

    python bench/item_writers.py [--tensors 5000] [--sizes-kib 4,8,16,32,64] [--repeat 15]

One thread, one file, no ``fsync`` (what the item loop itself costs, not the disk):

- ``torch_dist``: each tensor as a ``torch.save`` archive through the item stream
  (``engine/storage/item_stream.py``) with its CRC32C blocks, as a ``torch_dist`` data file
  is written (``write_workers.write_bucket_file``'s loop: padding, one item after another);
- ``raw_bytes``: the tensors' bytes at 64-byte offsets, batched into positional calls
  (``engine/raw/data_files.py``), with their CRC32C blocks;
- ``raw``: the same tensor bytes copied into one buffer beforehand, then written in 1 MiB
  calls (the floor: no per-tensor work at all).

Prints, per writer, the median wall time, microseconds per tensor, the user and system
CPU time of that run, and the ratio to ``raw``. Tensors cycle through ``--sizes-kib``.
Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from collections.abc import Callable

import torch

from dist_checkpointing.engine.raw import data_files
from dist_checkpointing.engine.storage.item_stream import ChecksumStream
from dist_checkpointing.engine.storage.item_writer import item_padding
from dist_checkpointing.engine.storage.local import LocalFileSystem
from dist_checkpointing.engine.storage.staging_pool import TensorItemWriter

MIB = 1 << 20
BLOCK = 1 << 20  # the default CHECKSUM_BLOCK_BYTES


def torch_dist_file(path: str, tensors: list[torch.Tensor]) -> int:
    with LocalFileSystem().open_write(path) as raw:
        stream = ChecksumStream(raw, BLOCK)
        writer = TensorItemWriter([(None, t) for t in tensors])
        offset = 0
        for i, t in enumerate(tensors):
            pad = item_padding(offset, t.nbytes)
            if pad:
                offset += stream.write(bytes(pad))
            stream.begin_item()
            offset += writer.write(stream, i, t)
            stream.end_item()
        writer.close()
        stream.flush()
    return offset


def raw_bytes_file(path: str, tensors: list[torch.Tensor]) -> int:
    items, offset = [], 0
    for t in tensors:
        offset = -(-offset // 64) * 64
        items.append((offset, t.nbytes, t))
        offset += t.nbytes
    with open(path, "wb") as stream:
        data_files._write_items(data_files._Out(stream, None, None), items, BLOCK, [], None, True)
    return offset


def raw_file(path: str, data: torch.Tensor) -> int:
    view = memoryview(data.numpy()).cast("B")
    with open(path, "wb", buffering=0) as stream:
        for start in range(0, len(view), MIB):
            os.pwritev(stream.fileno(), [view[start : start + MIB]], start)
    return len(view)


def timed(fn: Callable[[str], int], directory: str, repeat: int) -> list[tuple[float, ...]]:
    """(wall, user, system) seconds of each of ``repeat`` runs after a warm-up."""
    runs = []
    for i in range(repeat + 1):
        path = os.path.join(directory, f"f{i}")
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        fn(path)
        wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        os.unlink(path)
        if i:
            runs.append((wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tensors", type=int, default=5000)
    parser.add_argument("--sizes-kib", default="4,8,16,32,64")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    sizes = [int(float(s) * 1024) // 4 for s in args.sizes_kib.split(",")]
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(sizes[i % len(sizes)], generator=gen) for i in range(args.tensors)]
    flat = torch.cat(tensors)
    writers: dict[str, Callable[[str], int]] = {
        "torch_dist": lambda p: torch_dist_file(p, tensors),
        "raw_bytes": lambda p: raw_bytes_file(p, tensors),
        "raw": lambda p: raw_file(p, flat),
    }
    print(f"{args.tensors} tensors, {flat.nbytes / MIB:.1f} MiB, one file, no fsync")
    print(f"{'writer':>10} {'wall ms':>8} {'us/t':>7} {'user ms':>8} {'sys ms':>7} {'x raw':>6}")
    with tempfile.TemporaryDirectory(prefix="item_writers_") as directory:
        medians = {}
        for name, fn in writers.items():
            runs = sorted(timed(fn, directory, args.repeat))
            medians[name] = runs[len(runs) // 2]
        for name, (wall, user, system) in medians.items():
            ratio = wall / medians["raw"][0]
            per = wall / args.tensors * 1e6
            print(
                f"{name:>10} {wall * 1e3:8.1f} {per:7.2f} {user * 1e3:8.1f} "
                f"{system * 1e3:7.1f} {ratio:6.2f}"
            )


if __name__ == "__main__":
    main()
