"""The object-storage backend: ``msc://profile/path`` through multi-storage-client.

Paths are full URLs; each request goes through :func:`.msc_client.call` (one client
per profile, cached by MSC and rebuilt after a fork, so forked writer workers
resolve URLs themselves; errors name the URL). Profiles come from MSC's
configuration file (``MSC_CONFIG`` or its default locations).

Semantics on an object store:

- there are no directories: a "directory" is a key prefix that exists while it
  holds objects; :meth:`MscFileSystem.makedirs` does nothing;
- there is no rename: :meth:`MscFileSystem.atomic_write` is one PUT, atomic by
  nature (readers see the old object or the new one); :meth:`MscFileSystem.rename`
  writes the object under its new name, then deletes the old one;
- :meth:`MscFileSystem.open_write` keeps the file in memory (up to
  ``MSC_WRITE_SPOOL_BYTES``, then in a local temporary file) and uploads it when
  closed without error: one PUT (a multipart upload for a file spooled to disk,
  where the profile's ``multipart_threshold`` says so); a failed write uploads
  nothing;
- :meth:`MscFileSystem.open_data` reads with few large GETs, fetched ahead of the
  reader (:mod:`.msc_read`); with ``MSC_PREFETCH_WHOLE_FILES=1`` each data file is
  downloaded whole into a local temporary file first.

Each request costs a round trip, so a handle (one per API call) remembers the
objects it has seen, with their sizes (listings, HEADs, its own writes): asking
again whether such an object exists, or its size, costs nothing. What it deletes
or renames it forgets. An object deleted by another process meanwhile is noticed
when it is read (``FileNotFoundError``).
"""

from __future__ import annotations

import errno
import io
import tempfile
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, BinaryIO, cast

from .. import knobs
from .base import FileSystemIO, ReadStream
from .msc_client import INSTALL_HINT, SCHEME, call, get, import_msc
from .msc_read import RangedReader
from .msc_stream import put_whole

# Whole files this handle wrote, kept for a rename (the commit protocol installs the
# small files it has just written): at most this size each.
_KEEP_WRITTEN_BYTES = 8 << 20


class MscFileSystem(FileSystemIO):
    """:class:`FileSystemIO` on ``msc://profile/path`` URLs (multi-storage-client)."""

    implicit_directories = True
    sequential_reads = True

    def __init__(self) -> None:
        import_msc()  # fail early, with the install hint
        self._sizes: dict[str, int] = {}  # objects seen to exist: their sizes
        self._written: dict[str, bytes] = {}  # small objects this handle wrote

    # ------------------------------------------------------------------ what was seen

    def _seen(self, url: str, size: int) -> None:
        self._sizes[url] = size

    def _forget(self, url: str) -> None:
        self._sizes.pop(url, None)
        self._written.pop(url, None)

    def parallel_reads(self) -> int:
        return knobs.MSC_READ_THREADS.get()

    def note_sizes(self, sizes: Mapping[str, int]) -> None:
        self._sizes.update(sizes)

    def listdir_sizes(self, path: str) -> dict[str, int]:
        """One listing; the sizes of the objects directly under ``path``."""
        prefix = path.rstrip("/") + "/"
        names = self._list(path, first_page_only=False)
        return {n: self._sizes[prefix + n] for n in names if prefix + n in self._sizes}

    def join(self, directory: str, name: str) -> str:
        return f"{directory.rstrip('/')}/{name}"

    def read_limits(self) -> tuple[int, int, int]:
        """No read windows: every item is read in place; :mod:`.msc_read` fetches the
        planned ranges of a file in few large GETs instead."""
        return 0, knobs.READ_MAX_GAP_BYTES.get(), 0

    # ------------------------------------------------------------------ reads

    def open_write(self, path: str) -> BinaryIO:
        self._forget(path)
        return cast(BinaryIO, UploadStream(path, on_upload=lambda n: self._seen(path, n)))

    def open_read(self, path: str) -> ReadStream:
        return self.open_data(path, ())

    def open_data(self, path: str, spans: Sequence[tuple[int, int]]) -> ReadStream:
        size = self.file_size(path)
        if knobs.MSC_PREFETCH_WHOLE_FILES.get() and spans:
            local = tempfile.TemporaryFile(prefix="dist_ckpt_msc_")  # noqa: SIM115 - returned
            try:
                call(path, "download", lambda c, p: c.download_file(p, local))
                local.seek(0)
            except BaseException:
                local.close()
                raise
            return cast(ReadStream, local)
        reader = RangedReader(path, size)
        if spans:
            reader.plan(spans)
        return cast(ReadStream, reader)

    def read_whole(self, path: str) -> bytes:
        data = get(path, 0, 0, whole=True)
        self._seen(path, len(data))
        return data

    def file_size(self, path: str) -> int:
        size = self._sizes.get(path)
        if size is None:
            info = call(path, "stat", lambda c, p: c.info(p))
            if info.type != "file":
                raise IsADirectoryError(errno.EISDIR, "not an object", path)
            size = int(info.content_length)
            self._seen(path, size)
        return size

    def exists(self, path: str) -> bool:
        """Whether object ``path`` exists (one HEAD, unless this handle has seen it)."""
        if path in self._sizes:
            return True
        try:
            info = call(path, "stat", lambda c, p: c.info(p, strict=False))
        except FileNotFoundError:
            return False
        if info.type == "file":
            self._seen(path, int(info.content_length))
        return True

    def is_dir(self, path: str) -> bool:
        """Whether prefix ``path`` holds objects (one listing; the objects of its first
        page are remembered)."""
        return bool(self._list(path, first_page_only=True))

    def listdir(self, path: str) -> list[str]:
        return self._list(path, first_page_only=False)

    def _list(self, path: str, first_page_only: bool) -> list[str]:
        prefix = path.rstrip("/") + "/"

        def names(client: Any, key: str) -> list[str]:
            base = key.rstrip("/") + "/" if key.strip("/") else ""
            found: set[str] = set()
            for count, obj in enumerate(client.list(base, include_directories=True), 1):
                rest = str(obj.key)[len(base) :].strip("/")
                if rest:
                    found.add(rest.split("/", 1)[0])
                    if "/" not in rest and obj.type == "file":
                        self._seen(prefix + rest, int(obj.content_length))
                if first_page_only and count >= 1000:  # one response: a listing page
                    break
            return sorted(found)

        return call(prefix, "listing", names)

    # ------------------------------------------------------------------ writes

    def fsync(self, stream: BinaryIO) -> None:
        stream.flush()  # durable once uploaded (at close)

    def atomic_write(self, path: str, data: bytes | bytearray, *, sync: bool = True) -> None:
        body = bytes(data)
        call(path, "upload", lambda c, p: c.write(p, body))
        self._forget(path)
        self._seen(path, len(body))
        if len(body) <= _KEEP_WRITTEN_BYTES:
            self._written[path] = body

    def remove(self, path: str) -> None:
        """Delete object ``path``: one request where this handle has seen it, else a
        HEAD first (``FileNotFoundError`` if it does not exist)."""
        known = path in self._sizes
        self._forget(path)
        if known:
            call(path, "delete", lambda c, p: c.delete_many([p]))
        else:
            call(path, "delete", lambda c, p: c.delete(p))

    def rename(self, src: str, dst: str) -> None:
        """Write ``src``'s bytes as ``dst`` (from memory where this handle wrote them;
        large objects are copied by the store), then delete ``src``."""
        data = self._written.get(src)
        if data is None and self.file_size(src) > knobs.MSC_WRITE_SPOOL_BYTES.get():
            call(dst, "copy", lambda c, p: c.copy(_inside(c, src), p))
            self._forget(dst)
            self._seen(dst, self.file_size(src))
        else:
            self.atomic_write(dst, data if data is not None else self.read_whole(src))
        self.remove(src)

    def makedirs(self, path: str) -> None:
        """Nothing to do: an object store's prefixes exist while they hold objects."""


