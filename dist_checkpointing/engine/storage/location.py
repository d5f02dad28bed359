"""The checkpoint directory handle: a location resolved once to its storage backend.

The public API takes ``checkpoint_dir`` as a path (Megatron-Core's signatures);
each entry point turns it into one :class:`CheckpointDir` and passes that down,
so the backend is chosen once per call and every layer below names files
relative to the same root. A ``CheckpointDir`` is also ``os.PathLike`` (its
root), so it can be handed to code that expects a path.

It also memoizes parsed files for the duration of one API call
(:meth:`CheckpointDir.memo`): a load with strict key checks and integrity
verification parses ``.metadata`` once, not three times.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ...errors import CheckpointNotFoundError
from .base import FileSystemIO, ReadStream
from .resolve import filesystem_for

T = TypeVar("T")

Location = str | os.PathLike[str]

_IS_DIR_KEY = "\0is_dir"  # a memo key no file name can take


@dataclass(frozen=True, eq=False)
class CheckpointDir:
    """A checkpoint location: its root (a path or URL) and the backend that serves it.

    Create it with :meth:`of`; file operations take names relative to the root.
    """

    root: str
    fs: FileSystemIO
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, location: Location | CheckpointDir) -> CheckpointDir:
        """``location`` itself if it is already a handle, else a new handle for it."""
        if isinstance(location, CheckpointDir):
            return location
        root = os.fspath(location)
        return cls(root, filesystem_for(root))

    def __fspath__(self) -> str:
        return self.root

    def __str__(self) -> str:
        return self.root

    # ------------------------------------------------------------------ names

    def path(self, name: str) -> str:
        """The full path of ``name`` inside the checkpoint."""
        return self.fs.join(self.root, name)

    def is_dir(self) -> bool:
        """Whether the root exists as a directory (once found, remembered for the
        handle's life: on object stores each check is a listing request)."""
        if self._memo.get(_IS_DIR_KEY):
            return True
        found = self.fs.is_dir(self.root)
        if found:
            self._memo[_IS_DIR_KEY] = True
        return found

    def require_dir(self, what: str = "Checkpoint directory", *, for_writing: bool = False) -> None:
        """Raise :class:`CheckpointNotFoundError` unless the root is a directory.

        With ``for_writing`` a backend whose directories are key prefixes (object
        stores) accepts any root: its "directory" appears with the first file.
        """
        if for_writing and self.fs.implicit_directories:
            return
        if not self.is_dir():
            raise CheckpointNotFoundError(f"{what} does not exist: {self.root}")

    def listdir(self) -> list[str]:
        """Names of the entries of the root."""
        return self.fs.listdir(self.root)

    def has(self, name: str) -> bool:
        """Whether ``name`` exists inside the checkpoint."""
        return self.fs.exists(self.path(name))

    def size(self, name: str) -> int:
        """Size of file ``name`` in bytes."""
        return self.fs.file_size(self.path(name))

    # ------------------------------------------------------------------ I/O

    def open_read(self, name: str) -> ReadStream:
        """Open file ``name`` for reading (the caller closes it)."""
        return self.fs.open_read(self.path(name))

    def read_bytes(self, name: str) -> bytes:
        """The whole content of file ``name``."""
        return self.fs.read_whole(self.path(name))

    def atomic_write(self, name: str, data: bytes, *, sync: bool = True) -> None:
        """Replace file ``name`` with ``data`` atomically (durably with ``sync``)."""
        self.forget(name)
        self.fs.atomic_write(self.path(name), data, sync=sync)

    def remove(self, name: str) -> None:
        """Delete file ``name``."""
        self.forget(name)
        self.fs.remove(self.path(name))

    # ------------------------------------------------------------------ memo

    def memo(self, key: str, compute: Callable[[], T]) -> T:
        """``compute()`` once per handle and ``key`` (e.g. a parsed metadata file)."""
        if key not in self._memo:
            self._memo[key] = compute()
        value: T = self._memo[key]
        return value

    def forget(self, key: str) -> None:
        """Drop what :meth:`memo` holds for ``key`` (the file it was read from changed)."""
        self._memo.pop(key, None)


__all__ = ["CheckpointDir", "Location"]
