"""The staging pool and its copy-ahead pipeline, on CPU (non-pinned buffers stand in for
pinned ones); the CUDA parts are in tests marked ``gpu``."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from dist_checkpointing.engine import knobs
from dist_checkpointing.engine.storage import item_writer
from dist_checkpointing.engine.storage.staging_pool import (
    CopyAhead,
    StagingPool,
    byte_view,
    fill_from_host,
    shared_pool,
)

KIB = 1024


def _sources(*sizes: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]


def test_acquire_respects_the_budget_and_buffers_are_reused() -> None:
    pool = StagingPool(budget_bytes=3 * KIB, buffer_bytes=KIB, pinned=False)
    assert pool.capacity == 3 and pool.budget_bytes == 3 * KIB
    held = [pool.acquire() for _ in range(3)]
    assert all(b is not None for b in held)
    assert pool.acquire(block=False) is None
    assert pool.acquire(timeout=0.01) is None
    for b in held:
        assert b is not None
        pool.release(b)
    for _ in range(10):
        b = pool.acquire()
        assert b is not None
        pool.release(b)
    assert pool.stats.allocated == 3  # never more than the budget, then reused
    assert pool.stats.peak_in_use == 3
    assert pool.in_use == 0


def test_a_blocked_acquire_wakes_on_release() -> None:
    pool = StagingPool(budget_bytes=KIB, buffer_bytes=KIB, pinned=False)
    first = pool.acquire()
    assert first is not None
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=30)))
    waiter.start()
    pool.release(first)
    waiter.join(30)
    assert got and got[0] is first


def test_the_budget_comes_from_the_knob_and_an_argument_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DIST_CKPT_COPY_AHEAD_BYTES", str(8 * KIB))
    monkeypatch.setenv("DIST_CKPT_STAGING_BUFFER_BYTES", str(4 * KIB))
    assert StagingPool(pinned=False).capacity == 2
    assert StagingPool(budget_bytes=16 * KIB, pinned=False).capacity == 4
    monkeypatch.setenv("DIST_CKPT_COPY_AHEAD_BYTES", "0")
    assert shared_pool() is None  # 0: no pool, whole copies
    with pytest.raises(ValueError, match="positive"):
        StagingPool(pinned=False)
    assert knobs.COPY_AHEAD_BYTES.default == 256 << 20


@pytest.mark.parametrize("capacity", [1, 2, 5])
def test_copy_ahead_streams_every_byte_in_order(capacity: int) -> None:
    pool = StagingPool(budget_bytes=capacity * KIB, buffer_bytes=KIB, pinned=False)
    sources = _sources(3 * KIB + 5, 0, 17, 2 * KIB)
    out: dict[int, bytearray] = {i: bytearray() for i in range(len(sources))}
    lasts = []
    for chunk in CopyAhead(pool, sources):
        assert len(chunk.view) <= KIB
        assert pool.in_use <= capacity
        out[chunk.source] += chunk.view
        if chunk.last:
            lasts.append(chunk.source)
    assert lasts == [0, 1, 2, 3]
    for i, src in enumerate(sources):
        assert bytes(out[i]) == src.numpy().tobytes()
    assert pool.in_use == 0
    assert pool.stats.allocated <= capacity


def test_copy_ahead_copies_the_next_chunk_before_the_current_one_is_written() -> None:
    """The overlap: chunk i + 1 is being copied while chunk i is handed out."""
    log: list[tuple[str, int]] = []

    class Recording(CopyAhead):
        def _start_copy(self, plan, buffer):  # type: ignore[no-untyped-def]
            log.append(("copy", plan[1]))
            return super()._start_copy(plan, buffer)

    pool = StagingPool(budget_bytes=2 * KIB, buffer_bytes=KIB, pinned=False)
    for chunk in Recording(pool, _sources(4 * KIB)):
        log.append(("write", chunk.offset))
    assert log == [
        ("copy", 0),
        ("copy", KIB),
        ("write", 0),
        ("copy", 2 * KIB),
        ("write", KIB),
        ("copy", 3 * KIB),
        ("write", 2 * KIB),
        ("write", 3 * KIB),
    ]


def test_an_abandoned_iteration_gives_its_buffers_back() -> None:
    pool = StagingPool(budget_bytes=4 * KIB, buffer_bytes=KIB, pinned=False)
    chunks = iter(CopyAhead(pool, _sources(10 * KIB)))
    next(chunks)
    assert pool.in_use > 1
    chunks.close()  # type: ignore[attr-defined]
    assert pool.in_use == 0


def test_threads_share_one_pool_without_deadlock() -> None:
    pool = StagingPool(budget_bytes=2 * KIB, buffer_bytes=KIB, pinned=False)
    sources = _sources(*(7 * KIB + i for i in range(6)))
    results: dict[int, bytes] = {}

    def run(i: int) -> None:
        data = bytearray()
        for chunk in CopyAhead(pool, [sources[i]]):
            data += chunk.view
        results[i] = bytes(data)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sources))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(not t.is_alive() for t in threads)
    assert results == {i: s.numpy().tobytes() for i, s in enumerate(sources)}
    assert pool.stats.peak_in_use <= 2 and pool.in_use == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_streamed_tensor_item_is_what_torch_save_writes(dtype: torch.dtype) -> None:
    t = (torch.arange(3 * 1000) % 7).to(dtype).reshape(3, 1000)
    expected = io.BytesIO()
    torch.save(t, expected)
    pool = StagingPool(budget_bytes=2 * KIB, buffer_bytes=KIB, pinned=False)
    assert item_writer.can_stream(t)
    ours = io.BytesIO()
    pieces = (c.view for c in CopyAhead(pool, [byte_view(t)]))
    n = item_writer.write_tensor_streamed(ours, t, pieces)
    assert ours.getvalue() == expected.getvalue() and n == len(expected.getvalue())


@pytest.mark.parametrize("parallel_crc", [True, False], ids=["crc-thread", "crc-inline"])
def test_streamed_pieces_checksummed_beside_the_write(
    monkeypatch: pytest.MonkeyPatch, parallel_crc: bool
) -> None:
    """Pieces large enough for the CRC thread (each continuing the previous piece's CRC)
    and a short last piece: the bytes are torch.save's, CRC-32 included."""
    monkeypatch.setattr(item_writer, "_PARALLEL_CRC_BYTES", KIB)
    monkeypatch.setattr(item_writer, "_CHUNK_BYTES", 300)
    monkeypatch.setattr(item_writer, "_spare_cores", lambda: parallel_crc)
    t = torch.arange(5 * KIB // 4 + 7, dtype=torch.float32)
    expected = io.BytesIO()
    torch.save(t, expected)
    pool = StagingPool(budget_bytes=2 * KIB, buffer_bytes=KIB, pinned=False)
    ours = io.BytesIO()
    pieces = (c.view for c in CopyAhead(pool, [byte_view(t)]))
    assert item_writer.write_tensor_streamed(ours, t, pieces) == len(expected.getvalue())
    assert ours.getvalue() == expected.getvalue()


def test_a_streamed_view_is_written_like_its_compact_copy() -> None:
    base = torch.arange(100, dtype=torch.float32)
    view = base[10:30]
    expected = io.BytesIO()
    torch.save(view.clone(), expected)
    ours = io.BytesIO()
    item_writer.write_tensor_streamed(ours, view, [byte_view(view).numpy().data])
    assert ours.getvalue() == expected.getvalue()


def test_a_short_stream_is_an_error() -> None:
    t = torch.zeros(10)
    with pytest.raises(ValueError, match="staged 8 bytes"):
        item_writer.write_tensor_streamed(io.BytesIO(), t, [b"\0" * 8])


def test_fill_from_host_reads_chunk_by_chunk_within_the_budget() -> None:
    """The load side (a CPU target stands in for a device one)."""
    pool = StagingPool(budget_bytes=2 * KIB, buffer_bytes=KIB, pinned=False)
    (source,) = _sources(5 * KIB + 3)
    target = torch.zeros(5 * KIB + 3, dtype=torch.uint8)
    reads: list[int] = []

    def read(offset: int, host: torch.Tensor) -> None:
        assert host.numel() <= KIB and pool.in_use <= 2
        reads.append(offset)
        host.copy_(source[offset : offset + host.numel()])

    fill_from_host(target, read, pool)
    assert torch.equal(target, source)
    assert reads == [0, KIB, 2 * KIB, 3 * KIB, 4 * KIB, 5 * KIB]
    assert pool.in_use == 0 and pool.stats.allocated <= 2


def test_fill_from_host_gives_buffers_back_when_a_read_fails() -> None:
    pool = StagingPool(budget_bytes=2 * KIB, buffer_bytes=KIB, pinned=False)

    def failing(offset: int, host: torch.Tensor) -> None:
        if offset:
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        fill_from_host(torch.zeros(4 * KIB, dtype=torch.uint8), failing, pool)
    assert pool.in_use == 0
