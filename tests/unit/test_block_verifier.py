"""BlockVerifier: the blocks a reader touched are verified, whatever the pieces.

The reader hands the verifier the pieces it read (any order, any split, with gaps
for a partial, resharded read); blocks a piece covers whole are checksummed when it
is added, the rest when the item is finished, fetching the unread bytes of touched
blocks. A damaged byte in any touched block must be found, with its block's offset.
"""

from __future__ import annotations

import io
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing.engine.storage.checksums import (
    BlockVerifier,
    ChecksumMismatch,
    ChecksumStream,
    ItemChecksum,
)


def _item_checksum(data: bytes, block: int) -> ItemChecksum:
    stream = ChecksumStream(io.BytesIO(), block)
    stream.begin_item()
    stream.write(data)
    checksum = stream.end_item()
    assert checksum is not None
    return checksum


@st.composite
def reads(draw: st.DrawFn) -> tuple[bytes, int, list[tuple[int, int]]]:
    """An item, a block size, and the (offset, length) pieces a reader reads of it."""
    block = draw(st.sampled_from([4, 7, 16, 64]))
    length = draw(st.integers(1, 300))
    data = os.urandom(length)
    cuts = sorted(set(draw(st.lists(st.integers(0, length), max_size=8))) | {0, length})
    spans = [(a, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]
    kept = draw(st.lists(st.booleans(), min_size=len(spans), max_size=len(spans)))
    chosen = [s for s, keep in zip(spans, kept) if keep] or spans[:1]
    return data, block, draw(st.permutations(chosen))


def _verify(stored: bytes, seen: bytes, block: int, pieces: list[tuple[int, int]]) -> None:
    verifier = BlockVerifier(_item_checksum(stored, block), block)
    for offset, n in pieces:
        verifier.add(offset, bytearray(seen[offset : offset + n]))
    verifier.finish(lambda offset, n: memoryview(bytearray(seen[offset : offset + n])))


@settings(max_examples=300, deadline=None)
@given(reads())
def test_intact_bytes_pass_for_any_split(case: tuple[bytes, int, list[tuple[int, int]]]) -> None:
    data, block, pieces = case
    _verify(data, data, block, pieces)


@settings(max_examples=300, deadline=None)
@given(reads(), st.data())
def test_a_damaged_byte_in_a_touched_block_is_found(
    case: tuple[bytes, int, list[tuple[int, int]]], draw: st.DataObject
) -> None:
    data, block, pieces = case
    touched = sorted(
        {b for offset, n in pieces for b in range(offset // block, (offset + n - 1) // block + 1)}
    )
    b = draw.draw(st.sampled_from(touched))
    at = draw.draw(st.integers(b * block, min((b + 1) * block, len(data)) - 1))
    damaged = bytearray(data)
    damaged[at] ^= 1 << draw.draw(st.integers(0, 7))
    with pytest.raises(ChecksumMismatch) as info:
        _verify(data, bytes(damaged), block, pieces)
    assert info.value.offset == b * block


def test_whole_blocks_are_checksummed_when_added() -> None:
    data = os.urandom(100)
    verifier = BlockVerifier(_item_checksum(data, 16), 16)
    verifier.add(10, memoryview(data)[10:70])
    # Blocks 1..3 ([16, 64)) lie wholly inside the piece; 0 and 4 do not.
    assert sorted(verifier.covered) == [1, 2, 3]
    verifier.add(96, memoryview(data)[96:])  # the short last block, whole
    assert 6 in verifier.covered
    verifier.finish(lambda offset, n: memoryview(data)[offset : offset + n])
