"""The local (POSIX) file system backend."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import uuid
from typing import BinaryIO

from ...errors import UnsafeCheckpointError
from .. import knobs
from ..process import cores_per_rank
from .base import FileSystemIO, ReadStream
from .writeback import Writeback, writeback_for

logger = logging.getLogger(__name__)


class LocalFileSystem(FileSystemIO):
    """:class:`FileSystemIO` on the local (POSIX) filesystem."""

    def join(self, directory: str, name: str) -> str:
        return os.path.join(directory, name)

    def open_write(self, path: str) -> BinaryIO:
        # A new file, created exclusively: whatever entry had the name (a stale file, or
        # a symlink or hard link planted in a shared directory) is unlinked, never
        # written through.
        _unlink_entry(path)
        fd = _create_exclusive(path)
        # Writes through the stream coalesce in the buffer (Python's BufferedWriter
        # copies only writes that fit). Data files bypass it: both layouts gather their
        # writes into positional calls on the descriptor (.positional).
        buffering = knobs.WRITE_BUFFER_BYTES.get()
        return open(fd, "wb", buffering=buffering)  # noqa: SIM115 - caller closes

    def parallel_reads(self) -> int:
        # Reading from the page cache is a copy by the kernel, a few GB/s per thread:
        # a rank with cores of its own reads on several threads (up to 8, about what the
        # memory bus takes, see .read_spans), each checksumming what it read.
        return knobs.READ_THREADS.get() or min(8, cores_per_rank())

    def open_read(self, path: str) -> ReadStream:
        # Unbuffered: reads go straight into the caller's buffers (no extra copy).
        return open(open_regular_file(path), "rb", buffering=0)  # noqa: SIM115 - caller closes

    def writeback(self, stream: BinaryIO) -> Writeback | None:
        return writeback_for(stream.fileno())

    def fsync(self, stream: BinaryIO) -> None:
        stream.flush()
        os.fsync(stream.fileno())

    def atomic_write(self, path: str, data: bytes | bytearray, *, sync: bool = True) -> None:
        # A fresh, unguessable temporary name, created exclusively (never through a
        # planted symlink); the rename replaces the entry ``path``, not what it points to.
        tmp_path = f"{path}.{uuid.uuid4().hex[:16]}.tmp"
        try:
            with open(_create_exclusive(tmp_path), "wb") as stream:
                stream.write(data)
                if sync:
                    self.fsync(stream)
            os.replace(tmp_path, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp_path)
            raise
        if sync:
            # The rename is durable only once the directory entry is.
            fsync_directory(os.path.dirname(os.path.abspath(path)))

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)
        fsync_directory(os.path.dirname(os.path.abspath(dst)))

    def create_exclusive(self, path: str, data: bytes) -> bool:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(path, flags, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
            self.fsync(stream)
        fsync_directory(os.path.dirname(os.path.abspath(path)))
        return True

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def remove(self, path: str) -> None:
        os.remove(path)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)  # a dangling symlink exists (and is refused)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def file_size(self, path: str) -> int:
        return os.lstat(path).st_size


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device or other special file"


def _not_regular(path: str, mode: int) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} is {_kind(mode)}, not a regular file: refusing to open it (a checkpoint "
        f"is read only from regular files inside its directory)"
    )


def open_regular_file(path: str) -> int:
    """A file descriptor of regular file ``path``, opened read-only without following
    a symlink at ``path`` and without blocking on a FIFO.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UnsafeCheckpointError: ``path`` is a symlink, FIFO, directory or other
            non-regular file (the message says which, nothing about a link's target).
    """
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # replaced by a symlink meanwhile
            raise _not_regular(path, stat.S_IFLNK) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create_exclusive(path: str) -> int:
    """A new file ``path`` opened for writing; fails if any entry has that name."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    return os.open(path, flags, 0o666)


def _unlink_entry(path: str) -> None:
    """Remove the directory entry ``path`` if there is one (never what a link names)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "cannot write a file over a directory", path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def fsync_directory(path: str) -> None:
    """Make the entries of directory ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:  # e.g. platforms that cannot open directories
        logger.debug("cannot open directory %s to fsync it: %s", path, exc)
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems reject fsync on directories
        logger.debug("fsync of directory %s failed: %s", path, exc)
    finally:
        os.close(fd)


__all__ = ["LocalFileSystem", "fsync_directory", "open_regular_file"]
