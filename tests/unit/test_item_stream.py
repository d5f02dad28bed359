"""The stream ``torch_dist`` data files are written through (``engine/storage/item_stream``).

On a local file the bytes are gathered and go out in positional calls of at most
``WRITE_CALL_BYTES``; elsewhere they go to the stream in order. Either way, whatever the
mix of writes (immutable bytes, buffers the caller reuses at once, views of a tensor's
memory given as parts), every byte lands in order, each item's CRC32C blocks and the
file's sha256 are those of the bytes, ``tell`` counts them, and a tensor item written
through it is byte for byte ``torch.save``'s."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing.engine.storage import item_writer
from dist_checkpointing.engine.storage.checksums import block_crcs
from dist_checkpointing.engine.storage.item_stream import ChecksumStream
from dist_checkpointing.engine.storage.staging_pool import TensorItemWriter

# (kind, size, new item?): kinds are how the caller hands its bytes over
write = st.tuples(
    st.sampled_from(["bytes", "reused", "parts"]), st.integers(0, 9000), st.booleans()
)


class _Recording(ChecksumStream):
    """Records the bytes of each gathered call."""

    calls: list[int]

    def _drain(self) -> None:
        if self._pending_bytes:
            self.calls.append(self._pending_bytes)
        super()._drain()


def _run(stream: Any, ops: list[tuple[str, int, bool]], block: int) -> tuple[bytes, list[bytes]]:
    """Perform ``ops`` on ``stream``; return the bytes written and each item's bytes."""
    gen = torch.Generator().manual_seed(len(ops))
    reused = bytearray(9000)
    expected, items = bytearray(), [bytearray()]
    stream.begin_item()
    for kind, size, new_item in ops:
        if new_item and items[-1]:
            stream.end_item()
            stream.begin_item()
            items.append(bytearray())
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        raw = data.numpy().tobytes()
        if kind == "bytes":
            assert stream.write(raw) == size
        elif kind == "reused":  # the caller's buffer changes right after the call
            reused[:size] = raw
            assert stream.write(memoryview(reused)[:size]) == size
            reused[:size] = bytes(size)
        else:  # a zip head, a view of a tensor's memory, a tail
            view = data.numpy().data if size else b""
            assert stream.write_parts((b"head", view, b"tail"), data) == size + 8
            raw = b"head" + raw + b"tail"
            del data, view  # held by the stream until it flushes
        expected += raw
        items[-1] += raw
        assert stream.tell() == len(expected)
    return bytes(expected), [bytes(i) for i in items]


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(write, max_size=12),
    piece=st.sampled_from([4096, 8192, 1 << 20]),
    block=st.sampled_from([256, 1 << 20]),
    local=st.booleans(),
)
def test_every_byte_in_order_with_its_checksums_whatever_the_writes(
    tmp_path_factory: pytest.TempPathFactory,
    ops: list[tuple[str, int, bool]],
    piece: int,
    block: int,
    local: bool,
) -> None:
    path = tmp_path_factory.mktemp("s") / "f"
    raw: Any = open(path, "wb") if local else io.BytesIO()  # noqa: SIM115
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIST_CKPT_WRITE_CALL_BYTES", str(piece))
        stream = _Recording(raw, block, None, True)
    stream.calls = []
    expected, items = _run(stream, ops, block)
    last = stream.end_item()
    stream.flush()
    written = raw.getvalue() if not local else None
    raw.close()
    if local:
        written = path.read_bytes()
        assert stream.calls and max(stream.calls) <= piece or not expected
        assert sum(stream.calls) == len(expected)
    assert written == expected
    assert stream.file_digest() == hashlib.sha256(expected).hexdigest()
    assert last is not None and last.length == len(items[-1])
    assert list(last.blocks) == (block_crcs(items[-1], block) if items[-1] else last.blocks)


def test_a_buffer_reused_after_write_keeps_what_was_written(tmp_path: Path) -> None:
    # Small ones are copied, large ones written before the call returns.
    with open(tmp_path / "f", "wb") as raw:
        stream = ChecksumStream(raw, 1 << 20)
        expected = b""
        for size in (10, 70_000, 3 << 20):
            buf = bytearray(b"x" * size)
            stream.write(memoryview(buf))
            buf[:] = b"y" * size
            expected += b"x" * size
        stream.flush()
    assert (tmp_path / "f").read_bytes() == expected


def test_the_wrapped_stream_sees_every_byte_before_it_is_asked(tmp_path: Path) -> None:
    with open(tmp_path / "f", "wb") as raw:
        stream = ChecksumStream(raw, 1 << 20)
        stream.write(b"abc")
        assert (tmp_path / "f").read_bytes() == b""  # gathered ...
        stream.fileno()  # ... and written before anyone uses the file
        assert (tmp_path / "f").read_bytes() == b"abc"


# (dtype, elements, transposed): built in the test, not at import (a module imported into
# the test harness's fork server must not start torch's thread pool there: its forked
# ranks would hang in their first parallel operation)
_TENSORS = [
    (torch.float32, 0, False),
    (torch.bfloat16, 5, False),
    (torch.float32, 6144, False),  # 24 KiB
    (torch.float32, 16384, False),  # 64 KiB
    (torch.float32, 1 << 18, False),  # 1 MiB: the largest gathered whole
    (torch.float32, (1 << 18) + 1, False),  # in pieces
    (torch.int64, 12, True),  # not contiguous: torch.save
    (torch.bool, 1, False),
]


