"""The object-storage backend: ``msc://profile/path`` through multi-storage-client.

Paths are full URLs; each operation resolves its URL with
``multistorageclient.resolve_storage_client`` (MSC caches one client per
profile and rebuilds its cache after a fork, so forked writer workers resolve
URLs themselves). Profiles come from MSC's configuration file (``MSC_CONFIG``
or its default locations).

Semantics on an object store:

- there are no directories: a "directory" is a key prefix that exists while
  it holds objects; :meth:`MscFileSystem.makedirs` does nothing;
- there is no rename: :meth:`MscFileSystem.atomic_write` is one PUT, atomic by
  nature (readers see the old object or the new one);
- :meth:`MscFileSystem.open_write` buffers the file (in memory up to
  ``MSC_WRITE_SPOOL_BYTES``, then in a local temporary file) and uploads it
  when closed without error; a failed write uploads nothing;
- :meth:`MscFileSystem.open_read` serves ``seek``/``readinto`` with ranged
  GETs; a large read is split into pieces of about ``MSC_READ_CHUNK_BYTES``
  fetched by at most ``MSC_READ_THREADS`` threads, so at most that many pieces
  are in flight; :meth:`MscFileSystem.read_limits` makes the reader fetch
  items up to ``MSC_READ_WINDOW_BYTES`` whole (one GET per window), and
  :meth:`MscFileSystem.parallel_reads` several files at once. With ``MSC_PREFETCH_WHOLE_FILES=1`` the object is downloaded whole
  into a local temporary file first (for stores that favour whole objects).

Errors name the URL: a missing object raises :class:`FileNotFoundError`;
refused credentials raise :class:`~dist_checkpointing.errors.StorageAccessError`
at once; other failures (endpoint unreachable) are retried ``MSC_ATTEMPTS``
times with a doubling delay, then raise ``StorageAccessError``.
"""

from __future__ import annotations

import errno
import io
import logging
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType, TracebackType
from typing import Any, BinaryIO, TypeVar, cast

from ...errors import MissingDependencyError, StorageAccessError
from .. import knobs
from .base import FileSystemIO, ReadStream

logger = logging.getLogger(__name__)

SCHEME = "msc://"
INSTALL_HINT = "pip install dist_checkpointing[msc]"

T = TypeVar("T")


def import_msc() -> ModuleType:
    """The ``multistorageclient`` module, or :class:`MissingDependencyError` saying what to install."""
    try:
        import multistorageclient
    except ImportError as exc:
        raise MissingDependencyError(
            f"msc:// checkpoint paths need the multi-storage-client package: {INSTALL_HINT} ({exc})"
        ) from exc
    return multistorageclient


def _resolve(url: str) -> tuple[Any, str]:
    """``(StorageClient, path inside the profile)`` of ``url``."""
    client, path = import_msc().resolve_storage_client(url)
    return client, path


def call(url: str, what: str, fn: Callable[[Any, str], T]) -> T:
    """``fn(client, path)`` for ``url``, with the error policy of this module."""
    attempts = knobs.MSC_ATTEMPTS.get()
    delay = knobs.MSC_RETRY_DELAY_S.get()
    for attempt in range(1, attempts + 1):
        try:
            client, path = _resolve(url)
            return fn(client, path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"{what}: no such object", url) from None
        except IsADirectoryError:
            raise
        except PermissionError as exc:
            raise StorageAccessError(
                f"{url}: {what} refused by the storage (check the credentials and permissions "
                f"of the MSC profile): {exc}"
            ) from exc
        except (MissingDependencyError, ValueError, TypeError, KeyError):
            raise  # configuration errors (unknown profile, bad URL): retrying cannot help
        except Exception as exc:  # noqa: BLE001 - connection failures, retryable errors
            if attempt == attempts:
                raise StorageAccessError(
                    f"{url}: {what} failed after {attempts} attempt(s) (is the endpoint "
                    f"reachable?): {type(exc).__name__}: {exc}"
                ) from exc
            logger.warning("%s: %s failed (%s); retrying in %.2fs", url, what, exc, delay)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")  # pragma: no cover


def _byte_range(offset: int, size: int) -> Any:
    from multistorageclient.types import Range

    return Range(offset=offset, size=size)


