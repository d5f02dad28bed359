"""The zip format's CRC-32 (``checksums.zip_crc32``): ISA-L's with the ``isal`` extra,
zlib's without; the same values either way, and the ``torch_dist`` item writer stays
byte for byte ``torch.save`` in both cases."""

from __future__ import annotations

import subprocess
import sys
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing.engine.storage import checksums


def test_the_isal_extra_is_used_when_installed() -> None:
    # make test installs the extra: the accelerated function must be the one in use.
    from isal import isal_zlib

    assert checksums.zip_crc32 is isal_zlib.crc32


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=9000),  # across the 5 KiB where the GIL is released
    start=st.integers(min_value=0, max_value=2**32 - 1),
    cut=st.integers(min_value=0, max_value=9000),
)
def test_same_values_as_zlib(data: bytes, start: int, cut: int) -> None:
    assert checksums.zip_crc32(data) == zlib.crc32(data)
    assert checksums.zip_crc32(data, start) == zlib.crc32(data, start)
    # continued over two pieces, as the writer checksums a large tensor piece by piece
    head, tail = memoryview(data)[:cut], memoryview(data)[cut:]
    assert checksums.zip_crc32(tail, checksums.zip_crc32(head, 0)) == zlib.crc32(data)


_WITHOUT_ISAL = """
import io, sys, zlib
sys.modules["isal"] = None  # as if the extra were not installed
import torch
from dist_checkpointing.engine.storage import checksums, item_writer
assert checksums.zip_crc32 is zlib.crc32, checksums.zip_crc32
for dtype in (torch.float32, torch.bfloat16, torch.int64):
    for n in (0, 5, 70000):
        t = (torch.arange(n) % 251).to(dtype)
        expected = io.BytesIO()
        torch.save(t, expected)
        assert item_writer.fast_path_supported(dtype), dtype
        assert item_writer.serialize_tensor(t) == expected.getvalue(), (dtype, n)
print("ok")
"""


def test_without_the_extra_zlib_serves_and_items_match_torch_save() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_ISAL], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
