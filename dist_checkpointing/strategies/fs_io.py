"""A small filesystem abstraction for checkpoint files.

Every file the storage layer touches goes through a :class:`FileSystemIO`, so that
another backend (object storage, e.g. ``msc://`` paths) can plug in later without
``open()`` calls spread through the code. :class:`LocalFileSystem` is the only
implementation today; :func:`filesystem_for` picks the one for a path.
"""

from __future__ import annotations

import contextlib
import logging
import os
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any, BinaryIO, Protocol

from ..errors import UnsupportedFeatureError

logger = logging.getLogger(__name__)

# Buffer of files opened for writing: small items coalesce in it; writes larger than it
# go straight to the file (Python's BufferedWriter copies only writes that fit).
WRITE_BUFFER_BYTES = 256 << 10


class ReadStream(Protocol):
    """A file opened by :meth:`FileSystemIO.open_read` (a context manager)."""

    def read(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: Any, /) -> int | None: ...

    def seek(self, offset: int, whence: int = 0, /) -> int: ...

    def close(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> Any: ...


class FileSystemIO(ABC):
    """The file operations the checkpoint storage layer needs."""

    @abstractmethod
    def join(self, directory: str, name: str) -> str:
        """The path of ``name`` inside ``directory``."""

    @abstractmethod
    def open_write(self, path: str) -> BinaryIO:
        """Create (or truncate) ``path`` for writing; the caller closes it."""

    @abstractmethod
    def open_read(self, path: str) -> ReadStream:
        """Open ``path`` for reading with ``seek``/``readinto``; the caller closes it."""

    @abstractmethod
    def fsync(self, stream: BinaryIO) -> None:
        """Flush ``stream`` (opened by :meth:`open_write`) and make its bytes durable."""

    @abstractmethod
    def atomic_write(self, path: str, data: bytes, *, sync: bool = True) -> None:
        """Replace ``path`` with ``data`` atomically: readers see the old file or the
        complete new one, never a partial file. With ``sync`` it is durable on return."""

    @abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names of the entries of directory ``path``."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Delete file ``path``."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""

    @abstractmethod
    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is an existing directory."""

    @abstractmethod
    def makedirs(self, path: str) -> None:
        """Create directory ``path`` and its parents (no error if it exists)."""

    @abstractmethod
    def file_size(self, path: str) -> int:
        """Size of file ``path`` in bytes."""


class LocalFileSystem(FileSystemIO):
    """:class:`FileSystemIO` on the local (POSIX) filesystem."""

    def join(self, directory: str, name: str) -> str:
        return os.path.join(directory, name)

    def open_write(self, path: str) -> BinaryIO:
        return open(path, "wb", buffering=WRITE_BUFFER_BYTES)  # noqa: SIM115 - caller closes

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


def filesystem_for(path: str | os.PathLike[str]) -> FileSystemIO:
    """The :class:`FileSystemIO` that handles ``path``.

    Raises:
        UnsupportedFeatureError: for URL-like paths (``scheme://...``), which need an
            object-storage backend that is not available yet.
    """
    text = os.fspath(path)
    if "://" in text:
        raise UnsupportedFeatureError(
            f"checkpoint path {text!r} looks like a URL; only local filesystem paths are "
            f"supported (object storage such as msc:// is not available yet)"
        )
    return LocalFileSystem()


__all__ = ["FileSystemIO", "LocalFileSystem", "ReadStream", "filesystem_for", "fsync_directory"]
