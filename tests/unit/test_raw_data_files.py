"""The ``raw_bytes`` writer of one data file (``engine/raw/data_files``): whatever the
items (bytes or tensors, empty, small and batched, or large and written in pieces), each
lands at its offset with zero bytes between, its CRC32C blocks are those of its bytes,
no write call carries much more than ``WRITE_CALL_BYTES``, and the file's sha256 (computed as the bytes go out, for the integrity manifest) is that
of the file as written: to a local file (positional writes) and to a stream."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.raw import data_files
from dist_checkpointing.engine.raw.writer import RankWrite, StageRankWrite, plan_rank
from dist_checkpointing.engine.storage.checksums import block_crcs

item = st.tuples(st.integers(0, 3000), st.booleans(), st.integers(0, 100))  # size, tensor, gap


def _items(spec: list[tuple[int, bool, int]]) -> tuple[list[tuple[int, int, Any]], bytes]:
    """``(offset, size, data)`` items at 64-byte offsets after the gaps, and the file."""
    gen = torch.Generator().manual_seed(len(spec))
    items, expected, pos = [], bytearray(), 0
    for size, as_tensor, gap in spec:
        offset = -(-(pos + gap) // 64) * 64
        t = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        raw = t.numpy().tobytes()
        items.append((offset, size, t if as_tensor else raw))
        expected += bytes(offset - pos) + raw
        pos = offset + size
    return items, bytes(expected)


def _expected_crcs(items: list[tuple[int, int, Any]], block: int) -> list[int]:
    out: list[int] = []
    for _, _, data in items:
        raw = data.numpy().tobytes() if isinstance(data, torch.Tensor) else data
        out += block_crcs(raw, block) if block else []
    return out


class _Recording(data_files._Out):
    """Records the bytes of each write call."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls: list[int] = []

    def put(self, buffers: list[Any], offset: int, nbytes: int = 0) -> None:
        self.calls.append(sum(memoryview(b).nbytes for b in buffers))
        super().put(buffers, offset, nbytes)


@settings(max_examples=60, deadline=None)
@given(
    spec=st.lists(item, max_size=10),
    piece=st.sampled_from([512, 1500, 8 << 20]),
    block=st.sampled_from([0, 256, 4096]),
    to_file=st.booleans(),
    plain=st.booleans(),
)
# A batch just under the piece, then a gap: the call carries the piece plus the gap.
@example(spec=[(1455, False, 0), (0, False, 18)], piece=1500, block=256, to_file=True, plain=False)
def test_every_byte_lands_at_its_offset_and_the_file_digest_is_of_the_file(
    tmp_path_factory: pytest.TempPathFactory,
    spec: list[tuple[int, bool, int]],
    piece: int,
    block: int,
    to_file: bool,
    plain: bool,
) -> None:
    items, expected = _items(spec)
    path = tmp_path_factory.mktemp("raw") / "f"
    stream: Any = open(path, "w+b", buffering=0) if to_file else io.BytesIO()  # noqa: SIM115
    out = _Recording(stream, None, hashlib.sha256(), piece)  # larger: in pieces
    crcs: list[int] = []
    try:
        data_files._write_items(out, items, block, crcs, None, plain)
    finally:
        if to_file:
            stream.close()
    written = path.read_bytes() if to_file else stream.getvalue()
    assert written == expected
    assert out.sha.hexdigest() == hashlib.sha256(written).hexdigest()
    assert crcs == _expected_crcs(items, block)
    # A large item goes in pieces of whole checksum blocks (at most ``max(block, piece)``),
    # a batch of small ones in at most ``piece`` bytes plus the gap before its next item
    # (under 64 bytes of alignment after the spec's gap of up to 100).
    assert max(out.calls, default=0) <= max(block, piece) + 100 + 63


@pytest.mark.parametrize("digest", [True, False])
def test_write_rank_reports_each_files_digest_when_asked(tmp_path: Path, digest: bool) -> None:
    files = [_items([(5000, True, 0), (10, False, 3)]), _items([(0, True, 0), (70, True, 1)])]
    wr = RankWrite(str(tmp_path), ["a", "b"], [f[0] for f in files], 4096, sync=True, digest=digest)
    got = data_files.write_rank(wr)
    for name, (items, expected), written in zip(["a", "b"], files, got):
        assert (tmp_path / name).read_bytes() == expected
        assert list(written.crcs) == _expected_crcs(items, 4096)
        assert written.sha256 == (hashlib.sha256(expected).hexdigest() if digest else None)


@pytest.mark.parametrize(
    "data", [torch.zeros(1000, dtype=torch.float16), torch.zeros(10), torch.zeros(1001)]
)
def test_data_replaced_by_a_smaller_or_other_dtype_tensor_is_refused_by_key(
    tmp_path: Path, data: torch.Tensor
) -> None:
    """The writer writes a tensor's declared bytes straight from its memory: data that
    no longer matches its ShardedTensor (replaced after construction) must be refused
    at planning, never read past its end."""
    sh = ShardedTensor.from_rank_offsets("layer.weight", torch.zeros(1000))
    sh.data = data
    with pytest.raises(ValueError, match=r"'layer.weight'.*does not match its dtype"):
        plan_rank([sh], str(tmp_path), 0, 2, 64, 4096)


def test_the_plan_lists_only_the_tensors_to_copy_or_stream(tmp_path: Path) -> None:
    """Contiguous host tensors are written as they are; the plan names the others (here
    a transposed view, in the second file) so later steps need not look at every item."""
    leaves = [
        ShardedTensor.from_rank_offsets("a", torch.zeros(4, 3)),
        ShardedTensor.from_rank_offsets("b", torch.zeros(4, 3)),
        ShardedTensor.from_rank_offsets("c", torch.zeros(3, 4).t()),
        ShardedTensor.from_rank_offsets("d", torch.zeros(4, 3)),
    ]
    wr, _ = plan_rank(leaves, str(tmp_path), 0, 2, 64, 0)
    assert [len(items) for items in wr.items] == [2, 2]
    assert wr.special == [(1, 0)]
    slots = StageRankWrite(wr, deferred=True).host_copies()
    assert [(s.container is wr.items[1], s.index) for s in slots] == [(True, 0)]
    assert [s.index for s in StageRankWrite(wr).slots() if s.required] == [0]
