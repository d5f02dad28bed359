"""Large ``torch_dist`` tensor items start at a multiple of 64 bytes in their file
(``item_writer.item_padding``), so that their tensor bytes are 64-byte aligned; the
zero bytes between items change nothing a reader sees: our load, plain DCP's load,
``torch.load`` of each item and ``verify`` all read the same values."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.engine.storage.item_reader import parse_tensor_item
from dist_checkpointing.engine.storage.item_writer import (
    ALIGNED_ITEM_BYTES,
    ITEM_ALIGN,
    item_padding,
)
from dist_checkpointing.engine.storage.reader import FileSystemReader


def test_padding_only_before_large_items() -> None:
    assert item_padding(1, ALIGNED_ITEM_BYTES - 1) == 0
    assert item_padding(0, ALIGNED_ITEM_BYTES) == 0
    for offset in (1, 63, 64, 65, 1577, 10**9 + 7):
        pad = item_padding(offset, ALIGNED_ITEM_BYTES)
        assert 0 <= pad < ITEM_ALIGN and (offset + pad) % ITEM_ALIGN == 0


def _state() -> dict[str, torch.Tensor]:
    """Odd sizes: every item's length leaves the next one unaligned when packed."""
    gen = torch.Generator().manual_seed(7)
    out = {}
    for i, numel in enumerate([1, 300, 16385, 70001, 300, 131071, 5, 65536, 99999]):
        dtype = (torch.float32, torch.bfloat16, torch.float64)[i % 3]
        out[f"t{i}"] = torch.randn(numel, generator=gen).to(dtype)
    return out


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    sd: dict[str, object] = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in _state().items()}
    sd["obj"] = ShardedObject("obj", {"step": 3}, (1,), (0,))
    dc.save(sd, tmp_path)
    return tmp_path


def test_large_items_and_their_tensor_bytes_are_aligned(saved: Path) -> None:
    metadata = FileSystemReader(str(saved)).read_metadata()
    state = _state()
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    aligned = 0
    for name, items in by_file.items():
        data = (saved / name).read_bytes()
        items.sort()
        end = 0
        for offset, length, key in items:
            gap = data[end:offset]
            assert gap == bytes(len(gap)) and len(gap) < ITEM_ALIGN, (name, key)
            end = offset + length
            if key not in state or state[key].nbytes < ALIGNED_ITEM_BYTES:
                continue
            view = memoryview(data)[offset : offset + length]
            record = parse_tensor_item(lambda at, n, v=view: v[at : at + n], length, False)
            assert offset % ITEM_ALIGN == 0 and (offset + record.data_offset) % ITEM_ALIGN == 0
            aligned += 1
            stored = torch.load(io.BytesIO(bytes(view)), weights_only=True)
            assert torch.equal(stored, state[key])
        assert end == len(data)  # nothing after the last item
    assert aligned == sum(t.nbytes >= ALIGNED_ITEM_BYTES for t in state.values())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_every_reader_reads_the_same_values(saved: Path) -> None:
    state = _state()
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(t)) for k, t in state.items()}
    ours = dc.load(request, saved)
    assert isinstance(ours, dict)
    plain = {k: torch.full_like(t, float("nan")) for k, t in state.items()}
    torch_dcp.load(plain, checkpoint_id=str(saved), no_dist=True)
    for key, t in state.items():
        assert torch.equal(ours[key], t) and torch.equal(plain[key], t), key
    assert dc.verify(saved).ok
