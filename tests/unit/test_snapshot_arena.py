"""The snapshot arena of the persistent async caller, on CPU: staging into reused
segments, and requests that carry each segment once."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dist_checkpointing.engine.async_save.snapshot import (
    ArenaPickler,
    SnapshotArena,
    mapped_segments,
)
from dist_checkpointing.engine.storage.resolve import filesystem_for
from dist_checkpointing.engine.storage.write_workers import (
    StageBuckets,
    WriteBucket,
    write_bucket_file,
)


def _bucket(path: str, tensors: dict[str, torch.Tensor]) -> WriteBucket:
    bucket = WriteBucket(path, path.rsplit("/", 1)[-1])
    for key, t in tensors.items():
        item = WriteItem(MetadataIndex(key), WriteItemType.TENSOR)
        bucket.tensor_items.append((item, t))
    return bucket


def _state(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {
        "a": torch.arange(1000, dtype=torch.float32) * scale,
        "b": torch.ones(3, 5, dtype=torch.bfloat16) * scale,
        "c": torch.arange(7, dtype=torch.int64),
    }


def test_staged_tensors_are_snapshots_in_one_segment() -> None:
    arena = SnapshotArena(pinned=False)
    state = _state()
    bucket = _bucket("/x/f", state)
    key = arena.stage(StageBuckets([bucket]), copy_cpu=True)
    assert key is not None and len(arena.segments) == 1
    for (_, staged), (name, original) in zip(bucket.tensor_items, state.items()):
        assert arena.locate(staged) is not None, name
        assert torch.equal(staged, original)
        original.add_(1)  # training goes on: the snapshot keeps the old values
        assert not torch.equal(staged, original)
    arena.close()


def test_cpu_tensors_are_left_alone_without_copy_cpu() -> None:
    arena = SnapshotArena(pinned=False)
    state = _state()
    bucket = _bucket("/x/f", state)
    assert arena.stage(StageBuckets([bucket]), copy_cpu=False) is None
    assert all(t is state[k] for (_, t), k in zip(bucket.tensor_items, state))
    assert not arena.segments


def test_a_released_segment_is_reused_and_a_busy_one_is_not() -> None:
    arena = SnapshotArena(pinned=False)
    first = arena.stage(StageBuckets([_bucket("/x/f", _state())]), copy_cpu=True)
    second = arena.stage(
        StageBuckets([_bucket("/x/f", _state())]), copy_cpu=True
    )  # first still busy
    assert first != second and arena.stats["allocated"] == 2
    arena.release(first)
    arena.release(second)
    for _ in range(3):
        arena.release(arena.stage(StageBuckets([_bucket("/x/f", _state())]), copy_cpu=True))
    assert arena.stats["allocated"] == 2 and arena.stats["reused"] == 3
    bigger = {"big": torch.zeros(10_000)}
    arena.stage(StageBuckets([_bucket("/x/f", bigger)]), copy_cpu=True)  # no free one fits: both go
    assert arena.stats["allocated"] == 3 and len(arena.segments) == 1
    assert set(arena.retired) == {first, second}
    arena.close()


def test_a_request_carries_each_segment_once() -> None:
    arena = SnapshotArena(pinned=False)
    sent: set[str] = set()
    sizes = []
    for scale in (1.0, 2.0, 3.0):
        bucket = _bucket("/x/f", _state(scale))
        key = arena.stage(StageBuckets([bucket]), copy_cpu=True)
        payload, delivered = ArenaPickler.request_bytes(("fn", [bucket]), arena, sent, True)
        delivered()
        assert key in sent
        sizes.append(len(payload))
        _, (received,) = pickle.loads(payload)  # what the worker does
        for (_, got), (_, want) in zip(received.tensor_items, _state(scale).items()):
            assert torch.equal(got, want)
        assert key in mapped_segments()
        arena.release(key)
    assert sizes[1] == sizes[2]  # later requests: offsets only
    assert arena.stats["allocated"] == 1
    assert not arena.placed  # the views' places are forgotten once pickled
    arena.close()


def test_views_found_by_place_or_by_search_pickle_alike() -> None:
    """The pickler finds a view stage() made by its id; forgotten, it finds it by
    searching the segments: the request's bytes are the same either way."""
    arena = SnapshotArena(pinned=False)
    bucket = _bucket("/x/f", _state())
    key = arena.stage(StageBuckets([bucket]), copy_cpu=True)
    assert key is not None and len(arena.placed) == len(bucket.tensor_items)
    sent = {key}  # the segment itself went before: both requests carry offsets only
    found, _ = ArenaPickler.request_bytes(("fn", [bucket]), arena, sent, True)
    assert not arena.placed
    searched, _ = ArenaPickler.request_bytes(("fn", [bucket]), arena, sent, True)
    assert found == searched
    arena.close()