class MscFileSystem(FileSystemIO):
    """:class:`FileSystemIO` on ``msc://profile/path`` URLs (multi-storage-client)."""

    implicit_directories = True

    def __init__(self) -> None:
        import_msc()  # fail early, with the install hint
        # Size of each object just opened by open_read (its HEAD), for the file_size
        # call that follows: one HEAD per opened file, not two.
        self._opened_sizes: dict[str, int] = {}

    def parallel_reads(self) -> int:
        return knobs.MSC_READ_THREADS.get()

    def join(self, directory: str, name: str) -> str:
        return f"{directory.rstrip('/')}/{name}"

    def read_limits(self) -> tuple[int, int, int]:
        """Each request costs a round trip: items up to ``MSC_READ_WINDOW_BYTES`` are
        fetched whole, with their neighbours, in windows of that size."""
        window = knobs.MSC_READ_WINDOW_BYTES.get()
        return window, max(knobs.READ_MAX_GAP_BYTES.get(), 1 << 20), window

    def open_write(self, path: str) -> BinaryIO:
        return cast(BinaryIO, UploadStream(path))

    def open_read(self, path: str) -> ReadStream:
        size = self._stat_size(path)
        if len(self._opened_sizes) > 1024:
            self._opened_sizes.clear()
        self._opened_sizes[path] = size
        if knobs.MSC_PREFETCH_WHOLE_FILES.get():
            local = tempfile.TemporaryFile(prefix="dist_ckpt_msc_")  # noqa: SIM115 - returned
            try:
                call(path, "download", lambda c, p: c.download_file(p, local))
                local.seek(0)
            except BaseException:
                local.close()
                raise
            return cast(ReadStream, local)
        return RangedReader(path, size)

    def read_whole(self, path: str) -> bytes:
        return call(path, "download", lambda c, p: bytes(c.read(p)))

    def fsync(self, stream: BinaryIO) -> None:
        stream.flush()  # durable once uploaded (at close)

    def atomic_write(self, path: str, data: bytes, *, sync: bool = True) -> None:
        call(path, "upload", lambda c, p: c.write(p, bytes(data)))

    def listdir(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"

        def names(client: Any, key: str) -> list[str]:
            base = key.rstrip("/") + "/" if key.strip("/") else ""
            found: set[str] = set()
            for obj in client.list(base, include_directories=True):
                rest = str(obj.key)[len(base) :].strip("/")
                if rest:
                    found.add(rest.split("/", 1)[0])
            return sorted(found)

        return call(prefix, "listing", names)

    def remove(self, path: str) -> None:
        call(path, "delete", lambda c, p: c.delete(p))

    def _info(self, path: str) -> Any | None:
        try:
            return call(path, "stat", lambda c, p: c.info(p))
        except FileNotFoundError:
            return None

    def exists(self, path: str) -> bool:
        return self._info(path) is not None

    def is_dir(self, path: str) -> bool:
        """Whether prefix ``path`` holds objects (one listing request)."""
        prefix = path.rstrip("/") + "/"

        def holds_objects(client: Any, key: str) -> bool:
            base = key.rstrip("/") + "/" if key.strip("/") else ""
            return next(iter(client.list(base, include_directories=True)), None) is not None

        return call(prefix, "listing", holds_objects)

    def makedirs(self, path: str) -> None:
        """Nothing to do: an object store's prefixes exist while they hold objects."""

    def file_size(self, path: str) -> int:
        size = self._opened_sizes.pop(path, None)
        return self._stat_size(path) if size is None else size

    def _stat_size(self, path: str) -> int:
        info = call(path, "stat", lambda c, p: c.info(p))
        if info.type != "file":
            raise IsADirectoryError(errno.EISDIR, "not an object", path)
        return int(info.content_length)


class UploadStream(io.RawIOBase):
    """A write-only file that becomes one object when closed without error.

    Bytes are kept in memory up to ``MSC_WRITE_SPOOL_BYTES``, then in a named local
    temporary file. A file kept in memory is uploaded with one PUT; a larger one with
    MSC's ``upload_file`` from the temporary file (multipart where the profile says
    so). Leaving a ``with`` block by an exception discards the bytes: nothing is
    uploaded.
    """

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
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
        finally:
            if self._disk is not None:
                self._disk.close()  # removes the temporary file
            self._memory = None
            super().close()

    def _upload(self) -> None:
        if self._memory is not None:
            data = self._memory.getvalue()
            call(self.url, "upload", lambda c, p: c.write(p, data))
            return
        self._disk.flush()
        name = self._disk.name
        call(self.url, "upload", lambda c, p: c.upload_file(p, name))


class RangedReader(io.RawIOBase):
    """A read-only file of ``size`` bytes served by ranged GETs (see the module doc)."""

    def __init__(self, url: str, size: int) -> None:
        super().__init__()
        self.url = url
        self.size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0, /) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any, /) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.size - self._pos))
        if n == 0:
            return 0
        got = self._fetch(self._pos, view[:n])
        self._pos += got
        return got

    def readall(self) -> bytes:
        if self._pos == 0:
            data = call(self.url, "download", lambda c, p: bytes(c.read(p)))
            self._pos = len(data)
            return data
        buf = bytearray(max(0, self.size - self._pos))
        n = self.readinto(buf)
        return bytes(buf[:n])

    def _fetch(self, offset: int, view: memoryview) -> int:
        """Fill ``view`` from ``offset``; the number of bytes the object had there."""
        # Pieces of about MSC_READ_CHUNK_BYTES (never one sliver more: requests cost).
        pieces = max(1, round(len(view) / knobs.MSC_READ_CHUNK_BYTES.get()))
        step = -(-len(view) // pieces)
        spans = [(start, min(step, len(view) - start)) for start in range(0, len(view), step)]
        threads = min(knobs.MSC_READ_THREADS.get(), len(spans))

        def get(span: tuple[int, int]) -> int:
            start, length = span
            data = call(
                self.url,
                "ranged read",
                lambda c, p: c.read(p, byte_range=_byte_range(offset + start, length)),
            )
            got = min(len(data), length)
            view[start : start + got] = memoryview(data)[:got]
            return got

        if threads <= 1:
            counts = [get(span) for span in spans]
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="dist-ckpt-msc-read") as pool:
                counts = list(pool.map(get, spans))
        total = 0
        for (_, length), got in zip(spans, counts):
            total += got
            if got < length:  # the object ends early: report the contiguous prefix
                break
        return total


__all__ = ["INSTALL_HINT", "SCHEME", "MscFileSystem", "RangedReader", "UploadStream", "import_msc"]
