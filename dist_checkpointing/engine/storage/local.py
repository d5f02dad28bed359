"""The local (POSIX) file system backend."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import BinaryIO

from .. import knobs
from .base import FileSystemIO, ReadStream

logger = logging.getLogger(__name__)


class LocalFileSystem(FileSystemIO):
    """:class:`FileSystemIO` on the local (POSIX) filesystem."""

    def join(self, directory: str, name: str) -> str:
        return os.path.join(directory, name)

    def open_write(self, path: str) -> BinaryIO:
        # Small items coalesce in the buffer; larger writes go straight to the file
        # (Python's BufferedWriter copies only writes that fit).
        buffering = knobs.WRITE_BUFFER_BYTES.get()
        return open(path, "wb", buffering=buffering)  # noqa: SIM115 - caller closes

    def open_read(self, path: str) -> ReadStream:
        # Unbuffered: reads go straight into the caller's buffers (no extra copy).
        return open(path, "rb", buffering=0)  # noqa: SIM115 - caller closes

    def fsync(self, stream: BinaryIO) -> None:
        stream.flush()
        os.fsync(stream.fileno())

    def atomic_write(self, path: str, data: bytes, *, sync: bool = True) -> None:
        tmp_path = f"{path}.tmp"
        try:
            with open(tmp_path, "wb") as stream:
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
        return os.path.exists(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def file_size(self, path: str) -> int:
        return os.stat(path).st_size


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


__all__ = ["LocalFileSystem", "fsync_directory"]
