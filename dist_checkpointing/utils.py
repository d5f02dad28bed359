"""Small process-level helpers shared by the save and load paths."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the duration of the block.

    Planning a checkpoint of many small tensors allocates many small objects
    while a large object graph (the state dict) is alive; the collector's
    full passes then take about half of the time. In a forked writer process,
    a collection could also free objects inherited from the parent (e.g. CUDA
    tensors) whose teardown is only valid in the parent. Reference counting
    still frees everything that is not in a cycle.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
