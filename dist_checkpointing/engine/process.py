"""Small process-level helpers shared by the save and load paths."""

from __future__ import annotations

import gc
import signal
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


def describe_exit(exitcode: int | None) -> str:
    """How a child process ended, for error messages ("was killed by signal SIGKILL")."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        hint = " (file size limit exceeded)" if name == "SIGXFSZ" else ""
        return f"was killed by signal {name}{hint}"
    return f"exited with code {exitcode}"