@pytest.mark.parametrize("local", [True, False])
@pytest.mark.parametrize("spec", _TENSORS, ids=lambda s: f"{s[0]}x{s[1]}{'T' if s[2] else ''}")
def test_tensor_items_through_it_are_torch_save_byte_for_byte(
    tmp_path: Path, spec: tuple[torch.dtype, int, bool], local: bool
) -> None:
    dtype, numel, transposed = spec
    tensor = (torch.arange(numel) % 7).to(dtype)
    if transposed:
        tensor = tensor.reshape(3, 4).t()
    path = tmp_path / "f"
    raw: Any = open(path, "wb") if local else io.BytesIO()  # noqa: SIM115
    stream = ChecksumStream(raw, 4096)
    sizes = []
    for t in (tensor, torch.ones(3), tensor):  # after other bytes, and twice
        stream.begin_item()
        sizes.append(item_writer.write_tensor(stream, t))
        stream.end_item()
    stream.flush()
    written = path.read_bytes() if local else raw.getvalue()
    raw.close()
    expected = []
    for t in (tensor, torch.ones(3), tensor):
        buf = io.BytesIO()
        torch.save(t, buf)
        expected.append(buf.getvalue())
    assert sizes == [len(e) for e in expected]
    assert written == b"".join(expected)


def test_views_of_a_larger_buffer_are_written_as_copies_of_themselves(tmp_path: Path) -> None:
    # As the snapshot arena of an async save hands them over: views of one buffer.
    arena = (torch.arange(1 << 19) % 251).to(torch.uint8)
    views = [
        arena[64:80].view(torch.float32),  # 4 floats
        arena[4096 : 4096 + 24576].view(torch.float32).reshape(6, 1024),  # 24 KiB
        arena[65536 : 65536 + 131072].view(torch.bfloat16),  # 128 KiB
        arena[1 << 18 :].view(torch.float32),  # 256 KiB up to the end of the buffer
    ]
    items = [(None, v) for v in views]
    with open(tmp_path / "f", "wb") as raw:
        stream = ChecksumStream(raw, 4096)
        writer = TensorItemWriter(items)
        sizes = [writer.write(stream, i, v) for i, v in enumerate(views)]
        writer.close()
        stream.flush()
    expected = []
    for v in views:
        buf = io.BytesIO()
        torch.save(v.clone(), buf)
        expected.append(buf.getvalue())
    assert sizes == [len(e) for e in expected]
    assert (tmp_path / "f").read_bytes() == b"".join(expected)


def test_a_failing_gathered_write_raises(tmp_path: Path) -> None:
    # The gathered bytes go out later than write() returns: a failure must still surface
    # (here the descriptor is gone, as after a device error), never be dropped.
    raw = open(tmp_path / "f", "wb")  # noqa: SIM115
    stream = ChecksumStream(raw, 4096)
    stream.write(b"x" * 100)
    os.close(raw.fileno())
    with pytest.raises(OSError):
        stream.flush()
    with pytest.raises(OSError):
        raw.close()


def test_a_pipe_or_a_file_written_before_is_written_in_order(tmp_path: Path) -> None:
    # Positional writes need a file at its start; anything else gets the bytes in order.
    read_end, write_end = os.pipe()
    with open(write_end, "wb", buffering=0) as pipe:
        stream = ChecksumStream(pipe, 4096)
        stream.write_parts((b"ab", memoryview(b"cd"), b"ef"))
        stream.flush()
    assert os.read(read_end, 100) == b"abcdef"
    os.close(read_end)
    with open(tmp_path / "f", "wb") as raw:
        raw.write(b"head:")
        stream = ChecksumStream(raw, 4096)
        stream.write(b"body")
        stream.flush()
    assert (tmp_path / "f").read_bytes() == b"head:body"


@pytest.mark.parametrize("piece", [50 << 10, 700 << 10, 3 << 20])
def test_staged_pieces_in_one_reused_buffer_are_written_as_they_were(
    tmp_path: Path, piece: int
) -> None:
    # What the streamed path of an accelerator tensor does: each piece is staged into
    # the same buffer, which is overwritten once the next piece is asked for.
    tensor = (torch.arange((3 << 20) // 2 + 5) % 251).to(torch.bfloat16)
    data = tensor.view(torch.uint8).numpy().tobytes()
    staging = bytearray(piece)

    def pieces() -> Any:
        for start in range(0, len(data), piece):
            n = min(piece, len(data) - start)
            staging[:n] = data[start : start + n]
            yield memoryview(staging)[:n]

    with open(tmp_path / "f", "wb") as raw:
        stream = ChecksumStream(raw, 4096)
        stream.write(b"before")
        size = item_writer.write_tensor_streamed(stream, tensor, pieces())
        stream.flush()
    expected = io.BytesIO()
    torch.save(tensor, expected)
    assert size == len(expected.getvalue())
    assert (tmp_path / "f").read_bytes() == b"before" + expected.getvalue()
