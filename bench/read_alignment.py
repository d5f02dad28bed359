"""How fast the kernel copies file bytes from the page cache into a tensor, by the file
offset's remainder modulo 64: the measurement behind ``item_writer.item_padding`` (large
``torch_dist`` tensor items start at a multiple of 64 bytes, so their tensor bytes do).

    python bench/read_alignment.py [--size-mib 512] [--item-mib 5] [--repeat 5]

It writes ``--size-mib`` MiB to one file, reads it once into the page cache, then reads
items of ``--item-mib`` MiB (spaced by the item size plus 8 KiB, as items with headers
are) into preallocated tensors (torch's allocator gives them 64-byte aligned memory),
one ``os.preadv`` each, from file offsets that leave each remainder modulo 64 below; it
prints the best and median GB/s of ``--repeat`` rounds per remainder, rounds alternating
the remainders. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

MIB = 1 << 20
REMAINDERS = (0, 1, 8, 16, 32, 48)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--item-mib", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    item = int(args.item_mib * MIB)
    stride = item + 8192
    count = max(1, (args.size_mib * MIB - 64) // stride)
    with tempfile.TemporaryDirectory(prefix="read_alignment_") as directory:
        path = os.path.join(directory, "data.bin")
        with open(path, "wb") as f:
            f.write(os.urandom(count * stride + 64))
        fd = os.open(path, os.O_RDONLY)
        try:
            targets = [torch.empty(item, dtype=torch.uint8) for _ in range(count)]
            for i, t in enumerate(targets):  # into the page cache; the targets touched
                os.preadv(fd, [t.numpy()], i * stride)
            rates: dict[int, list[float]] = {r: [] for r in REMAINDERS}
            for _ in range(args.repeat):
                for r in REMAINDERS:
                    start = time.perf_counter()
                    for i, t in enumerate(targets):
                        os.preadv(fd, [t.numpy()], i * stride + r)
                    rates[r].append(count * item / (time.perf_counter() - start) / 1e9)
        finally:
            os.close(fd)
    print(f"{count} reads of {item / MIB:.1f} MiB from the page cache, {args.repeat} rounds")
    print("file offset % 64   best GB/s   median GB/s")
    for r, values in rates.items():
        print(f"{r:16d}   {max(values):9.2f}   {statistics.median(values):11.2f}")


if __name__ == "__main__":
    main()