def test_other_cpu_tensors_are_still_snapshotted() -> None:
    arena = SnapshotArena(pinned=False)
    live = torch.zeros(10)
    payload, _ = ArenaPickler.request_bytes(live, arena, set(), True)
    live.fill_(5)
    assert torch.equal(pickle.loads(payload), torch.zeros(10))


def test_a_staged_bucket_is_written_with_only_its_own_bytes(tmp_path: Path) -> None:
    """Views of a segment are written like compact tensors, not the whole segment."""
    state = _state()
    staged = _bucket(str(tmp_path / "staged"), dict(state))
    plain = _bucket(str(tmp_path / "plain"), {k: v.clone() for k, v in state.items()})
    arena = SnapshotArena(pinned=False)
    arena.stage(StageBuckets([staged]), copy_cpu=True)
    fs = filesystem_for(str(tmp_path))
    write_bucket_file(staged, fs, sync_files=False)
    write_bucket_file(plain, fs, sync_files=False)
    assert (tmp_path / "staged").read_bytes() == (tmp_path / "plain").read_bytes()
    arena.close()


_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.bool,
    torch.int64,
    torch.complex64,
]


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of any dtype and shape (0-d, empty, size-1 axes), contiguous or a
    transposed, stepped or expanded view of a larger one."""
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    base = (torch.arange(max(1, math.prod(shape)) * 4) % 7).to(dtype)
    t = base[: math.prod(shape)].reshape(shape)
    kind = draw(st.sampled_from(["plain", "transposed", "stepped", "expanded", "odd-stride"]))
    if kind == "transposed" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif kind == "stepped" and t.dim() >= 1:
        t = base[: 2 * shape[0] * math.prod(shape[1:])].reshape([2 * shape[0], *shape[1:]])[::2]
    elif kind == "expanded" and t.dim() >= 1 and shape[0] == 1:
        t = t.expand(3, *shape[1:])
    elif kind == "odd-stride":  # contiguous, with a stride of 9 on a size-1 axis
        t = t.unsqueeze(0).as_strided((1, *t.shape), (9, *t.stride()))
    return t


@settings(max_examples=60, deadline=None)
@given(tensors=st.lists(_tensors(), min_size=1, max_size=8))
def test_staged_views_equal_their_sources_and_share_no_bytes(tensors: list[torch.Tensor]) -> None:
    """Each staged tensor is a contiguous copy of its source (dtype, shape, values) in the
    segment, at its own bytes."""
    arena = SnapshotArena(pinned=False)
    state = {f"t{i}": t for i, t in enumerate(tensors)}
    bucket = _bucket("/x/f", state)
    assert arena.stage(StageBuckets([bucket]), copy_cpu=True) is not None
    spans = []
    for (_, staged), source in zip(bucket.tensor_items, tensors):
        assert staged.dtype == source.dtype and staged.shape == source.shape
        assert staged.is_contiguous() and torch.equal(staged, source)
        if staged.numel() == 0:  # no bytes (torch gives it no address in the segment)
            continue
        found = arena.locate(staged)
        assert found is not None
        segment, offset = found
        assert offset >= 0 and offset + staged.nbytes <= segment.nbytes
        spans.append((offset, offset + staged.nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    arena.close()
