"""Sharing the reads of one load among a rank's reading threads by bytes, not by files.

Reading a local file from the page cache is a copy by the kernel, a few GB/s per thread;
several threads copy side by side up to what the memory bus takes. A rank writes few data
files (``SAVE_THREAD_COUNT``, 2 by default), so one thread per file left most of a host's
cores idle while a rank loaded. Measured on a 16-core host, 1 GiB in two files from the
page cache: 84 ms on two threads (one per file), 48 ms on four, 33 ms on eight (each
reading pieces of 1 MiB, the CRC32C of each piece inline: 114, 62 and 42 ms).

:func:`split_spans` cuts each file's reads, in offset order, into runs of consecutive reads of
about :func:`span_bytes` each; the readers take runs, not files. A run is read as a whole
file was before (one open, coalesced reads, checks in offset order), and the runs are
finished in order before the first failure in file order is raised, so a damaged file is
reported as a serial load reports it. Only local file systems are cut this way
(``FileSystemIO.sequential_reads`` is false): an object store reads each file as one
stream of requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from .. import knobs

K = TypeVar("K")
T = TypeVar("T")


LARGE_READ_BYTES = 1 << 20  # reads averaging less are "small": Python per read dominates
SMALL_READ_THREADS = 4


def reading_threads(threads: int, count: int, nbytes: int) -> int:
    """Of the ``threads`` a storage offers, how many to read ``count`` reads of ``nbytes``
    bytes in all with. Reads averaging under :data:`LARGE_READ_BYTES` spend much of
    their time in Python (batching, checks), at which threads take turns: at most
    :data:`SMALL_READ_THREADS` for them. 16-core host, one rank, a verified ``raw_bytes``
    load from the page cache: 10,000 reads of 4-64 KiB took 0.111, 0.101, 0.101 and
    0.121 s on 2, 3, 4 and 8 threads; 1 GiB in 5 MiB items, 82% of the raw baseline's
    speed on 4 threads and 96% on 8 (``torch_dist``, 2 ranks). A ``READ_THREADS`` set
    explicitly is taken as it is."""
    if nbytes < count * LARGE_READ_BYTES and not knobs.READ_THREADS.get():
        return max(1, min(threads, SMALL_READ_THREADS))
    return max(1, threads)


def span_bytes(total: int, threads: int) -> int:
    """The bytes of one run: an equal share of ``total`` for each of ``threads``, and at
    least the ``READ_SPAN_BYTES`` knob (a thread's start costs about what reading a
    few hundred KiB from the page cache does)."""
    return max(knobs.READ_SPAN_BYTES.get(), -(-total // max(1, threads)))


def split_spans(
    files: Iterable[tuple[K, Sequence[T]]], length: Callable[[T], int], target: int
) -> list[tuple[K, list[T]]]:
    """Each file's items (in offset order) cut into runs of consecutive items of at least
    ``target`` bytes (a file's last run may be shorter), as ``(file, items)`` in file
    order, then offset order. An item is never cut: one larger than ``target`` is a run
    of its own, unless the caller cut it first."""
    out: list[tuple[K, list[T]]] = []
    for key, items in files:
        run: list[T] = []
        size = 0
        for item in items:
            run.append(item)
            size += length(item)
            if size >= target:
                out.append((key, run))
                run, size = [], 0
        if run:
            out.append((key, run))
    return out


__all__ = [
    "LARGE_READ_BYTES",
    "SMALL_READ_THREADS",
    "reading_threads",
    "span_bytes",
    "split_spans",
]
