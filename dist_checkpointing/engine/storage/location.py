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

import errno
import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ...errors import CheckpointNotFoundError, CorruptCheckpointError
from .base import FileSystemIO, ReadStream
from .item_checksums import DataFileEntry, ItemChecksum
from .names import safe_name
from .resolve import filesystem_for

T = TypeVar("T")

Location = str | os.PathLike[str]

_IS_DIR_KEY = "\0is_dir"  # a memo key no file name can take


@dataclass
class DirContext:
    """What the checkpoint layer attaches to a handle for one save or load.

    Set by :mod:`~dist_checkpointing.engine.checkpoint.commit`; the storage layer
    only consults it, so it needs no knowledge of the commit protocol:

    - ``stage(name)``: during a save, the name a whole file is written under
      (installed under its final name at commit);
    - ``aliases``: final name -> the name a load reads instead (a commit that was
      interrupted after its record was written);
    - ``on_write(name, data)`` / ``on_read(name, data)``: called for whole files
      written or read through the handle (checksums are recorded / verified);
    - ``on_data_files(entries)``: the coordinator hands over the data files' item
      checksums gathered from every rank;
    - ``item_checksum(relative_path, offset)``: the recorded checksums of an item
      (None: not recorded);
    - ``block_bytes``: at load, the block size of those checksums; during a save,
      the block size of the item checksums to write (0: write none);
    - ``save_tag``: part of the data file names of this save;
    - ``digest_data_files``: during a save that records an integrity manifest, the
      data file writers compute each file's sha256 from the bytes they write;
    - ``file_digests``: the sha256 of this rank's data files that its writers
      reported (name -> hex digest), for the manifest.
    """

    stage: Callable[[str], str] | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    on_write: Callable[[str, bytes | bytearray], None] | None = None
    on_read: Callable[[str, bytes], None] | None = None
    on_data_files: Callable[[dict[str, DataFileEntry]], None] | None = None
    item_checksum: Callable[[str, int], ItemChecksum | None] | None = None
    block_bytes: int = 0
    save_tag: str = ""
    digest_data_files: bool = False
    file_digests: dict[str, str] = field(default_factory=dict)
    attachments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class CheckpointDir:
    """A checkpoint location: its root (a path or URL) and the backend that serves it.

    Create it with :meth:`of`; file operations take names relative to the root.
    """

    root: str
    fs: FileSystemIO
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)
    context: DirContext = field(default_factory=DirContext, repr=False)
    # full path -> content (None: known not to exist), read once for every rank
    _preloaded: dict[str, bytes | None] = field(default_factory=dict, repr=False)

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
        """The full path of ``name`` inside the checkpoint (of the file a load reads
        in its place, if a commit left it under its staged name)."""
        return self.fs.join(self.root, self.context.aliases.get(name, name))

    def entry(self, name: object, *, source: str) -> str:
        """``name`` read from the checkpoint (at ``source``), checked to be one plain
        file of this directory and made canonical; see :func:`.names.safe_name`.

        Raises:
            UnsafeCheckpointError: ``name`` would reach outside the directory.
        """
        return safe_name(name, source=source)

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
        path = self.path(name)
        if path in self._preloaded:
            return self._preloaded[path] is not None
        return self.fs.exists(path)

    def size(self, name: str) -> int:
        """Size of file ``name`` in bytes."""
        path = self.path(name)
        preloaded = self._preloaded_bytes(path)
        return len(preloaded) if preloaded is not None else self.fs.file_size(path)

    def preload(self, files: dict[str, bytes | None], sizes: dict[str, int]) -> None:
        """Serve these files from memory (``None``: known missing) and remember the sizes
        of others: what one rank read for every rank of a load (see
        :mod:`~dist_checkpointing.engine.checkpoint.preload`). Names are relative to
        the root; the handle's later reads of them cost no request."""
        for name, data in files.items():
            self._preloaded[self.fs.join(self.root, name)] = data
        self.fs.note_sizes({self.fs.join(self.root, n): size for n, size in sizes.items()})
        if any(data is not None for data in files.values()):
            self._memo[_IS_DIR_KEY] = True

    def _preloaded_bytes(self, path: str) -> bytes | None:
        if self._preloaded.get(path) is None and path in self._preloaded:
            raise FileNotFoundError(errno.ENOENT, "no such file", path)
        return self._preloaded.get(path)

    # ------------------------------------------------------------------ I/O

    def open_read(self, name: str) -> ReadStream:
        """Open file ``name`` for reading (the caller closes it).

        Only regular files are opened (never through a symlink, never blocking on a
        FIFO): anything else raises :class:`UnsafeCheckpointError`.
        """
        return self.fs.open_read(self.path(name))

    def open_data_file(
        self, name: str, holds: Sequence[str], spans: Sequence[tuple[int, int]] = ()
    ) -> tuple[ReadStream, int]:
        """Open data file ``name`` (checked by :meth:`entry`) and return it with its
        size (of the file opened, not of whatever has its name now). ``spans`` are the
        ``(offset, length)`` ranges about to be read, in order (see
        :meth:`FileSystemIO.open_data`).

        Raises:
            CorruptCheckpointError: the file is missing (the message names the items
                ``holds`` of it).
            UnsafeCheckpointError: it is not a regular file.
        """
        shown = ", ".join(repr(k) for k in holds[:10]) + (" ..." if len(holds) > 10 else "")
        missing = f"data file {self.path(name)} is missing; it holds {shown}"
        try:
            stream = self.fs.open_data(self.path(name), spans)
        except FileNotFoundError:
            raise CorruptCheckpointError(missing) from None
        if self.fs.implicit_directories:  # objects are fetched as they are read
            stream = _MissingAware(stream, missing)
        try:
            size = stream.seek(0, io.SEEK_END)
            stream.seek(0)
        except BaseException:
            stream.close()
            raise
        return stream, size

    def read_bytes(self, name: str) -> bytes:
        """The whole content of file ``name`` (checked against the commit record when
        a load set one up)."""
        data = self.read_unchecked(name)
        if self.context.on_read is not None:
            self.context.on_read(name, data)
        return data

    def read_unchecked(self, name: str) -> bytes:
        """The whole content of file ``name``, not checked against the commit record
        (the record itself)."""
        path = self.path(name)
        preloaded = self._preloaded_bytes(path)
        return preloaded if preloaded is not None else self.fs.read_whole(path)

    def atomic_write(self, name: str, data: bytes | bytearray, *, sync: bool = True) -> None:
        """Replace file ``name`` with ``data`` atomically (durably with ``sync``).

        During a save, a file with a staged name is written under that name.
        """
        self.forget(name)
        self._preloaded.pop(self.path(name), None)
        target = name if self.context.stage is None else self.context.stage(name)
        self.fs.atomic_write(self.fs.join(self.root, target), data, sync=sync)
        if target != name:
            self.context.aliases[name] = target  # later reads of this save see it
        if self.context.on_write is not None:
            self.context.on_write(name, data)

    def remove(self, name: str) -> None:
        """Delete file ``name``."""
        self.forget(name)
        self.fs.remove(self.path(name))
        self._preloaded.pop(self.path(name), None)

    # ------------------------------------------------------------------ memo

    def memo(self, key: str, compute: Callable[[], T]) -> T:
        """``compute()`` once per handle and ``key`` (e.g. a parsed metadata file)."""
        if key not in self._memo:
            self._memo[key] = compute()
        value: T = self._memo[key]
        return value

    def memoized(self, key: str) -> Any:
        """What :meth:`memo` holds for ``key`` (None: nothing yet)."""
        return self._memo.get(key)

    def forget(self, key: str) -> None:
        """Drop what :meth:`memo` holds for ``key`` and for keys ``key#...`` (what was
        read from file ``key``, which changed)."""
        self._memo.pop(key, None)
        for other in [k for k in self._memo if k.startswith(key + "#")]:
            del self._memo[other]


class _MissingAware:
    """A data file whose object may turn out missing only when read (its size was
    learnt from the commit record): ``FileNotFoundError`` becomes the message of
    :meth:`CheckpointDir.open_data_file`."""

    def __init__(self, stream: ReadStream, missing: str) -> None:
        self._stream = stream
        self._missing = missing

    def read(self, size: int = -1, /) -> bytes:
        try:
            return self._stream.read(size)
        except FileNotFoundError:
            raise CorruptCheckpointError(self._missing) from None

    def readinto(self, buffer: Any, /) -> int | None:
        try:
            return self._stream.readinto(buffer)
        except FileNotFoundError:
            raise CorruptCheckpointError(self._missing) from None

    def seek(self, offset: int, whence: int = 0, /) -> int:
        return self._stream.seek(offset, whence)

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> _MissingAware:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CheckpointDir", "DirContext", "Location"]
