"""Shape arithmetic of sharded tensors: pure functions on shapes, offsets and ranges.

The checks that :class:`~dist_checkpointing.mapping.ShardedTensor` runs on
construction, the grid arithmetic of ``from_rank_offsets`` and the flat-range
arithmetic of ``narrow``. Each check returns the problem as text (or None);
the caller puts its key in the error. Nothing here imports ``mapping``: the
functions read the fields of any object shaped like a ShardedTensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch


class TensorBlock(Protocol):
    """The fields of a ShardedTensor that the checks read."""

    key: str
    data: torch.Tensor | None
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    prepend_axis_num: int
    allow_shape_mismatch: bool
    flattened_range: slice | None


def metadata_problem(t: TensorBlock) -> str | None:
    """What is inconsistent between dtype, shapes, offsets, fragmentations and the
    flattened range of ``t`` (None if nothing)."""
    if not isinstance(t.dtype, torch.dtype):
        return f"dtype must be a torch.dtype, got {t.dtype!r}"
    if t.prepend_axis_num < 0:
        return f"prepend_axis_num must be >= 0, got {t.prepend_axis_num}"
    ndim = len(t.global_shape)
    if len(t.global_offset) != ndim:
        return (
            f"global_offset {t.global_offset} and global_shape {t.global_shape} "
            "have different lengths"
        )
    if len(t.local_shape) + t.prepend_axis_num != ndim:
        return (
            f"local_shape {t.local_shape} plus prepend_axis_num={t.prepend_axis_num} "
            f"does not match the {ndim} axes of global_shape {t.global_shape}"
        )
    if t.axis_fragmentations is not None and len(t.axis_fragmentations) != ndim:
        return (
            f"axis_fragmentations {t.axis_fragmentations} must have one entry per "
            f"global axis ({ndim})"
        )
    if any(s < 0 for s in t.global_shape) or any(o < 0 for o in t.global_offset):
        return f"negative global_shape {t.global_shape} or global_offset {t.global_offset}"
    return block_position_problem(t) or flattened_range_problem(t) or data_problem(t)


def block_position_problem(t: TensorBlock) -> str | None:
    """Whether the block lies inside the global tensor, on a regular grid unless
    ``axis_fragmentations`` is None and there is no flat range (irregular sharding:
    any offsets)."""
    p = t.prepend_axis_num
    for axis in range(p):
        if t.global_offset[axis] >= max(t.global_shape[axis], 1):
            return (
                f"prepended axis {axis}: offset {t.global_offset[axis]} is outside "
                f"global size {t.global_shape[axis]}"
            )
    # Flat ranges are stored in the N-D reformulation of grid blocks: they need the grid.
    regular = t.axis_fragmentations is not None or t.flattened_range is not None
    for axis, (off, sh) in enumerate(zip(t.global_offset[p:], t.local_shape), start=p):
        if regular and sh != 0 and off % sh != 0:
            return (
                f"global offset {off} on axis {axis} is not divisible by the local size {sh} "
                "(blocks must lie on a regular grid)"
            )
        if not t.allow_shape_mismatch and off + sh > t.global_shape[axis]:
            return (
                f"block [{off}, {off + sh}) on axis {axis} exceeds the global size "
                f"{t.global_shape[axis]}"
            )
    return None


def flattened_range_problem(t: TensorBlock) -> str | None:
    """Whether the flattened range is a step-less slice inside the local block."""
    fr = t.flattened_range
    if fr is None:
        return None
    if not isinstance(fr, slice):
        return f"flattened_range must be a slice, got {type(fr).__name__}"
    if fr.step not in (None, 1):
        return f"flattened_range {fr} must not have a step"
    numel = math.prod(t.local_shape)
    if fr.start is None or fr.stop is None or not 0 <= fr.start <= fr.stop <= numel:
        return (
            f"flattened_range [{fr.start}, {fr.stop}) is outside the {numel} elements of "
            f"local_shape {t.local_shape}"
        )
    return None


def data_problem(t: TensorBlock) -> str | None:
    """Whether ``data`` (if any) has the declared dtype and the local (or flat) shape."""
    data = t.data
    if data is None:
        return None
    if not isinstance(data, torch.Tensor):
        return f"data must be a torch.Tensor, got {type(data).__name__}"
    if data.dtype != t.dtype:
        return f"data dtype {data.dtype} differs from the declared dtype {t.dtype}"
    if t.flattened_range is None:
        if tuple(data.shape) != t.local_shape:
            return f"data shape {tuple(data.shape)} differs from local_shape {t.local_shape}"
        return None
    expected = t.flattened_range.stop - t.flattened_range.start
    if data.ndim != 1 or data.numel() != expected:
        return (
            f"flat data must be 1-D with {expected} elements "
            f"(flattened_range {t.flattened_range}), got shape {tuple(data.shape)}"
        )
    return None


_CACHED_NDIM = 8
_ZEROS = [(0,) * n for n in range(_CACHED_NDIM)]
_ONES = [(1,) * n for n in range(_CACHED_NDIM)]


def grid_from_rank_offsets(
    data_shape: Sequence[int],
    rank_offsets: Sequence[tuple[int, int, int]],
    prepend_axis_num: int,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | str:
    """``(global_shape, global_offset, axis_fragmentations)`` of a block of shape
    ``data_shape`` placed by ``(axis, axis_rank_offset, axis_fragmentations)``
    triples, or the problem with ``rank_offsets`` as text."""
    if not rank_offsets and not prepend_axis_num:  # a whole tensor (most replicated state)
        n = len(data_shape)
        return (
            tuple(data_shape),
            _ZEROS[n] if n < _CACHED_NDIM else (0,) * n,
            _ONES[n] if n < _CACHED_NDIM else (1,) * n,
        )
    ndim = len(data_shape) + prepend_axis_num
    global_shape = [1] * prepend_axis_num + list(data_shape)
    global_offset = [0] * ndim
    fragmentations = [1] * ndim
    seen: set[int] = set()
    for entry in rank_offsets:
        if len(entry) != 3:
            return (
                "each rank offset must be "
                f"(axis, axis_rank_offset, axis_fragmentations), got {entry}"
            )
        axis, rank_off, frag = entry
        if not (0 <= axis < ndim) or frag < 1 or not (0 <= rank_off < frag) or axis in seen:
            return (
                f"invalid rank offsets {tuple(rank_offsets)} for a tensor "
                f"with {ndim} global axes (axis in [0, {ndim}), 0 <= offset < fragmentations, "
                "each axis once)"
            )
        seen.add(axis)
        local_size = 1 if axis < prepend_axis_num else data_shape[axis - prepend_axis_num]
        global_shape[axis] = frag * local_size
        global_offset[axis] = rank_off * local_size
        fragmentations[axis] = frag
    return tuple(global_shape), tuple(global_offset), tuple(fragmentations)


def grid_block_shape(
    global_shape: tuple[int, ...], axis_fragmentations: tuple[int, ...], allow_uneven: bool
) -> tuple[int, ...] | str:
    """The block shape of a regular grid (``global // fragmentations`` per axis), or
    the problem as text when an axis does not divide (unless ``allow_uneven``)."""
    chunks = []
    for axis, (size, frag) in enumerate(zip(global_shape, axis_fragmentations)):
        if not allow_uneven and size % frag != 0:
            return f"global size {size} on axis {axis} is not divisible by its fragmentation {frag}"
        chunks.append(size // frag)
    return tuple(chunks)


def narrowed_flat_range(
    flattened_range: slice, local_shape: Sequence[int], start: int, length: int
) -> tuple[slice, slice] | None:
    """A flat range after narrowing its block to rows ``[start, start + length)``:
    ``(new range in the narrowed block, slice of the old flat data)``, or None if
    the range does not meet the narrowed block."""
    row = math.prod(local_shape[1:])
    lo = flattened_range.start - row * start
    hi = flattened_range.stop - row * start
    new_lo, new_hi = max(lo, 0), min(hi, row * length)
    if new_lo >= new_hi:
        return None
    return slice(new_lo, new_hi), slice(new_lo - lo, new_hi - lo)


def narrowed_grid(
    global_shape: tuple[int, ...],
    global_offset: tuple[int, ...],
    local_shape: tuple[int, ...],
    prepend_axis_num: int,
    dim: int,
    length: int,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | str:
    """``(global_shape, global_offset, local_shape)`` after every rank keeps ``length``
    elements of its block along local axis ``dim``, or the problem as text."""
    gdim = dim + prepend_axis_num
    local_len = local_shape[dim]
    if local_len == 0 or global_shape[gdim] % local_len or global_offset[gdim] % local_len:
        return (
            f"narrow needs a regular grid on axis {gdim}: global size {global_shape[gdim]}, "
            f"offset {global_offset[gdim]}, local size {local_len}"
        )
    return (
        _with(global_shape, gdim, global_shape[gdim] // local_len * length),
        _with(global_offset, gdim, global_offset[gdim] // local_len * length),
        _with(local_shape, dim, length),
    )


def _with(t: tuple[int, ...], index: int, value: int) -> tuple[int, ...]:
    return t[:index] + (value,) + t[index + 1 :]


def flat_local_coordinates(
    flattened_range: slice, local_shape: tuple[int, ...]
) -> tuple[np.ndarray, ...]:
    """Coordinates in the local block of every element of a flat range."""
    flat = np.arange(flattened_range.start, flattened_range.stop)
    return tuple(np.unravel_index(flat, local_shape))


def flat_global_coordinates(
    flattened_range: slice,
    local_shape: tuple[int, ...],
    global_offset: tuple[int, ...],
    prepend_axis_num: int,
) -> tuple[np.ndarray, ...]:
    """Global coordinates of every element of a flat range of a block at ``global_offset``."""
    local = flat_local_coordinates(flattened_range, local_shape)
    p = prepend_axis_num
    prepended = tuple(
        np.full_like(local[0], off) if local else np.zeros(0, dtype=np.int64)
        for off in global_offset[:p]
    )
    return prepended + tuple(c + off for c, off in zip(local, global_offset[p:]))


def object_unique_key(key: str, offset: Sequence[int], shape: Sequence[int]) -> str:
    """The stored key of one ShardedObject shard: ``<key>/shard_<offsets>_<shape>``,
    numbers joined by ``.``."""
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"


def parse_object_unique_key(
    unique_key: str,
) -> tuple[str, tuple[int, ...], tuple[int, ...]] | str:
    """``(key, offset, shape)`` of a ShardedObject's stored key, or the problem as text."""
    key, sep, shard = unique_key.rpartition("/")
    parts = shard.split("_")
    if not sep or len(parts) != 3 or parts[0] != "shard":
        return (
            f"'{unique_key}' is not a ShardedObject unique key "
            "(expected '<key>/shard_<offsets>_<shape>')"
        )
    try:
        # An empty field is the empty tuple (a 0-d object grid).
        offset = tuple(int(x) for x in parts[1].split(".")) if parts[1] else ()
        shape = tuple(int(x) for x in parts[2].split(".")) if parts[2] else ()
    except ValueError:
        return f"'{unique_key}' has non-integer offsets or shape"
    return key, offset, shape


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def box_minus(box: Box, hole: Box) -> list[Box]:
    """The parts of ``box`` outside ``hole``, as at most ``2 * ndim`` disjoint boxes."""
    (offsets, sizes), (h_off, h_sizes) = box, hole
    lo = [max(o, h) for o, h in zip(offsets, h_off)]
    hi = [min(o + s, h + t) for o, s, h, t in zip(offsets, sizes, h_off, h_sizes)]
    if any(h <= low for low, h in zip(lo, hi)):
        return [box]  # no intersection
    parts: list[Box] = []
    cur_off, cur_sizes = list(offsets), list(sizes)
    for axis in range(len(offsets)):
        start, stop = cur_off[axis], cur_off[axis] + cur_sizes[axis]
        if start < lo[axis]:  # the slab before the hole on this axis
            parts.append(_with_axis(cur_off, cur_sizes, axis, start, lo[axis] - start))
        if hi[axis] < stop:  # the slab after it
            parts.append(_with_axis(cur_off, cur_sizes, axis, hi[axis], stop - hi[axis]))
        cur_off[axis], cur_sizes[axis] = lo[axis], hi[axis] - lo[axis]
    return parts


def _with_axis(offsets: list[int], sizes: list[int], axis: int, start: int, size: int) -> Box:
    new_off, new_sizes = list(offsets), list(sizes)
    new_off[axis], new_sizes[axis] = start, size
    return tuple(new_off), tuple(new_sizes)


def box_intersection(a: Box, b: Box) -> Box | None:
    """The box where boxes ``a`` and ``b`` overlap (None if they do not)."""
    (a_off, a_sz), (b_off, b_sz) = a, b
    lo: list[int] = []
    size: list[int] = []
    for x, s, y, t in zip(a_off, a_sz, b_off, b_sz):  # a plain loop: planned per chunk
        start = x if x > y else y
        end = x + s if x + s < y + t else y + t
        if end <= start:
            return None
        lo.append(start)
        size.append(end - start)
    return tuple(lo), tuple(size)


def box_slices(offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    """The slices that select the box ``(offsets, sizes)``."""
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def flat_range_rows(block: Sequence[int], fr: slice) -> tuple[int, int]:
    """``[first, last)`` rows (axis 0) of ``block`` that the flat range ``fr`` touches."""
    row = math.prod(block[1:])
    if row == 0 or fr.stop <= fr.start:
        return 0, 0
    return fr.start // row, -(-fr.stop // row)


def uncovered_boxes(global_shape: tuple[int, ...], boxes: Sequence[Box]) -> list[Box]:
    """Disjoint boxes covering what of the global tensor ``boxes`` do not cover."""
    remaining: list[Box] = [((0,) * len(global_shape), tuple(global_shape))]
    for hole in boxes:
        remaining = [part for box in remaining for part in box_minus(box, hole)]
    return [(o, s) for o, s in remaining if all(s)]


__all__ = [
    "TensorBlock",
    "Box",
    "block_position_problem",
    "box_intersection",
    "box_slices",
    "flat_range_rows",
    "box_minus",
    "data_problem",
    "flat_global_coordinates",
    "flat_local_coordinates",
    "flattened_range_problem",
    "grid_block_shape",
    "grid_from_rank_offsets",
    "metadata_problem",
    "narrowed_flat_range",
    "narrowed_grid",
    "object_unique_key",
    "parse_object_unique_key",
    "uncovered_boxes",
]
