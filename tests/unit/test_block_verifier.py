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
    block_crcs,
)
from dist_checkpointing.engine.storage.item_checksums import ItemChecksum
from dist_checkpointing.engine.storage.item_stream import ChecksumStream
from dist_checkpointing.engine.storage.staging_pool import StagingPool, fill_from_host


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


def _verify(
    stored: bytes,
    seen: bytes,
    block: int,
    pieces: list[tuple[int, int]],
    precomputed: bool,
    transient: bool = False,
) -> None:
    verifier = BlockVerifier(_item_checksum(stored, block), block)
    staging = bytearray(len(seen))  # one buffer reused for every transient piece
    for offset, n in pieces:
        piece = bytearray(seen[offset : offset + n])
        if transient:
            staging[:n] = piece
            piece = memoryview(staging)[:n]  # type: ignore[assignment]
        # As the hashing thread hands them over: the block CRCs of the piece as read.
        values = block_crcs(piece, block) if precomputed else None
        verifier.add(offset, piece, values, transient)
        if transient:
            staging[:] = bytes([0xA5]) * len(staging)  # the buffer's next use
    verifier.finish(lambda offset, n: memoryview(bytearray(seen[offset : offset + n])))


@settings(max_examples=300, deadline=None)
@given(reads(), st.booleans(), st.booleans())
def test_intact_bytes_pass_for_any_split(
    case: tuple[bytes, int, list[tuple[int, int]]], precomputed: bool, transient: bool
) -> None:
    """Also when every piece arrives in one staging buffer, reused after each add."""
    data, block, pieces = case
    _verify(data, data, block, pieces, precomputed, transient)


