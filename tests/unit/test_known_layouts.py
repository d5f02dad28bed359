"""The reader's memory of archive layouts it recognized (``item_reader._KNOWN``).

An item whose length and bytes before the tensor data equal those of a layout seen
before is described from memory, after its tail is compared. These tests check that
remembering never changes an answer: a damaged or different archive gets exactly the
answer it gets from a reader that remembers nothing.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dist_checkpointing.engine.storage import item_reader
from dist_checkpointing.engine.storage.item_reader import TensorRecord, _match_template


def _archive(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 100, shape, generator=g).to(dtype)
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _match(data: bytes) -> TensorRecord | None:
    return _match_template(lambda o, n: memoryview(data)[o : o + n], len(data))


def _cold(data: bytes) -> TensorRecord | None:
    saved = dict(item_reader._KNOWN)
    item_reader._KNOWN.clear()
    try:
        return _match(data)
    finally:
        item_reader._KNOWN.clear()
        item_reader._KNOWN.update(saved)


@pytest.fixture(autouse=True)
def _fresh_memory() -> Iterator[None]:
    item_reader._KNOWN.clear()
    yield
    item_reader._KNOWN.clear()


_SHAPES = [(4096,), (64, 64), (16, 256), (7,), (3, 5)]
_DTYPES = [torch.float32, torch.int32, torch.bfloat16, torch.int64]


@settings(max_examples=300, deadline=None)
@given(
    shape=st.sampled_from(_SHAPES),
    dtype=st.sampled_from(_DTYPES),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
)
@example(shape=(4096,), dtype=torch.float32, where=0.001, bit=0)  # data.pkl
@example(shape=(4096,), dtype=torch.float32, where=0.999, bit=3)  # the end records
def test_a_remembered_layout_answers_as_a_fresh_reader(
    shape: tuple[int, ...], dtype: torch.dtype, where: float, bit: int
) -> None:
    data = _archive(shape, dtype)
    first = _match(data)
    assert first is not None and first.shape == shape and first.dtype == dtype
    assert _match(data) == first  # from memory
    damaged = bytearray(data)
    damaged[int(where * len(data))] ^= 1 << bit
    assert _match(bytes(damaged)) == _cold(bytes(damaged))


def test_tensors_of_one_length_and_another_shape_keep_their_own_records() -> None:
    flat, square = _archive((4096,), torch.float32), _archive((64, 64), torch.float32)
    other = _archive((4096,), torch.int32)
    assert len(flat) == len(square) == len(other)
    for _ in range(2):  # the second round from memory
        records = [_match(a) for a in (flat, square, other)]
        assert [(r.shape, r.dtype) for r in records if r is not None] == [
            ((4096,), torch.float32),
            ((64, 64), torch.float32),
            ((4096,), torch.int32),
        ]
    assert len(item_reader._KNOWN[len(flat)]) == 3


def test_a_changed_tail_is_not_served_from_memory() -> None:
    data = _archive((4096,), torch.float32)
    assert _match(data) is not None
    changed = bytearray(data)
    changed[-30] ^= 0x40  # in the zip end records
    assert _match(bytes(changed)) is None
    # The crcs and the serialization id differ for every tensor: not compared.
    assert _match(_archive((4096,), torch.float32, seed=1)) is not None


def test_the_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(item_reader, "_KNOWN_MAX", 3)
    for n in range(1, 8):
        assert _match(_archive((n,), torch.float32)) is not None
        assert sum(len(v) for v in item_reader._KNOWN.values()) <= 3
