"""The stream every ``torch_dist`` data file is written through: :class:`ChecksumStream`.

It checksums each item's bytes (CRC32C blocks, :class:`.checksums.BlockHasher`) and,
where asked, the whole file's (sha256, for the integrity manifest) as they go out, and
keeps every write call under the ``WRITE_CALL_BYTES`` knob.

On a local file (a stream with a descriptor, at its start) the bytes are not written
through the stream's buffer: they are gathered, without a copy, and go out in
``os.pwritev`` calls of up to ``WRITE_CALL_BYTES`` (:meth:`ChecksumStream.write_parts`
takes an item's pieces, its zip records and a view of the tensor's memory, as one
write). A buffered stream would copy each small item into its buffer (and the item
writer first joined the pieces into one ``bytes``): two copies of every small tensor,
and a system call per 256 KiB. Elsewhere (object storage, an in-memory stream) the
bytes are written to the stream in order, as they come.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from .. import knobs
from .checksums import BlockHasher
from .item_checksums import ItemChecksum
from .positional import IOV_MAX, descriptor, write_all_at
from .writeback import Writeback

# A write of a mutable buffer smaller than this is copied and gathered (the caller may
# reuse the buffer once ``write`` returns); a larger one goes to the file at once.
_COPY_BELOW_BYTES = 64 << 10


class ChecksumStream:
    """A write stream that checksums every item written through it.

    Call :meth:`begin_item` before an item's bytes and :meth:`end_item` after them,
    :meth:`flush` after the last (then every byte is in the file). ``tell`` is the
    number of bytes written through this stream; everything else (``fileno``...) goes
    to the wrapped stream, after the gathered bytes. With ``writeback``, the file's
    write-back to disk is started as its bytes go out (see :mod:`.writeback`); with
    ``digest``, the sha256 of the whole file is computed from the same bytes
    (:meth:`file_digest`: the integrity manifest's, without a second read).
    """

    def __init__(
        self,
        stream: BinaryIO,
        block_bytes: int,
        writeback: Writeback | None = None,
        digest: bool = False,
    ) -> None:
        self._stream = stream
        self._block_bytes = block_bytes  # <= 0: pass bytes through, record nothing
        self._writeback = writeback  # told how far the file was written, if given
        self._hasher: BlockHasher | None = None
        self._position = 0
        self._item_start = 0
        self._file_hash = hashlib.sha256() if digest else None  # of every byte written
        self._piece = knobs.WRITE_CALL_BYTES.get()
        self._fd = _positional(stream)
        self._pending: list[Any] = []  # gathered buffers, written from _written on
        self._pending_bytes = 0
        self._written = 0
        self._keep: list[Any] = []  # what the gathered views point into

    def file_digest(self) -> str | None:
        """The sha256 (hex) of everything written so far; None unless ``digest``."""
        return None if self._file_hash is None else self._file_hash.hexdigest()

    def begin_item(self) -> None:
        self._hasher = BlockHasher(self._block_bytes) if self._block_bytes > 0 else None
        self._item_start = self._position

    def end_item(self) -> ItemChecksum | None:
        hasher, self._hasher = self._hasher, None
        if hasher is None:
            return None
        return ItemChecksum(self._item_start, self._position - self._item_start, hasher.finish())

    def tell(self) -> int:
        return self._position

    def write(self, data: Any) -> int:
        """Write ``data``; the caller may reuse its buffer once this returns."""
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if self._fd is None:
            self._to_stream(data, size)
        elif type(data) is bytes or size < _COPY_BELOW_BYTES:
            self._gather(data if type(data) is bytes else bytes(data), size)
        else:
            self._gather(data, size)
            self._drain()  # before the caller has its buffer back
        return size

    def write_parts(self, parts: Sequence[Any], keep: Any = None) -> int:
        """Write ``parts`` (buffers) back to back; return their total size. Views into
        memory that ``keep`` owns (e.g. a tensor's) are gathered without a copy: that
        memory must not change until :meth:`flush` (``keep`` is held until then)."""
        sizes = [p.nbytes if isinstance(p, memoryview) else len(p) for p in parts]
        total = sum(sizes)
        if self._fd is None or total > self._piece or len(parts) >= IOV_MAX:
            put = self._to_stream if self._fd is None else self._gather
            for part, size in zip(parts, sizes):
                put(part, size)
        else:  # (most items: one call's worth, gathered whole)
            full = len(self._pending) + len(parts) >= IOV_MAX
            if full or self._pending_bytes + total > self._piece:
                self._drain()
            if self._hasher is not None:
                self._hasher.feed_all(parts, sizes, total)
            if self._file_hash is not None:
                for part in parts:
                    self._file_hash.update(part)
            self._pending += parts
            self._pending_bytes += total
            self._position += total
        if self._fd is not None and keep is not None and self._pending:
            self._keep.append(keep)
        return total

    def flush(self) -> None:
        """Write whatever is gathered, then flush the wrapped stream."""
        self._drain()
        self._stream.flush()

    def _account(self, data: Any, size: int) -> None:
        if self._hasher is not None:
            self._hasher.feed(data, size)
        if self._file_hash is not None:
            self._file_hash.update(data)
        self._position += size

    def _split(self, data: Any, size: int, put: Callable[[Any, int], None]) -> None:
        """``put`` each ``WRITE_CALL_BYTES`` piece of ``data`` (larger than that)."""
        view = memoryview(data).cast("B")
        for start in range(0, size, self._piece):
            put(view[start : start + self._piece], min(self._piece, size - start))

    def _to_stream(self, data: Any, size: int) -> None:
        """Write in order to the wrapped stream, in calls of at most ``WRITE_CALL_BYTES``."""
        if size > self._piece:
            self._split(data, size, self._to_stream)
            return
        n = self._stream.write(data)
        if n is not None and n != size:  # buffered writers write all or raise
            raise OSError(f"short write: {n} of {size} bytes")
        self._account(data, size)
        if self._writeback is not None:
            self._writeback.advance(self._position)

    def _gather(self, data: Any, size: int) -> None:
        """Add ``data`` to the gathered bytes; a call goes out whenever the next piece
        would take it past ``WRITE_CALL_BYTES``."""
        if size > self._piece:
            self._split(data, size, self._gather)
            return
        if self._pending_bytes + size > self._piece or len(self._pending) >= IOV_MAX:
            self._drain()
        self._account(data, size)
        if size:
            self._pending.append(data)
            self._pending_bytes += size

    def _drain(self) -> None:
        if not self._pending:
            return
        assert self._fd is not None
        pending, nbytes, at = self._pending, self._pending_bytes, self._written
        write_all_at(self._fd, pending, at, nbytes)
        self._pending, self._pending_bytes, self._keep = [], 0, []
        self._written = at + nbytes
        if self._writeback is not None:
            self._writeback.advance(self._written)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # (not set yet: during construction or unpickling)
            raise AttributeError(name)
        self._drain()  # whatever the wrapped stream is asked sees every byte
        return getattr(self._stream, name)


def _positional(stream: Any) -> int | None:
    """The descriptor of ``stream`` where its bytes can be written with positional calls
    from offset 0: a local file at its start (not a pipe, not one written before)."""
    fd = descriptor(stream)
    if fd is None:
        return None
    try:
        at_start = stream.tell() == 0
    except (OSError, ValueError, io.UnsupportedOperation):  # e.g. a pipe: not seekable
        return None
    return fd if at_start else None


__all__ = ["ChecksumStream"]