@settings(max_examples=300, deadline=None)
@given(reads(), st.data(), st.booleans(), st.booleans())
def test_a_damaged_byte_in_a_touched_block_is_found(
    case: tuple[bytes, int, list[tuple[int, int]]],
    draw: st.DataObject,
    precomputed: bool,
    transient: bool,
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
        _verify(data, bytes(damaged), block, pieces, precomputed, transient)
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


# ------------------------------------------------- large reads, hashed on a helper thread


def _read_item_into_tensor(
    path: str,
    data: bytes,
    block: int,
    checksum: ItemChecksum,
    start: int = 0,
    staging_bytes: int = 0,
) -> bytes:
    """The item's bytes from ``start``, read into a tensor (``staging_bytes``: through a
    pool of staging buffers of that size, as a load into an accelerator tensor is)."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from dist_checkpointing.engine.storage.byte_ranges import DataFile, ItemBytes

    index = MetadataIndex("layer.weight")
    read_item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=index,
        dest_offsets=torch.Size([0]),
        storage_index=index,
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([len(data)]),
    )
    target = torch.zeros(len(data) - start, dtype=torch.uint8)  # a partial read from start
    with open(path, "rb", buffering=0) as stream:
        file = DataFile(stream, path, len(data), (0, 0, 1))  # no window: read in place
        item = ItemBytes(file, 0, len(data), read_item)
        item.verifier = BlockVerifier(checksum, block)
        if staging_bytes:
            pool = StagingPool(budget_bytes=2 * staging_bytes, buffer_bytes=staging_bytes)
            fill_from_host(
                target, lambda at, host: item.read_into_tensor(start + at, host, True), pool
            )
        else:
            item.read_into_tensor(start, target)
        item.verify()
    return target.numpy().tobytes()


@pytest.mark.parametrize("thread", ["1", "0"])
@settings(max_examples=25, deadline=None)
@given(
    blocks=st.integers(1, 19),
    tail=st.integers(0, 4095),
    start=st.integers(0, 9000),
    staging=st.sampled_from([0, 4096, 5000, 12288]),
    damage=st.data(),
)
def test_large_reads_verify_every_block_with_and_without_the_hashing_thread(
    thread: str,
    blocks: int,
    tail: int,
    start: int,
    staging: int,
    damage: st.DataObject,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A read of the item from ``start`` (a partial, resharded read when not 0) into a
    tensor, directly or through reused staging buffers (``staging``): intact bytes
    arrive whole; a damaged byte in any block the read touched is reported with its
    block's offset."""
    from dist_checkpointing.errors import ChecksumMismatchError

    block = 4096
    data = os.urandom(blocks * block + tail)
    start = min(start, len(data) - 1)
    checksum = _item_checksum(data, block)
    path = str(tmp_path_factory.mktemp("item") / "__0_0.distcp")
    with open(path, "wb") as f:
        f.write(data)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIST_CKPT_CHECKSUM_THREAD", thread)
        read = _read_item_into_tensor(path, data, block, checksum, start, staging)
        assert read == data[start:]
        at = damage.draw(st.integers(start // block * block, len(data) - 1))
        damaged = bytearray(data)
        damaged[at] ^= 0x01
        with open(path, "wb") as f:
            f.write(damaged)
        with pytest.raises(ChecksumMismatchError) as err:
            _read_item_into_tensor(path, data, block, checksum, start, staging)
    assert f"at byte {at // block * block}" in str(err.value)
    assert "'layer.weight'" in str(err.value) and path in str(err.value)


def test_the_hashing_thread_works_in_a_forked_child() -> None:
    import multiprocessing

    from dist_checkpointing.engine.storage.checksums import crc, hashing_thread

    pool = hashing_thread()
    assert pool is not None and pool.submit(crc, b"abc").result(timeout=5) == crc(b"abc")

    def child(conn: multiprocessing.connection.Connection) -> None:
        worker = hashing_thread()  # the parent's thread does not exist here
        assert worker is not pool
        conn.send(worker.submit(crc, b"abc").result(timeout=5) if worker else None)

    parent_end, child_end = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(target=child, args=(child_end,))
    proc.start()
    assert parent_end.poll(20), "the forked child's hashing thread never ran"
    assert parent_end.recv() == crc(b"abc")
    proc.join(10)
    assert proc.exitcode == 0


@pytest.mark.parametrize("length", [0, 1, 63, 64, 65, 200])
def test_check_whole_finds_any_damaged_byte(length: int) -> None:
    block = 64
    data = os.urandom(length)
    verifier = BlockVerifier(_item_checksum(data, block), block)
    verifier.check_whole(memoryview(data))
    for at in range(length):
        damaged = bytearray(data)
        damaged[at] ^= 0x80
        with pytest.raises(ChecksumMismatch) as err:
            verifier.check_whole(memoryview(damaged))
        assert err.value.offset == at // block * block
    if length:  # a shorter or longer item does not pass either
        with pytest.raises(ChecksumMismatch):
            verifier.check_whole(memoryview(data[:-1]))
    with pytest.raises(ChecksumMismatch):
        verifier.check_whole(memoryview(data + b"x"))


@pytest.mark.parametrize(
    ("mode", "local_ranks", "threaded"),
    [("0", "1", False), ("1", "64", True), ("2", "1", True), ("2", "64", False), ("", "64", False)],
)
def test_the_hashing_thread_runs_only_beside_a_spare_core(
    monkeypatch: pytest.MonkeyPatch, mode: str, local_ranks: str, threaded: bool
) -> None:
    """By default (2) the CRC goes to a helper thread only where this host has a core more
    than ranks; with every core busy it runs inline, on bytes still in the cache."""
    from dist_checkpointing.engine import process
    from dist_checkpointing.engine.storage import checksums

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setenv("DIST_CKPT_CHECKSUM_THREAD", mode)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    assert (checksums.hashing_thread() is not None) is threaded
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2(x4)")  # SLURM's own spelling
    assert process.ranks_on_this_host() == 2 and not process.spare_core()


@pytest.mark.parametrize(
    ("cores", "local_ranks", "knob", "readers", "hashing"),
    [
        (2, "1", "", 2, False),  # the development VM: two readers take both cores
        (2, "2", "", 1, False),
        (16, "1", "", 8, True),  # at most 8 readers, cores left for hashing
        (16, "2", "", 8, False),  # 8 cores per rank, all reading
        (16, "4", "", 4, False),
        (16, "8", "", 2, False),
        (16, "1", "3", 3, True),  # the knob wins
    ],
)
def test_readers_and_hashing_threads_share_the_ranks_cores(
    monkeypatch: pytest.MonkeyPatch,
    cores: int,
    local_ranks: str,
    knob: str,
    readers: int,
    hashing: bool,
) -> None:
    """A load reads local files on up to ``READ_THREADS`` threads (by default the rank's
    share of the cores, at most 8); checksums go to the hashing pool only where the host
    has cores beyond every rank's readers."""
    from dist_checkpointing.engine.storage import checksums
    from dist_checkpointing.engine.storage.local import LocalFileSystem

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    monkeypatch.setenv("DIST_CKPT_READ_THREADS", knob)
    monkeypatch.delenv("DIST_CKPT_CHECKSUM_THREAD", raising=False)
    monkeypatch.setattr(checksums, "_hasher", None)
    assert LocalFileSystem().parallel_reads() == readers
    pool = checksums.hashing_thread(readers)
    assert (pool is not None) is hashing
    if pool is not None:  # one core of the rank's share stays with its reader
        assert pool._max_workers == max(1, min(4, cores // int(local_ranks) - 1))
        pool.shutdown()
    assert checksums.hashing_thread(1) is not None or cores <= int(local_ranks)
