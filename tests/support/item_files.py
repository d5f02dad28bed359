"""Files of ``torch.save`` items for the tests of the direct read paths
(:mod:`dist_checkpointing.engine.storage.direct_items` and ``direct_large``): the items,
their layouts learnt as a first load learns them, one byte flipped; and the outcome of
loads of damaged copies of a checkpoint with and without those paths."""

from __future__ import annotations

import io
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.storage import direct_items, item_reader, reader


def saved_item(t: torch.Tensor) -> bytes:
    """``t`` as ``torch.save`` writes it (one ``torch_dist`` tensor item)."""
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def region_request(
    key: str, shape: Sequence[int], at: Sequence[int], lengths: Sequence[int]
) -> ReadItem:
    """The read of the region of the stored tensor ``key`` (of ``shape``, one chunk)
    that starts at ``at`` and spans ``lengths``, into a destination of its own."""
    zeros = torch.Size([0] * len(shape))
    index = MetadataIndex(key, zeros)
    return ReadItem(LoadItemType.TENSOR, index, zeros, index, torch.Size(at), torch.Size(lengths))


def whole_request(key: str, shape: Sequence[int]) -> ReadItem:
    """The read of the whole stored tensor ``key`` of ``shape``."""
    return region_request(key, shape, [0] * len(shape), shape)


class ItemFile(NamedTuple):
    """A data file of items, as written by :func:`item_file`."""

    path: Path
    content: bytearray  # the file's bytes (the flipped one included)
    spans: list[tuple[int, int]]  # (offset, length) of each item
    blobs: list[bytes]  # each item's intact bytes
    flipped: int | None  # the file offset of the flipped byte


def item_file(
    path: Path, tensors: Sequence[torch.Tensor], gaps: Sequence[int], flip: float | None
) -> ItemFile:
    """Write ``tensors`` as items to ``path``, ``gaps[i]`` zero bytes before item ``i``,
    with the byte at fraction ``flip`` of the file flipped (None: intact), after
    learning each item's layout (as the first load of a process does)."""
    blobs = [saved_item(t) for t in tensors]
    for blob in blobs:
        assert item_reader._match_template(lambda o, n, b=blob: b[o : o + n], len(blob))
    content = bytearray()
    spans = []
    for blob, gap in zip(blobs, gaps):
        content += bytes(gap)
        spans.append((len(content), len(blob)))
        content += blob
    flipped = None if flip is None else int(flip * len(content))
    if flipped is not None:
        content[flipped] ^= 0x20
    path.write_bytes(bytes(content))
    return ItemFile(path, content, spans, blobs, flipped)


def in_records(layout: item_reader.KnownLayout, length: int, rel: int) -> bool:
    """Whether byte ``rel`` of an item of ``length`` bytes and ``layout`` is one every
    item of that layout has: its records before the tensor bytes, or after them except
    the crcs and serialization id."""
    if rel < len(layout.head):
        return True
    rel -= length - layout.tail_length
    return any(start <= rel < stop for start, stop, _ in layout.tail_segments)


@pytest.fixture(autouse=True)
def fresh_layouts() -> Any:
    """No layout learnt before the test, none kept after it (import it into a test
    module to apply it there)."""
    item_reader._KNOWN.clear()
    yield
    item_reader._KNOWN.clear()


def load_blocks_whole(
    root: str, split_dim: int, count: int, save: Callable[..., None], counted: list[Any]
) -> int:
    """``count`` tensors saved by 2 ranks as row (or column) blocks with ``save(state,
    root)``, each loaded whole by each rank, twice, bit-exactly: rows are contiguous
    views of the destination, columns are not. Returns what ``counted`` (a direct path's
    count, patched in by the caller) grew by."""
    rank = dist.get_rank()
    full = {
        f"w{i}": torch.arange(64 * 48, dtype=torch.float32).view(64, 48) + i for i in range(count)
    }
    state = {
        k: ShardedTensor.from_rank_offsets(
            k, v.chunk(2, split_dim)[rank].clone(), (split_dim, rank, 2)
        )
        for k, v in full.items()
    }
    save(state, root)
    before = sum(counted)
    for _ in range(2):
        request = {
            k: ShardedTensor.from_rank_offsets(k, torch.zeros(64, 48), replica_id=rank)
            for k in full
        }
        loaded = dc.load(request, root)
        for k, v in full.items():
            assert torch.equal(loaded[k], v), k
    return sum(counted) - before


def load_outcome(request: dict[str, Any], root: str, verify: bool) -> str:
    """The outcome of loading ``request`` from ``root``: the error, or the sum of the
    bytes of each tensor loaded (in key order)."""
    try:
        loaded = dc.load(request, root, verify_checksums=verify)
    except Exception as err:  # noqa: BLE001 - the outcome compared
        return f"{type(err).__name__}: {err}"
    return "loaded " + " ".join(
        str(int(v.view(torch.uint8).to(torch.int64).sum()))
        for _, v in sorted(loaded.items())
        if isinstance(v, torch.Tensor)
    )


def count_large() -> list[bool]:
    """From now on, in this process, one entry per large item :mod:`.direct_large` is
    asked to read: whether it read it (:func:`.direct_items.read_large` wrapped)."""
    taken: list[bool] = []
    original = direct_items.read_large

    def counting(*args: Any) -> Any:
        check = original(*args)
        taken.append(check is not None)
        return check

    direct_items.read_large = counting  # type: ignore[assignment]
    return taken


def _never(*args: Any) -> Any:
    """A ``direct_runs`` that reads nothing: every item goes the usual way."""
    return lambda items, i, before, hand_over: i


def damage_outcomes(
    saved: Path, root: Path, count: int, outcome: Callable[[str, bool], str], counted: list[Any]
) -> tuple[dict[str, tuple[str, str]], int]:
    """For ``count`` bytes spread over the data file of checkpoint ``saved`` (one
    ``.distcp``), each flipped in a copy under ``root``: ``outcome(copy, verify)`` of a
    load with the direct paths and without (``reader.direct_runs`` reading nothing), with
    checksums verified and not. ``counted``: the direct path's count of items read
    (patched in by the caller); returns the outcomes by byte and what ``counted`` grew
    by in the loads without the direct paths (0 expected)."""
    (name,) = [p.name for p in saved.iterdir() if p.suffix == ".distcp"]
    size = (saved / name).stat().st_size
    usual = reader.direct_runs
    plain_counted = 0
    results: dict[str, tuple[str, str]] = {}
    for k, at in enumerate(range(37, size, size // count)):
        copy = root / f"c{k}"
        shutil.copytree(saved, copy)
        data = bytearray((copy / name).read_bytes())
        data[at] ^= 0x10
        (copy / name).write_bytes(bytes(data))
        for verify in (True, False):
            direct = outcome(str(copy), verify)
            before = sum(counted)
            reader.direct_runs = _never
            try:
                plain = outcome(str(copy), verify)
            finally:
                reader.direct_runs = usual
            plain_counted += sum(counted) - before
            results[f"{at} verify={verify}"] = (direct, plain)
    return results, plain_counted
