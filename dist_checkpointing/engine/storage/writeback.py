"""Starting the write-back of a data file while the rest of it is still being written.

A synced save ends each data file with ``fsync``, which waits until every dirty page of
the file is on the disk. Left alone, the kernel starts writing a freshly written file's
pages only at that ``fsync`` (or when far more memory is dirty than one save makes), so
the disk idles while the file is written and the writer idles while the disk works.
:class:`Writeback` asks the kernel (Linux ``sync_file_range`` with
``SYNC_FILE_RANGE_WRITE``) to start writing each ``WRITEBACK_BYTES`` of the file as soon
as they are written, so the two overlap and the final ``fsync`` has less left to wait for.

It changes no byte and promises nothing: durability still comes from the ``fsync``
(and the commit protocol's ordering); a file system or platform without the call just
waits at the ``fsync`` as before. Measured on a 16-core host with a virtio disk, two
files written by two threads: 1 GiB in 0.60-0.86 s without, 0.49-0.55 s with it.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Any

from .. import knobs

logger = logging.getLogger(__name__)

_SYNC_FILE_RANGE_WRITE = 2  # start write-out of dirty pages in the range; do not wait


def _load() -> Any:
    """libc's ``sync_file_range`` (None where there is none)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load()


class Writeback:
    """Starts the write-back of one open file every ``every`` bytes written.

    Call :meth:`advance` with the end offset of what was written so far (bytes still in
    a Python buffer are simply started later, by the next call or the ``fsync``). Calls
    release the GIL, and do not wait for the disk unless its request queue is full.
    """

    __slots__ = ("_fd", "_started", "every")

    def __init__(self, fd: int, every: int) -> None:
        self._fd = fd
        self.every = every  # bytes written between two starts
        self._started = 0  # write-back was started for the bytes before this offset

    def advance(self, end: int) -> None:
        """The file's bytes before ``end`` were written."""
        if end - self._started < self.every:
            return
        if _sync_file_range(self._fd, self._started, end - self._started, _SYNC_FILE_RANGE_WRITE):
            errno = ctypes.get_errno()
            logger.debug("sync_file_range on fd %d failed (errno %d): off", self._fd, errno)
            self.every = 1 << 62  # this file system does not take it: stop asking
            return
        self._started = end


def writeback_for(fd: int | None) -> Writeback | None:
    """A :class:`Writeback` for the local file open as ``fd``; None where write-back
    cannot be started (no descriptor, no ``sync_file_range``) or the knob is 0."""
    every = knobs.WRITEBACK_BYTES.get()
    if fd is None or every <= 0 or _sync_file_range is None:
        return None
    return Writeback(fd, every)


__all__ = ["Writeback", "writeback_for"]
