"""Safetensors files written one tensor at a time, and read lazily.

The writer streams the format (an 8-byte little-endian header length, a JSON
header padded to 8 bytes, then the raw little-endian bytes of every tensor in
header order), so memory stays bounded by the largest tensor; the output is
read back by the ``safetensors`` package itself in the tests. Reading uses the
``safetensors`` package (``safe_open``), which never executes anything.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..engine.storage.tensor_bytes import byte_view
from .ui import CliError

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

INDEX_FNAME = "model.safetensors.index.json"


def header(entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> bytes:
    """The length-prefixed, padded header for tensors stored in this order."""
    body: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape, dtype in entries:
        if dtype not in DTYPES:
            raise CliError(f"{key}: dtype {dtype} has no safetensors equivalent")
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        body[key] = {
            "dtype": DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(body, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_file(
    path: str,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    read: Callable[[str], torch.Tensor],
    on_bytes: Callable[[int], object],
) -> None:
    """Write ``entries`` (key, shape, dtype) to ``path``, reading one tensor at a time."""
    with open(path, "wb") as f:
        f.write(header(entries))
        for key, shape, dtype in entries:
            t = read(key).contiguous()
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise CliError(f"{key}: read {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
            data = byte_view(t).numpy()
            f.write(data.data)
            on_bytes(data.nbytes)
            del t, data
        f.flush()
        os.fsync(f.fileno())


def _files_of(src: str) -> list[str]:
    if os.path.isfile(src):
        return [src]
    index = os.path.join(src, INDEX_FNAME)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        return [os.path.join(src, n) for n in sorted(set(weight_map.values()))]
    files = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if not files:
        raise CliError(f"{src}: no .safetensors files")
    return [os.path.join(src, n) for n in files]


def iter_tensors(
    src: str,
) -> Iterator[tuple[str, Callable[[slice | None], torch.Tensor], tuple[int, ...], torch.dtype]]:
    """``(key, read(rows), shape, dtype)`` per tensor of a safetensors file or directory;
    ``read(slice)`` loads only those rows of axis 0 (None: all)."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise CliError(
            "reading safetensors needs the 'safetensors' package (pip install dist_checkpointing[cli])"
        ) from None
    by_name = {v: k for k, v in DTYPES.items()}
    for path in _files_of(src):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                sl = f.get_slice(key)
                shape, dtype = tuple(sl.get_shape()), by_name[sl.get_dtype()]

                def read(
                    rows: slice | None,
                    _sl: Any = sl,
                    _shape: tuple[int, ...] = shape,
                    _f: Any = f,
                    _key: str = key,
                ) -> torch.Tensor:
                    if not _shape:  # a scalar: a slice of it cannot be taken
                        scalar: torch.Tensor = _f.get_tensor(_key)
                        return scalar
                    t: torch.Tensor = _sl[:] if rows is None else _sl[rows]
                    return t

                yield key, read, shape, dtype


__all__ = ["DTYPES", "INDEX_FNAME", "header", "iter_tensors", "write_file"]
