"""Small tensor items read straight into their destinations: :func:`read_direct`.

The reader fetches small neighbouring items with one read into a window, then copies
each item's tensor bytes from the window into its destination. Where the layout of an
item is already known before it is read, that copy is not needed: a run of such items
is read with one ``os.preadv`` per 1,024 buffers, each item's records before its tensor
bytes into a small buffer, the tensor bytes into the destination tensor itself, and the
records after them into another small buffer.

The layout is expected from the item's length and the request: of the layouts
recognized in items of that length (:func:`.item_reader.known_layouts`), the one of
the requested shape and the destination's dtype. It is then checked as for any item:
the records read must be that layout's, else the item is read the usual way (its
destination is filled again). The item's
checksum covers what was read, in order (the records, the tensor bytes, the records
after), and is checked before its records are, so that damage is reported as damage.

Only the plain case is read this way: a whole stored tensor into a contiguous CPU
destination of its dtype, from a local file (a descriptor), an item of one checksum
block at most. Anything else stops the run; the caller goes on the usual way.
:func:`direct_runs` also hands a large item of a known layout to
:mod:`.direct_large`, where no run of small items starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ...errors import CorruptCheckpointError
from .byte_ranges import DataFile, mismatch_error, part_count
from .checksums import crc, hashing_thread
from .direct_large import LargeCheck, choose_layout, fits, read_large
from .item_checksums import ItemChecksum
from .item_reader import KnownLayout, known_layouts
from .overlaps import overlapping
from .positional import IOV_MAX, read_all_at
from .tensor_bytes import buffer_of


@dataclass
class _Direct:
    """One item of a run: where it is, where its tensor bytes land, what it must hold."""

    read_item: ReadItem
    offset: int
    length: int
    layout: KnownLayout
    target: torch.Tensor
    checksum: ItemChecksum | None
    head: bytearray
    data: Any  # the target's bytes
    tail: bytearray


# Resolves a read item to the tensor its bytes are read into.
Resolve = Callable[[ReadItem], torch.Tensor]
# The recorded checksum of the item at an offset, of that length (None: not verified),
# or False: no such record (the usual path reports it).
ChecksumOf = Callable[[int, int], "ItemChecksum | None | bool"]


def read_direct(
    file: DataFile,
    items: Sequence[tuple[ReadItem, Any]],
    i: int,
    resolve: Resolve,
    checksum_of: ChecksumOf,
    commit: Callable[[ReadItem, torch.Tensor], None],
    before: Callable[[], None] = lambda: None,
) -> int:
    """Read the run of items from ``items[i]`` that this path takes (see the module
    docstring) and hand each to ``commit``; return the index of the first item it did
    not read (``i``: none). ``items`` are in offset order. ``before`` is called before
    the first item is verified (the caller verifies what it read before, so that the
    first damaged item is the one reported).

    Raises:
        ChecksumMismatchError: an item's bytes differ from its recorded checksum.
        CorruptCheckpointError: the file ended early.
    """
    run = _plan_run(file, items, i, resolve, checksum_of)
    if not run:
        return i
    _read_run(file, run)
    before()
    for n, item in enumerate(run):
        if item.checksum is not None:
            _verify(file, item)
        if bytes(item.head) != item.layout.head or not item.layout.tail_matches(bytes(item.tail)):
            return i + n  # not the layout expected: the usual path reads it again
        commit(item.read_item, item.target)
    return i + len(run)


# ``run(items, i, before, hand_over)``: see :func:`direct_runs`.
DirectRun = Callable[
    [Sequence[tuple[ReadItem, Any]], int, Callable[[], None], Callable[[LargeCheck], None]], int
]


def direct_runs(
    file: DataFile,
    planner: LoadPlanner,
    lock: AbstractContextManager[Any],
    checksums: Callable[[int], ItemChecksum | None] | None,
    block_bytes: int = 0,
    part_bytes: int = 0,
) -> DirectRun:
    """:func:`read_direct` for the items of ``file`` (a local file: :attr:`DataFile.fd`
    is set), into ``planner``'s destinations (resolved and committed under ``lock``);
    ``checksums(offset)`` is the file's item checksum lookup (None: not verified), in
    blocks of ``block_bytes``. Called as ``run(items, i, before, hand_over)``: where no
    run of small items starts at ``items[i]``, a large item of a known layout (all its
    tensor bytes or a contiguous range of them, :func:`.direct_large.choose_layout`) is
    read by :func:`.direct_large.read_large` (unless the reader cuts reads of that size
    into parts for several threads: :func:`.byte_ranges.part_count` of ``part_bytes``),
    and its pending check handed to ``hand_over`` (which verifies the item before it
    first).
    """
    hasher = hashing_thread(file.readers) if checksums is not None else None
    small = file.limits[0]
    pending: list[LargeCheck] = []  # the last large item's check (its hashes may be running)

    def checksum_of(offset: int, length: int) -> ItemChecksum | None | bool:
        if checksums is None:
            return None
        checksum = checksums(offset)
        if checksum is None or checksum.length != length:
            return False  # the usual path reports it
        return checksum

    def resolve(read_item: ReadItem) -> torch.Tensor:
        with lock:
            return planner.resolve_tensor(read_item)

    def commit(read_item: ReadItem, target: torch.Tensor) -> None:
        with lock:
            planner.commit_tensor(read_item, target)

    def large(read_item: ReadItem, offset: int, length: int, before: Callable[[], None]) -> bool:
        if read_item.type != LoadItemType.TENSOR or length <= small:
            return False
        layouts = known_layouts(length)
        if not layouts:
            return False
        target = resolve(read_item)
        if target.requires_grad:
            target = target.detach()
        checksum = checksum_of(offset, length)
        if checksum is False:
            return False
        assert checksum is None or isinstance(checksum, ItemChecksum)
        chosen = choose_layout(file, read_item, (offset, length), target, layouts)
        if chosen is None or part_count(chosen[1][1], part_bytes) >= 2:
            return False
        if pending and pending.pop().overlaps(target):
            before()  # one memory under two keys: its hashes must not see these bytes
        check = read_large(
            file, read_item, (offset, length), target, chosen, checksum, block_bytes, hasher
        )
        if check is None:
            return False
        commit(read_item, target)
        pending.append(check)
        return True

    def run(
        items: Sequence[tuple[ReadItem, Any]],
        i: int,
        before: Callable[[], None],
        hand_over: Callable[[LargeCheck], None],
    ) -> int:
        j = read_direct(file, items, i, resolve, checksum_of, commit, before)
        if j > i or not large(items[i][0], items[i][1].offset, items[i][1].length, before):
            return j
        hand_over(pending[-1])
        return i + 1

    return run


def window_after_miss(read_item: ReadItem, length: int) -> int | None:
    """The most bytes the usual path should read in one window from an item at which a
    direct run could not start: the item alone where the items after it may well go
    directly (an object among tensors; a tensor of a layout not learnt yet, which the
    usual path learns from it), else None, the file's window (a destination this path
    does not take: its neighbours are likely alike)."""
    if read_item.type != LoadItemType.TENSOR:
        return length
    shape = tuple(read_item.lengths)
    if not any(k.record.shape == shape for k in known_layouts(length)):
        return length  # not learnt yet (none of this length, or of another shape)
    return None


def _plan_run(
    file: DataFile,
    items: Sequence[tuple[ReadItem, Any]],
    i: int,
    resolve: Resolve,
    checksum_of: ChecksumOf,
) -> list[_Direct]:
    small, max_gap, window = file.limits
    run: list[_Direct] = []
    end = start = items[i][1].offset
    starts: list[int] = []  # the destinations' memory (see .overlaps)
    lengths: list[int] = []
    for read_item, info in items[i:]:
        offset, length = info.offset, info.length
        if (
            read_item.type != LoadItemType.TENSOR
            or length > small
            or offset < end
            or offset - end > max_gap
            or offset + length - start > window
        ):
            break
        layouts = known_layouts(length)
        if not layouts:
            break
        target = resolve(read_item)
        if target.requires_grad:
            target = target.detach()
        layout = next((k for k in layouts if fits(read_item, k, target)), None)
        if layout is None:
            break
        checksum = checksum_of(offset, length)
        if checksum is False:
            break
        assert checksum is None or isinstance(checksum, ItemChecksum)
        if checksum is not None and len(checksum.blocks) != 1:
            break  # several blocks: the usual path checks them
        head, tail = bytearray(len(layout.head)), bytearray(layout.tail_length)
        run.append(
            _Direct(
                read_item, offset, length, layout, target, checksum, head, buffer_of(target), tail
            )
        )
        starts.append(target.data_ptr())
        lengths.append(layout.record.data_length)
        end = offset + length
    # A destination that overlaps an earlier one (one tensor requested under two keys)
    # ends the run: the later read would change the bytes the earlier item's checksum
    # is computed on.
    shared = overlapping(starts, lengths)
    return run[: shared[0]] if shared else run


def _read_run(file: DataFile, run: list[_Direct]) -> None:
    """Fill each item's buffers, a ``preadv`` per :data:`IOV_MAX` buffers."""
    assert file.fd is not None
    first = run[0]

    def short(at: int) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{file.path}: short read at byte {at} while reading item "
            f"{first.read_item.storage_index.fqn!r} and the {len(run) - 1} after it "
            f"(the file may have been truncated)"
        )

    buffers: list[Any] = []
    start = pos = first.offset
    for item in run:
        if len(buffers) + 4 > IOV_MAX:
            read_all_at(file.fd, buffers, start, pos - start, short)
            buffers, start = [], pos
        if item.offset > pos:  # a gap: bytes of no item read here
            buffers.append(bytearray(item.offset - pos))
        buffers += (item.head, item.data, item.tail)
        pos = item.offset + item.length
    read_all_at(file.fd, buffers, start, pos - start, short)


def _verify(file: DataFile, item: _Direct) -> None:
    assert item.checksum is not None
    found = crc(item.tail, crc(item.data, crc(item.head)))
    expected = item.checksum.blocks[0]  # one block: see _plan_run
    if found != expected:
        raise mismatch_error(
            file.path, item.offset, item.length, item.read_item, 0, expected, found
        )


__all__ = ["DirectRun", "direct_runs", "read_direct", "window_after_miss"]
