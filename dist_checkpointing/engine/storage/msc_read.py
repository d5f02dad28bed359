"""Reading an ``msc://`` object: few large GETs, fetched ahead of the reader.

Each request to an object store costs a round trip (and some stores, moto's server
among them, read the whole object for every ranged GET), so a data file is read in
as few GETs as the memory bound allows:

- The reader announces the byte ranges it will read (:meth:`RangedReader.plan`,
  the items of the file this rank loads, in offset order). Ranges less than
  ``max(READ_MAX_GAP_BYTES, 1 MiB)`` apart are merged; a merged range that starts
  and ends within that gap of the object's ends becomes the whole object (one
  plain GET). Each merged range is cut into *chunks* of about
  ``MSC_READ_CHUNK_BYTES`` (a short last piece is merged into the one before).
- A read inside a chunk waits for that chunk's GET, and starts the GETs of the
  next ``MSC_READ_AHEAD`` chunks in background threads. A large read (more than
  64 KiB: the body of an item) releases the chunks before it; at most
  ``MSC_READ_AHEAD + 2`` chunks are held (the lowest are released first), so a
  rank holds at most that many chunks per file it reads.
- A small read far ahead of what is held (the last bytes of a large item, read
  before its body) is one ranged GET of just those bytes; a read outside the plan
  too.

Where the profile can presign GETs (S3 and compatible stores, see
:mod:`.msc_stream`), a chunk is not fetched ahead as one ``bytes`` object: its GET
is *streamed*, each read pulling the next bytes of the response straight into the
caller's buffer (no copy, and the first tensor is filled while the rest is still
on the wire). Reads go in offset order; a gap of up to ``_SKIP`` bytes is read
past, and the stream's last 64 KiB are kept for a read that goes back into them
(an item's first 4 KiB are read, then its data from inside them; its data, then
its last 4 KiB, which overlap the data). A read further ahead or behind opens a new GET from there (small reads:
one ranged GET of just those bytes). Readers avoid going back for an item's zip
directory (:func:`.item_reader.parse_tensor_item` with ``defer_tail``).

A GET that returns fewer bytes than asked (the object is shorter than its size)
makes ``readinto`` return fewer bytes: the caller reports the truncated file.
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .. import knobs
from .msc_client import get
from .msc_stream import Stream, open_stream

_SMALL_READ = 64 << 10  # reads up to this size never release chunks (zip headers, edges)
_SKIP = 1 << 20  # a streamed GET reads past gaps up to this size
_RECENT = 64 << 10  # the stream's last bytes, kept for a read that goes back


def plan_chunks(
    spans: Sequence[tuple[int, int]], size: int, gap: int, chunk: int
) -> list[tuple[int, int]]:
    """``(start, end)`` of the GETs that cover ``spans`` (``(offset, length)``) of an
    object of ``size`` bytes: merged across gaps up to ``gap``, cut near ``chunk``."""
    merged: list[list[int]] = []
    for offset, length in sorted(spans):
        start, end = max(0, offset), min(size, offset + length)
        if end <= start:
            continue
        if merged and start - merged[-1][1] <= gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    if len(merged) == 1 and merged[0][0] <= gap and size - merged[0][1] <= gap:
        merged = [[0, size]]  # (nearly) the whole object: one plain GET
    chunks: list[tuple[int, int]] = []
    for start, end in merged:
        pieces = max(1, round((end - start) / chunk))
        step = -(-(end - start) // pieces)
        chunks.extend((s, min(s + step, end)) for s in range(start, end, step))
    return chunks


class RangedReader(io.RawIOBase):
    """A read-only file of ``size`` bytes served by GETs (see the module doc)."""

    def __init__(self, url: str, size: int) -> None:
        super().__init__()
        self.url = url
        self.size = size
        self._pos = 0
        self._chunks: list[tuple[int, int]] = []
        self._starts: list[int] = []
        self._held: dict[int, Future[bytes]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._stream: Stream | None = None  # the streamed GET being read
        self._stream_chunk = -1
        self._streaming = True  # until the profile turns out unable to presign
        self._recent = bytearray()  # the stream's last _RECENT bytes

    def plan(self, spans: Sequence[tuple[int, int]]) -> None:
        """The ``(offset, length)`` ranges about to be read, in the order they will be."""
        gap = max(knobs.READ_MAX_GAP_BYTES.get(), 1 << 20)
        self._chunks = plan_chunks(spans, self.size, gap, knobs.MSC_READ_CHUNK_BYTES.get())
        self._starts = [start for start, _ in self._chunks]
        self._held.clear()

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
        got = self._read(self._pos, view[:n])
        self._pos += got
        return got

    def readall(self) -> bytes:
        if self._pos == 0 and not self._chunks:
            data = get(self.url, 0, self.size, whole=True)
            self._pos = len(data)
            return data
        buf = bytearray(max(0, self.size - self._pos))
        done = 0
        while done < len(buf):
            got = self.readinto(memoryview(buf)[done:])
            if not got:
                break
            done += got
        return bytes(buf[:done])

    def close(self) -> None:
        self._end_stream()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._held.clear()
        super().close()

    # ------------------------------------------------------------------ chunks

    def _read(self, offset: int, view: memoryview) -> int:
        """Fill ``view`` from ``offset`` as far as one chunk (or one direct GET) goes."""
        k = bisect.bisect_right(self._starts, offset) - 1
        if k < 0 or offset >= self._chunks[k][1]:
            return self._direct(offset, view)  # outside the plan
        if self._streaming:
            got = self._streamed(k, offset, view)
            if got is not None:
                return got
        small = len(view) <= _SMALL_READ
        if small and k not in self._held and self._held and k > max(self._held) + 1:
            return self._direct(offset, view)  # e.g. the tail of a large item, read first
        if not small:
            for i in [i for i in self._held if i < k]:
                del self._held[i]
        data = self._chunk(k, 0 if small else knobs.MSC_READ_AHEAD.get())
        pos = offset - self._chunks[k][0]
        got = max(0, min(len(view), len(data) - pos))  # less: the object is truncated
        view[:got] = memoryview(data)[pos : pos + got]
        return got

    def _streamed(self, k: int, offset: int, view: memoryview) -> int | None:
        """Fill ``view`` (or its first part) from the streamed GET of chunk ``k``
        (None: this profile cannot stream; the chunk is then fetched whole)."""
        s = self._stream
        if s is not None and self._stream_chunk == k:
            back = s.pos - offset
            if 0 < back <= len(self._recent):  # bytes the stream just delivered
                got = min(len(view), back)
                at = len(self._recent) - back
                view[:got] = self._recent[at : at + got]
                return got
            if 0 <= -back <= _SKIP:
                if offset > s.pos:
                    s.skip(offset - s.pos)
                    self._recent.clear()
                return self._pull(s, view[: max(0, min(len(view), s.end - offset))])
            if len(view) <= _SMALL_READ:
                return self._direct(offset, view)  # far behind or ahead: not worth a GET
        start, end = self._chunks[k]
        if offset - start > _SKIP:
            start = offset
        self._end_stream()
        s = open_stream(self.url, start, end, whole=start == 0 and end == self.size)
        if s is None:
            self._streaming = False
            return None
        self._stream, self._stream_chunk = s, k
        return self._streamed(k, offset, view)

    def _pull(self, s: Stream, view: memoryview) -> int:
        """Read the next bytes of ``s`` into ``view``; keep the last ones in ``_recent``."""
        got = s.readinto(view)
        if got >= _RECENT:
            self._recent[:] = view[got - _RECENT : got]
        else:
            self._recent += view[:got]
            del self._recent[: max(0, len(self._recent) - _RECENT)]
        return got

    def _end_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream, self._stream_chunk = None, -1
        self._recent.clear()

    def _chunk(self, k: int, ahead: int) -> bytes:
        """Chunk ``k`` (fetched now if not held), after starting the next ``ahead``."""
        for i in range(k, min(k + 1 + ahead, len(self._chunks))):
            if i not in self._held:
                self._held[i] = self._fetch(i)
        limit = knobs.MSC_READ_AHEAD.get() + 2
        for i in sorted(self._held):
            if len(self._held) <= limit:
                break
            if i != k:
                del self._held[i]
        return self._held[k].result()

    def _fetch(self, i: int) -> Future[bytes]:
        start, end = self._chunks[i]
        whole = start == 0 and end == self.size
        if self._pool is None:
            threads = knobs.MSC_READ_AHEAD.get() + 1
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dist-ckpt-msc-read")
        return self._pool.submit(get, self.url, start, end - start, whole)

    def _direct(self, offset: int, view: memoryview) -> int:
        data = get(self.url, offset, len(view))
        got = min(len(data), len(view))
        view[:got] = memoryview(data)[:got]
        return got


__all__ = ["RangedReader", "plan_chunks"]
