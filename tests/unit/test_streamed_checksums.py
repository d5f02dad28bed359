"""Checksums of items written in pieces: :class:`BlockHasher` fed in any split gives the
block checksums of the whole item, and the ``raw_bytes`` writer's streamed path (what a
synchronous save of accelerator tensors takes, through the staging pool) writes every
byte at its offset with the same checksums as the host path, whatever the sizes of the
staging buffers and checksum blocks."""

from __future__ import annotations

import hashlib
import io
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing.engine.raw import data_files
from dist_checkpointing.engine.storage.checksums import BlockHasher, block_crcs
from dist_checkpointing.engine.storage.staging_pool import CopyAhead, StagingPool, byte_view


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=5000),
    block=st.integers(1, 700),
    cuts=st.lists(st.integers(0, 5000), max_size=8),
)
def test_block_hasher_fed_in_any_pieces_matches_the_whole(
    data: bytes, block: int, cuts: list[int]
) -> None:
    hasher = BlockHasher(block)
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    for lo, hi in zip(bounds, bounds[1:]):
        hasher.feed(data[lo:hi], hi - lo)
    assert hasher.finish() == block_crcs(data, block)
    # The same pieces in one call (as the item stream hands over a small item's pieces),
    # after a first piece fed alone.
    hasher = BlockHasher(block)
    first = bounds[1] if len(bounds) > 2 else 0
    hasher.feed(data[:first], first)
    pieces = [data[lo:hi] for lo, hi in zip(bounds, bounds[1:]) if lo >= first]
    hasher.feed_all(pieces, [len(p) for p in pieces], len(data) - first)
    assert hasher.finish() == block_crcs(data, block)


def _items(sizes: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    gen = torch.Generator().manual_seed(len(sizes))
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    offsets, pos = [], 0
    for n in sizes:
        pos = -(-pos // 64) * 64  # items at 64-byte offsets, as the writer places them
        offsets.append(pos)
        pos += n
    return tensors, offsets


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 20_000), min_size=1, max_size=4),
    block=st.sampled_from([4096, 5000, 8192]),
    buffer=st.sampled_from([4096, 6000, 16384]),
    to_file=st.booleans(),
)
def test_streamed_items_land_at_their_offsets_with_the_host_checksums(
    tmp_path_factory: pytest.TempPathFactory,
    sizes: list[int],
    block: int,
    buffer: int,
    to_file: bool,
) -> None:
    tensors, offsets = _items(sizes)
    pool = StagingPool(budget_bytes=2 * buffer, buffer_bytes=buffer, pinned=False)
    chunks = iter(CopyAhead(pool, [byte_view(t) for t in tensors]))
    crcs: list[int] = []
    size = offsets[-1] + sizes[-1]
    path = tmp_path_factory.mktemp("streamed") / "f"
    stream: Any = open(path, "w+b", buffering=0) if to_file else io.BytesIO()  # noqa: SIM115
    out = data_files._Out(stream, None, hashlib.sha256())
    pos = 0
    try:
        for offset, n in zip(offsets, sizes):
            if offset > pos:
                out.put([bytes(offset - pos)], pos)  # the gap, as the writer writes it
            data_files._write_streamed(out, chunks, offset, block, crcs)
            pos = offset + n
    finally:
        chunks.close()
        if to_file:
            stream.close()
    written = path.read_bytes() if to_file else stream.getvalue()
    assert len(written) == size
    assert out.sha.hexdigest() == hashlib.sha256(written).hexdigest()  # every byte, in order
    expected: list[int] = []
    for t, offset in zip(tensors, offsets):
        assert written[offset : offset + t.numel()] == t.numpy().tobytes()
        expected += block_crcs(t.numpy().tobytes(), block)
    assert crcs == expected
    assert pool.in_use == 0  # every buffer went back
