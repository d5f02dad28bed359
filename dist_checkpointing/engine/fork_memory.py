"""Forks that never read the trainer's tensors, kept from sharing them.

A fork shares every private page of the parent with the child, copy-on-write: every page
becomes write-protected in the parent, and stays shared for as long as the child lives.
Two of our forks never read the trainer's tensors: the persistent async worker
(:mod:`.async_save.worker`, which lives as long as the trainer; requests bring their bytes
in shared memory) and the parse guard of a pickled ``.metadata``
(:mod:`.safety.cpu_bounded`, forked by every load of a ``torch_dist`` checkpoint). For
them the sharing only costs:

- the trainer's first write to each page after the fork faults (and copies the page while
  the child lives): the load that follows the parse guard, or the first optimizer step
  after the worker started, runs several times slower (1 GiB in 200 tensors loaded in
  place on the development VM: 0.86-0.95 s after the guard's fork, 0.52 s without it);
- the worker keeps the old copy of each page the trainer writes: its resident memory grows
  toward the size of the trainer's CPU state (model and optimizer state held on the CPU are
  held twice).

:func:`tensors_wiped_on_fork` marks the page-aligned inside of every large CPU tensor
storage of the trainer ``MADV_WIPEONFORK`` (Linux 4.14 and later) around the fork, and
unmarks it right after: the child gets zero-filled pages there, the trainer's pages are
neither shared nor write-protected. The first and last partial page of each storage (where
the allocator keeps its bookkeeping) are shared as usual, so memory the child might free
or reuse stays valid, and reads of a wiped range in the child return zeros, never fault.
The storages are held alive while marked. Where ``madvise`` refuses a range (not private
anonymous memory: shared memory, pinned host memory from a driver; an older kernel) it is
shared as before. Off with ``DIST_CKPT_WIPE_TENSORS_ON_FORK=0``.

The tensors are found by walking the garbage collector's objects once per fork (about
0.2 s per million objects here); tensors with no Python object (held only by C++) are not
found and are shared as before. The marks last from just before the fork to just after it
(milliseconds): a process that another thread of the trainer forked in that window (and
that does not ``exec``) would see zeros in those tensors too. Both our forks run on the
caller's thread, as data-loader workers are usually started, so they never overlap those.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import mmap
import sys
import time
from collections.abc import Iterator
from typing import Any

from . import knobs

logger = logging.getLogger(__name__)

MADV_WIPEONFORK = 18  # Linux uapi values (asm-generic/mman-common.h)
MADV_KEEPONFORK = 19
MIN_RANGE_BYTES = 1 << 20  # smaller storages are not worth a split of their mapping
MAX_RANGES = 16384  # each range splits a mapping in up to three (vm.max_map_count: 65530)


def tensor_ranges(min_bytes: int = MIN_RANGE_BYTES) -> tuple[list[tuple[int, int]], list[Any]]:
    """The page-aligned ``(address, length)`` insides of the CPU tensor storages with a
    Python object, at least ``min_bytes`` long, largest first (at most :data:`MAX_RANGES`),
    and the storages themselves (hold them while the ranges are in use)."""
    import torch

    page = mmap.PAGESIZE
    found: dict[int, tuple[int, Any]] = {}
    tensor = torch.Tensor
    is_tensor_type: dict[type, bool] = {}  # one issubclass per type, not per object
    for obj in gc.get_objects():
        # type(), not isinstance: no object's __class__ hook runs (some proxies warn).
        cls = type(obj)
        hit = is_tensor_type.get(cls)
        if hit is None:
            hit = is_tensor_type[cls] = issubclass(cls, tensor)
        if not hit:
            continue
        try:
            if not obj.is_cpu or obj.layout != torch.strided:
                continue
            storage = obj.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except Exception:  # noqa: BLE001  (tensor subclasses, fakes, freed storages)
            continue
        if nbytes >= min_bytes and ptr not in found:
            found[ptr] = (nbytes, storage)
    ranges: list[tuple[int, int, Any]] = []
    for ptr, (nbytes, storage) in found.items():
        start = -(-ptr // page) * page
        end = (ptr + nbytes) // page * page
        if end - start >= min_bytes:
            ranges.append((start, end - start, storage))
    ranges.sort(key=lambda r: -r[1])
    ranges = ranges[:MAX_RANGES]
    return [(a, n) for a, n, _ in ranges], [s for _, _, s in ranges]


def _madvise() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


@contextlib.contextmanager
def tensors_wiped_on_fork(enabled: bool | None = None) -> Iterator[int]:
    """Within the block, a fork gives the child zero pages in place of the large CPU tensor
    storages of this process (see the module docstring); yields the bytes so marked (0
    where nothing was: off, not Linux, or every range refused). ``enabled``: default,
    the ``WIPE_TENSORS_ON_FORK`` knob."""
    if enabled is None:
        enabled = bool(knobs.WIPE_TENSORS_ON_FORK.get())
    if not enabled or not sys.platform.startswith("linux"):
        yield 0
        return
    began = time.perf_counter()
    ranges, storages = tensor_ranges()
    madvise = _madvise()
    marked = [(a, n) for a, n in ranges if madvise(a, n, MADV_WIPEONFORK) == 0]
    wiped = sum(n for _, n in marked)
    logger.debug(
        "%d of %d tensor ranges (%d MiB) wiped on fork; found in %.3f s",
        len(marked),
        len(ranges),
        wiped >> 20,
        time.perf_counter() - began,
    )
    try:
        yield wiped
    finally:
        for a, n in marked:
            madvise(a, n, MADV_KEEPONFORK)
        del storages


__all__ = ["MADV_KEEPONFORK", "MADV_WIPEONFORK", "tensor_ranges", "tensors_wiped_on_fork"]
