"""Positional reads and writes of local files: ``os.preadv`` and ``os.pwritev``.

A positional call names its offset and leaves the file position alone, so several
threads read (or write) one open file side by side without a lock. Both layouts'
readers and the ``raw_bytes`` writer go through :func:`vectored_all`; a stream without
a descriptor (object storage) is read and written in order instead.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any

#: Buffers per ``preadv``/``pwritev`` call (Linux's ``IOV_MAX``).
IOV_MAX = 1024


def descriptor(stream: Any) -> int | None:
    """The descriptor of a local file open as ``stream`` (read and written with
    ``os.preadv``/``os.pwritev``), else None."""
    if not hasattr(os, "preadv") or not hasattr(os, "pwritev"):
        return None
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError, TypeError, io.UnsupportedOperation):
        return None
    return fd if isinstance(fd, int) else None


def vectored_all(
    call: Callable[[int, list[memoryview], int], int],
    fd: int,
    buffers: list[Any],
    offset: int,
    on_short: Callable[[int], Exception],
) -> None:
    """``call`` (``os.pwritev`` or ``os.preadv``) over ``buffers`` back to back from
    ``offset``, at most :data:`IOV_MAX` buffers per call; a short transfer continues,
    none at all raises ``on_short(offset)`` (the offset it stopped at)."""
    views = [memoryview(b).cast("B") for b in buffers]
    i = 0
    while i < len(views):
        done = call(fd, views[i : i + IOV_MAX], offset)
        if done <= 0:
            raise on_short(offset)
        offset += done
        while i < len(views) and done >= len(views[i]):
            done -= len(views[i])
            i += 1
        if done:
            views[i] = views[i][done:]


def write_all_at(fd: int, buffers: list[Any], offset: int, nbytes: int = 0) -> None:
    """``buffers`` written back to back at ``offset`` of ``fd``: one ``os.pwritev`` where
    it takes them all (``nbytes``, their total, known: no view of each buffer is made);
    else, or after a short write, all of them again through :func:`vectored_all`
    (positional writes: rewriting is harmless)."""
    _all_at(os.pwritev, fd, buffers, offset, nbytes, _short_write)


def read_all_at(
    fd: int, buffers: list[Any], offset: int, nbytes: int, on_short: Callable[[int], Exception]
) -> None:
    """``buffers`` filled back to back from ``offset`` of ``fd``: one ``os.preadv`` where
    it fills them all (``nbytes``, their total); else, or after a short read, all of them
    again through :func:`vectored_all` (positional reads: rereading is harmless)."""
    _all_at(os.preadv, fd, buffers, offset, nbytes, on_short)


def _all_at(
    call: Callable[[int, list[Any], int], int],
    fd: int,
    buffers: list[Any],
    offset: int,
    nbytes: int,
    on_short: Callable[[int], Exception],
) -> None:
    """One ``call`` over ``buffers`` where it moves all ``nbytes`` (0: not known), else
    :func:`vectored_all` from the start."""
    if nbytes and len(buffers) <= IOV_MAX and call(fd, buffers, offset) == nbytes:
        return
    vectored_all(call, fd, buffers, offset, on_short)


def _short_write(offset: int) -> Exception:
    return OSError(f"pwritev wrote nothing at offset {offset}")


__all__ = ["IOV_MAX", "descriptor", "read_all_at", "vectored_all", "write_all_at"]
