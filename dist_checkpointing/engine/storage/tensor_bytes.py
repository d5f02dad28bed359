"""The bytes of a contiguous tensor, as a flat ``uint8`` tensor on its device.

``Tensor.is_contiguous`` ignores the stride of a dimension of size 1, so a contiguous
tensor may still carry any stride there (``torch.zeros(8)[::2][2:3]`` has stride 2), and
``reshape(-1).view(torch.uint8)`` then fails. :func:`byte_view` views such a tensor with
the strides its layout really has first. Every path that reads or writes a tensor's bytes
in place takes them from here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as a flat ``uint8`` tensor (a view, no copy)."""
    if not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    flat = t.detach()
    if flat.dim() != 1 or flat.stride(0) != 1:
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def buffer_of(data: Any) -> Any:
    """A buffer over the bytes of ``data`` (a contiguous CPU tensor, or bytes) without a
    copy; the caller keeps ``data`` alive while the buffer is used. Writable for a
    tensor (an empty one gets an empty ``bytearray``), so reads may land in it."""
    if not isinstance(data, torch.Tensor):
        return data
    n = data.numel() * data.element_size()
    if n == 0:
        return bytearray()
    return (ctypes.c_char * n).from_address(data.data_ptr())


def contiguous_strides(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """The strides, in elements, of a C-order contiguous tensor of ``shape``."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def element_span(
    shape: Sequence[int], storage_offset: int, offsets: Sequence[int], lengths: Sequence[int]
) -> tuple[int, int]:
    """The first and last element (storage indexes) of the region at ``offsets`` spanning
    ``lengths`` of a C-order contiguous tensor of ``shape`` starting at element
    ``storage_offset`` of its storage; the region is one contiguous range where
    ``last - first + 1`` is its element count."""
    first = last = storage_offset
    for o, n, stride in zip(offsets, lengths, contiguous_strides(tuple(shape))):
        first += o * stride
        last += (o + n - 1) * stride
    return first, last


__all__ = ["buffer_of", "byte_view", "contiguous_strides", "element_span"]
