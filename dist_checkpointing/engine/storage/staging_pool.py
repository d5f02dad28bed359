"""A reusable pool of fixed-size host buffers, and the copy-ahead pipeline that uses it.

Accelerator tensors reach a file through host memory. Copying them all to the host
first (what a naive writer does) needs as much host memory as the state; here they go
through a :class:`StagingPool` of ``STAGING_BUFFER_BYTES`` buffers holding at most
``COPY_AHEAD_BYTES`` (knobs; an explicit argument wins). :class:`CopyAhead` streams the
bytes of a list of tensors in buffer-sized chunks: it starts the copies of the next
chunks (on a side CUDA stream, one event each) while the caller writes the oldest one,
so the device-to-host copy of chunk ``i + 1`` overlaps the write of chunk ``i``, and
never holds more chunks than the pool has buffers.

Buffers are pinned (page-locked) when CUDA is available, so that the copies are truly
asynchronous and run at full bandwidth; otherwise they are plain memory. The pool is
reused across saves and loads (:func:`shared_pool`): pinning is expensive, and it is
done once per buffer per process.

Call sequence (one rank, any thread): ``pool = shared_pool()``; ``for chunk in
CopyAhead(pool, sources)``: use ``chunk.view`` (valid until the next iteration). Several
threads may run their own :class:`CopyAhead` on one pool; each blocks on the pool only
while it holds no buffer, so they cannot deadlock.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import knobs
from . import item_writer
from .tensor_bytes import byte_view


def pinning_available() -> bool:
    """Whether host buffers can be page-locked here (a CUDA device is present)."""
    return torch.cuda.is_available()


@dataclass(eq=False)
class StagingBuffer:
    """One buffer of a pool: ``data`` is a flat ``uint8`` CPU tensor."""

    data: torch.Tensor
    index: int

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


@dataclass
class PoolStats:
    """What a pool did: for tests and the benchmark."""

    allocated: int = 0  # buffers created (each once, then reused)
    acquired: int = 0  # acquire calls that returned a buffer
    peak_in_use: int = 0  # most buffers held at once


class StagingPool:
    """At most ``budget_bytes`` of host buffers of ``buffer_bytes`` each, reused.

    Buffers are created on first need (``budget // buffer_bytes`` of them, at least
    one) and kept until :meth:`close`. :meth:`acquire` hands out a free buffer (waiting
    for one if ``block``), :meth:`release` returns it.

    Args:
        budget_bytes: host memory the pool may hold (default: ``COPY_AHEAD_BYTES``;
            must be positive: see :func:`shared_pool` for the knob's 0).
        buffer_bytes: size of each buffer (default: ``STAGING_BUFFER_BYTES``, capped at
            the budget).
        pinned: page-lock the buffers (default: when CUDA is available).
    """

    def __init__(
        self,
        budget_bytes: int | None = None,
        buffer_bytes: int | None = None,
        pinned: bool | None = None,
    ) -> None:
        budget = knobs.COPY_AHEAD_BYTES.get(budget_bytes)
        size = min(knobs.STAGING_BUFFER_BYTES.get(buffer_bytes), budget)
        if size <= 0:
            raise ValueError(f"a staging pool needs a positive budget and buffer size, got {size}")
        self.buffer_bytes = size
        self.capacity = max(1, budget // size)
        self.pinned = pinning_available() if pinned is None else pinned
        self.stats = PoolStats()
        self._free: list[StagingBuffer] = []
        self._in_use = 0
        self._cond = threading.Condition()
        self._closed = False

    @property
    def budget_bytes(self) -> int:
        """The most host memory the pool's buffers take."""
        return self.capacity * self.buffer_bytes

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._in_use

    def _new_buffer(self) -> StagingBuffer:
        data = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.stats.allocated += 1
        return StagingBuffer(data, self.stats.allocated - 1)

    def acquire(self, block: bool = True, timeout: float | None = None) -> StagingBuffer | None:
        """A free buffer; None if none is free and ``block`` is False (or on timeout)."""
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the staging pool is closed")
                if self._free or self.stats.allocated < self.capacity:
                    break
                if not block or not self._cond.wait(timeout):
                    return None
            buffer = self._free.pop() if self._free else self._new_buffer()
            self._in_use += 1
            self.stats.acquired += 1
            self.stats.peak_in_use = max(self.stats.peak_in_use, self._in_use)
            return buffer

    def release(self, buffer: StagingBuffer) -> None:
        """Give ``buffer`` back (it may be handed out again at once)."""
        with self._cond:
            self._in_use -= 1
            if not self._closed:
                self._free.append(buffer)
            self._cond.notify()

    def close(self) -> None:
        """Drop the free buffers; buffers still held are dropped when released."""
        with self._cond:
            self._closed = True
            self._free.clear()
            self._cond.notify_all()


_pools: dict[tuple[int, int, bool], StagingPool] = {}
_pools_lock = threading.Lock()


def shared_pool(
    budget_bytes: int | None = None, buffer_bytes: int | None = None
) -> StagingPool | None:
    """This process's pool for the given (or configured) budget and buffer size; None
    when the budget is 0 (no pool: each accelerator tensor is copied to the host whole).

    Created on first use and kept (like torch's caching host allocator), so that every
    save and load of the process reuses its pinned buffers.
    """
    budget = knobs.COPY_AHEAD_BYTES.get(budget_bytes)
    if budget == 0:
        return None
    size = min(knobs.STAGING_BUFFER_BYTES.get(buffer_bytes), budget)
    key = (budget, size, pinning_available())
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = StagingPool(budget, size, key[2])
        return pool


@dataclass(eq=False)
class Chunk:
    """One staged piece: bytes ``[offset, offset + len(view))`` of source ``source``."""

    source: int
    offset: int
    view: memoryview
    last: bool  # the last chunk of its source


@dataclass(eq=False)
class _InFlight:
    source: int
    offset: int
    length: int
    buffer: StagingBuffer
    event: Any  # a torch.cuda.Event, or None when the copy was synchronous
    last: bool


@dataclass(eq=False)
class CopyAhead:
    """Streams the bytes of ``sources`` through ``pool``, copying ahead of the reader.

    ``sources`` are flat ``uint8`` tensors (see :func:`byte_view`) on any device.
    Iterating yields their :class:`Chunk` s in order (source by source, offset by
    offset, at most ``pool.buffer_bytes`` each); a chunk's ``view`` is valid until the
    next step of the iteration, when its buffer goes back to the pool. Before yielding
    a chunk it starts the copies of the following chunks into every buffer it can get
    without waiting; it waits for a buffer only while it holds none. Copies from CUDA
    run on a side stream that first waits for the current stream (what was computed is
    copied); copies from CPU memory run at once.
    """

    pool: StagingPool
    sources: Sequence[torch.Tensor]
    ahead: int = 0  # most buffers this iterator holds at once (0: as many as it gets)
    _pending: deque[_InFlight] = field(default_factory=deque)
    _streams: dict[torch.device, Any] = field(default_factory=dict)

    def _plan(self) -> Iterator[tuple[int, int, int, bool]]:
        step = self.pool.buffer_bytes
        for i, src in enumerate(self.sources):
            n = int(src.numel())
            if n == 0:
                yield i, 0, 0, True
                continue
            for start in range(0, n, step):
                yield i, start, min(step, n - start), start + step >= n

    def _start_copy(self, plan: tuple[int, int, int, bool], buffer: StagingBuffer) -> _InFlight:
        source, offset, length, last = plan
        src = self.sources[source][offset : offset + length]
        dst = buffer.data[:length]
        event = None
        if src.device.type == "cuda":
            stream = self._streams.get(src.device)
            if stream is None:
                stream = self._streams[src.device] = torch.cuda.Stream(src.device)
            stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        else:
            dst.copy_(src)
        return _InFlight(source, offset, length, buffer, event, last)

    def __iter__(self) -> Generator[Chunk, None, None]:
        plan = self._plan()
        upcoming = next(plan, None)
        try:
            while True:
                while upcoming is not None and (not self.ahead or len(self._pending) < self.ahead):
                    buffer = self.pool.acquire(block=not self._pending)
                    if buffer is None:
                        break  # all buffers are busy: write what is staged first
                    self._pending.append(self._start_copy(upcoming, buffer))
                    upcoming = next(plan, None)
                if not self._pending:
                    return
                done = self._pending.popleft()
                if done.event is not None:
                    done.event.synchronize()
                view = done.buffer.data[: done.length].numpy().data
                try:
                    yield Chunk(done.source, done.offset, view, done.last)
                finally:
                    del view
                    self.pool.release(done.buffer)
        finally:
            self._drain()

    def _drain(self) -> None:
        """Wait for and release every buffer still held (an abandoned iteration)."""
        while self._pending:
            done = self._pending.popleft()
            if done.event is not None:
                done.event.synchronize()
            self.pool.release(done.buffer)


def callers_stream() -> Callable[[], AbstractContextManager[Any]]:
    """A context that makes the caller's current CUDA stream current in another thread
    (threads start on the default stream): copies to the device made there (e.g. by
    :func:`fill_from_host`) then follow the caller's pending work on its stream, as they
    would in the caller's own thread. Call it in the caller's thread."""
    if not torch.cuda.is_initialized():
        return contextlib.nullcontext
    stream = torch.cuda.current_stream()
    return functools.partial(torch.cuda.stream, stream)


def fill_from_host(
    target: torch.Tensor, read: Callable[[int, torch.Tensor], None], pool: StagingPool
) -> None:
    """Fill contiguous ``target`` (an accelerator tensor) through ``pool``'s buffers.

    ``read(offset, host)`` fills the flat ``uint8`` CPU tensor ``host`` with the bytes of
    ``target`` from ``offset`` on (e.g. from a file); each chunk is then copied to the
    device on a side stream while the next chunk is read. Returns once every copy is
    complete (later work on the current stream sees the values). Host memory: at most
    the pool's budget, whatever the size of ``target``.
    """
    flat = byte_view(target)
    cuda = flat.device.type == "cuda"
    stream = torch.cuda.Stream(flat.device) if cuda else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(flat.device))
    pending: deque[tuple[StagingBuffer, Any]] = deque()

    def finish_oldest() -> None:
        buffer, event = pending.popleft()
        if event is not None:
            event.synchronize()
        pool.release(buffer)

    try:
        for start in range(0, int(flat.numel()), pool.buffer_bytes):
            length = min(pool.buffer_bytes, int(flat.numel()) - start)
            buffer = pool.acquire(block=not pending)
            while buffer is None:  # every buffer busy: wait for our oldest copy
                finish_oldest()
                buffer = pool.acquire(block=not pending)
            pending.append((buffer, None))
            host = buffer.data[:length]
            read(start, host)
            if stream is None:
                flat[start : start + length].copy_(host)
                continue
            with torch.cuda.stream(stream):
                flat[start : start + length].copy_(host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            pending[-1] = (buffer, event)
    finally:
        while pending:
            finish_oldest()
        if stream is not None:
            torch.cuda.current_stream(flat.device).wait_stream(stream)


class TensorItemWriter:
    """Writes the tensor items of one data file: accelerator tensors stream through
    :func:`shared_pool` (one :class:`CopyAhead` over all of them, so the copies of the
    next item overlap the write of this one), views of larger CPU buffers (snapshot
    segments) are written with their own bytes only, other CPU tensors as they are.

    Call sequence: ``write(stream, i, tensor)`` for each item in order, then ``close()``
    (also after a failure: it waits for copies still running and frees their buffers).
    """

    def __init__(
        self, tensor_items: Sequence[tuple[Any, torch.Tensor]], compute_crc: bool | None = None
    ) -> None:
        if compute_crc is None:
            compute_crc = torch.serialization.get_crc32_options()
        self._compute_crc = compute_crc  # torch's crc32 option, read once per file
        on_device = [i for i, (_, t) in enumerate(tensor_items) if not t.is_cpu]
        pool = shared_pool() if on_device else None
        self.streamed = (
            {i for i in on_device if item_writer.can_stream(tensor_items[i][1])}
            if pool is not None
            else set()
        )
        order = sorted(self.streamed)
        self._chunks: Any = iter(())
        if pool is not None and order:
            sources = [byte_view(tensor_items[i][1]) for i in order]
            self._chunks = iter(CopyAhead(pool, sources))

    def write(self, stream: Any, index: int, tensor: torch.Tensor) -> int:
        """Write item ``index`` (``tensor``) to ``stream``; return the bytes written."""
        if index in self.streamed:
            return item_writer.write_tensor_streamed(stream, tensor, self._pieces())
        if item_writer.fast_path_applies(tensor, self._compute_crc):
            return item_writer.write_plain_tensor(stream, tensor, self._compute_crc)  # most
        if tensor.is_cpu and not _whole_storage(tensor):
            # A view of a larger buffer (a snapshot segment): only its own bytes.
            if item_writer.can_stream(tensor):
                return item_writer.write_plain_tensor(stream, tensor, self._compute_crc)
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        if not tensor.is_cpu:
            # No pool (COPY_AHEAD_BYTES=0) or a tensor the streamed writer does not
            # handle: one whole copy at a time.
            tensor = tensor.cpu()
        return item_writer.write_tensor(stream, tensor, self._compute_crc)

    def _pieces(self) -> Iterator[memoryview]:
        for chunk in self._chunks:
            yield chunk.view
            if chunk.last:
                return

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()  # waits for copies still running and returns their buffers


def _whole_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes


__all__ = [
    "Chunk",
    "CopyAhead",
    "PoolStats",
    "StagingBuffer",
    "StagingPool",
    "TensorItemWriter",
    "byte_view",
    "callers_stream",
    "fill_from_host",
    "pinning_available",
    "shared_pool",
]
