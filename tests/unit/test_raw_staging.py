"""The staging memory of a ``raw_bytes`` reading thread (``reader._Staging``): staged
reads of one batch side by side in one reused buffer of at most ``cap`` bytes, a read
larger than that alone in a buffer of its own, each delivered once."""

from __future__ import annotations

import ctypes

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing.engine.raw.reader import Read, Staged, _Staging


def _staged(length: int, lead: int, delivered: list[tuple[int, bytes]], tag: int) -> Read:
    def deliver(buf: torch.Tensor) -> None:
        delivered.append((tag, bytes(buf[lead:].numpy())))

    return Read(0, 0, length, None, 0, stage=Staged(lead, deliver))


def _span(r: Read) -> tuple[int, int]:
    return ctypes.addressof(r.dest), ctypes.addressof(r.dest) + r.length


@settings(max_examples=300, deadline=None)
@given(
    cap=st.integers(64, 4096),
    reads=st.lists(st.tuples(st.integers(1, 6000), st.integers(0, 7)), min_size=1, max_size=30),
)
def test_a_batch_never_shares_memory_and_a_large_read_lands_alone(
    cap: int, reads: list[tuple[int, int]]
) -> None:
    staging = _Staging(cap)
    delivered: list[tuple[int, bytes]] = []
    batch: list[Read] = []
    largest = 0
    for tag, (length, lead) in enumerate(reads):
        r = _staged(length, lead, delivered, tag)
        if not staging.land(r):
            assert batch  # refused only beside reads already landed
            for landed in batch:  # what the reader does: read, check, deliver
                ctypes.memset(ctypes.addressof(landed.dest), landed.length % 251, landed.length)
            staging.deliver()
            batch.clear()
            assert staging.land(r)
        batch.append(r)
        spans = sorted(_span(x) for x in batch)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # side by side
        sizes = [x.length + x.stage.lead for x in batch if x.stage is not None]
        assert max(sizes) <= cap or len(batch) == 1  # a read over the cap lands alone
        largest = max(largest, staging.buf.numel())
    for landed in batch:
        ctypes.memset(ctypes.addressof(landed.dest), landed.length % 251, landed.length)
    staging.deliver()
    assert largest <= cap  # the shared buffer never grows past the cap
    assert sorted(t for t, _ in delivered) == list(range(len(reads)))  # each once
    for tag, data in delivered:
        length = reads[tag][0]
        assert data == bytes([length % 251]) * length
        assert all(r.dest is None for r in batch)


def test_the_buffer_grows_to_hold_a_batch_of_small_reads() -> None:
    """Small staged reads (a resharding load of many column blocks) share one buffer:
    once a batch found no room beside the first read, the buffer grows (up to the cap),
    so later batches hold many reads, not one read and one ``preadv`` each."""
    staging = _Staging(1 << 20)
    delivered: list[tuple[int, bytes]] = []
    batches = []
    batch = 0
    for tag in range(200):
        r = _staged(4096, 0, delivered, tag)
        if not staging.land(r):
            staging.deliver()
            batches.append(batch)
            batch = 0
            assert staging.land(r)
        batch += 1
    staging.deliver()
    assert len(delivered) == 200
    assert batches[0] == 1  # the buffer started at the first read's size
    assert max(batches) >= 64  # then doubled: 200 reads in a handful of batches
    assert len(batches) <= 10
    assert staging.buf.numel() <= 1 << 20