def _inside(client: Any, url: str) -> str:
    """The path of ``url`` inside ``client``'s profile."""
    _, path = import_msc().resolve_storage_client(url)
    return str(path)


class UploadStream(io.RawIOBase):
    """A write-only file that becomes one object when closed without error.

    Bytes are kept in memory up to ``MSC_WRITE_SPOOL_BYTES``, then in a named local
    temporary file. A file kept in memory is uploaded with one PUT; a larger one with
    MSC's ``upload_file`` from the temporary file (multipart where the profile says
    so). Leaving a ``with`` block by an exception discards the bytes: nothing is
    uploaded. ``on_upload(size)`` is called once the object exists.
    """

    def __init__(self, url: str, on_upload: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.url = url
        self._on_upload = on_upload
        self._spool_limit = knobs.MSC_WRITE_SPOOL_BYTES.get()
        self._memory: io.BytesIO | None = io.BytesIO()
        self._disk: Any = None  # a NamedTemporaryFile once past the spool limit
        self._size = 0
        self._discard = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if self._memory is not None and self._size + n > self._spool_limit:
            self._disk = tempfile.NamedTemporaryFile(prefix="dist_ckpt_upload_")  # noqa: SIM115
            self._disk.write(self._memory.getbuffer())
            self._memory = None
        target = self._memory if self._memory is not None else self._disk
        target.write(data)
        self._size += n
        return n

    def tell(self) -> int:
        return self._size

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._discard = exc_type is not None
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self._discard:
                self._upload()
                if self._on_upload is not None:
                    self._on_upload(self._size)
        finally:
            if self._disk is not None:
                self._disk.close()  # removes the temporary file
            self._memory = None
            super().close()

    def _upload(self) -> None:
        if self._memory is not None:
            data = self._memory.getvalue()  # no copy: the buffer is handed over
            self._memory = None
            if not put_whole(self.url, data):
                call(self.url, "upload", lambda c, p: c.write(p, data))
            return
        self._disk.flush()
        name = self._disk.name
        call(self.url, "upload", lambda c, p: c.upload_file(p, name))


__all__ = ["INSTALL_HINT", "SCHEME", "MscFileSystem", "RangedReader", "UploadStream", "import_msc"]
