"""The file interface every storage backend implements.

Every file the engine touches goes through a :class:`FileSystemIO`, created
once per checkpoint location (see :mod:`.resolve`), so that another backend
(object storage, e.g. ``msc://`` paths) plugs in as one more implementation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, BinaryIO, Protocol

from .. import knobs
from .writeback import Writeback


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

    #: True where directories are key prefixes that exist while they hold files
    #: (object stores): a save may then target a location that does not exist yet.
    implicit_directories: bool = False

    #: True where reading a file in offset order is much cheaper than any other order
    #: (streamed object GETs): readers then avoid reading backwards where they can.
    sequential_reads: bool = False

    def parallel_reads(self) -> int:
        """How many data files a rank reads at once at least (object stores: several,
        to hide the latency of each request)."""
        return 1

    def busy_readers(self, threads: int) -> int:
        """How many of ``threads`` reading threads keep a core busy: each one reading a
        local disk copies from the page cache; an object store's (``sequential_reads``)
        mostly wait for the network, and count as one (see ``checksums.hashing_thread``)."""
        return 1 if self.sequential_reads else threads

    def read_limits(self) -> tuple[int, int, int]:
        """``(small_item, max_gap, window)`` bytes for coalescing reads: items of at most
        ``small_item`` bytes, at most ``max_gap`` apart, are fetched together in reads of
        at most ``window`` bytes (see :mod:`..knobs`, ``READ_*``)."""
        return (
            knobs.READ_SMALL_ITEM_BYTES.get(),
            knobs.READ_MAX_GAP_BYTES.get(),
            knobs.READ_WINDOW_BYTES.get(),
        )

    @abstractmethod
    def join(self, directory: str, name: str) -> str:
        """The path of ``name`` inside ``directory``."""

    @abstractmethod
    def open_write(self, path: str) -> BinaryIO:
        """Create (or truncate) ``path`` for writing; the caller closes it."""

    @abstractmethod
    def open_read(self, path: str) -> ReadStream:
        """Open ``path`` for reading with ``seek``/``readinto``; the caller closes it."""

    def open_data(self, path: str, spans: Sequence[tuple[int, int]]) -> ReadStream:
        """Open data file ``path`` for reading ``spans`` (``(offset, length)``, in the
        order they will be read); other bytes may be read too. Object stores fetch the
        spans ahead of the reader; the default is :meth:`open_read`."""
        return self.open_read(path)

    def read_whole(self, path: str) -> bytes:
        """The whole content of file ``path`` (object stores: one GET)."""
        with self.open_read(path) as stream:
            data: bytes = stream.read()
        return data

    def writeback(self, stream: BinaryIO) -> Writeback | None:
        """Something that starts the write-back of ``stream`` (opened by
        :meth:`open_write`) while it is written, for a file that will be synced (see
        :mod:`.writeback`); None (the default) where that means nothing."""
        return None

    @abstractmethod
    def fsync(self, stream: BinaryIO) -> None:
        """Flush ``stream`` (opened by :meth:`open_write`) and make its bytes durable."""

    @abstractmethod
    def atomic_write(self, path: str, data: bytes | bytearray, *, sync: bool = True) -> None:
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

    def note_sizes(self, sizes: Mapping[str, int]) -> None:
        """Sizes of files learnt elsewhere (from another rank): a backend for which
        asking costs a request remembers them; the default ignores them."""
        del sizes  # asking the local file system costs no round trip

    def listdir_sizes(self, path: str) -> dict[str, int]:
        """``{name: size}`` of the files in directory ``path`` (object stores: one
        listing)."""
        return {
            name: self.file_size(self.join(path, name))
            for name in self.listdir(path)
            if not self.is_dir(self.join(path, name))
        }

    def rename(self, src: str, dst: str) -> None:
        """Replace ``dst`` with ``src`` (atomically where the store can; durably).

        The default copies and deletes, for stores without a rename.
        """
        with self.open_read(src) as stream:
            data = stream.read()
        self.atomic_write(dst, data)
        self.remove(src)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless it exists; whether it was created.

        Atomic on POSIX filesystems (``O_EXCL``); the default (for stores without a
        conditional create) checks, then writes.
        """
        if self.exists(path):
            return False
        self.atomic_write(path, data)
        return True


__all__ = ["FileSystemIO", "ReadStream"]
