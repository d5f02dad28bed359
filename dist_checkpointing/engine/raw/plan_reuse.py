"""Reusing a rank's ``raw_bytes`` layout for a save of an unchanged structure.

A save strategy made with ``cached_metadata=True`` keeps a :class:`LayoutCache`. Each
save compares the structure of the rank's planned leaves (key, dtype, global shape and
offset, local shape, prepended axes, flat range of each tensor; unique key of each
object; in plan order) with the last one; where it is equal, and the file count,
alignment and checksum block size too, the last :class:`~.writer.Layout` (files,
offsets, index entries) is taken with the new data: about 0.5 microseconds per tensor
(a tuple of its fields, its data checked) instead of the 3 to 4 of planning it. An
object whose payload changed length, or a tensor whose data no longer has its declared
dtype and size, makes the save plan afresh (which then names the problem).

The index and the files a reused layout gives are those a fresh plan gives
(``tests/unit/test_raw_plan_reuse.py`` compares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...mapping import ShardedBase, ShardedObject, ShardedTensor, tensor_structure
from .index import ITEMSIZE
from .pieces import IndexPiece
from .writer import Layout, RankWrite, assemble, object_payload, plan_items, planned_leaves


def _signature(planned: list[ShardedBase]) -> list[tuple[Any, ...]]:
    # An object's payload length is checked when its data is taken.
    return [
        tensor_structure(sh) if isinstance(sh, ShardedTensor) else ("object", sh.unique_key)
        for sh in planned
        if isinstance(sh, (ShardedTensor, ShardedObject))
    ]


def _data_of(planned: list[ShardedBase], layout: Layout) -> tuple[list[Any], list[int]] | None:
    """The data of each item and the items the staging step must look at, or None where
    some item no longer fits ``layout`` (then the save plans afresh)."""
    data: list[Any] = []
    special: list[int] = []
    value: Any
    for i, (sh, length) in enumerate(zip(planned, layout.lengths)):
        if isinstance(sh, ShardedTensor):
            value = sh.data
            if (
                not isinstance(value, torch.Tensor)
                or value.dtype is not sh.dtype
                or value.numel() * ITEMSIZE[sh.dtype] != length
            ):
                return None
            if not (value.is_cpu and value.is_contiguous()):
                special.append(i)
        else:
            assert isinstance(sh, ShardedObject)
            value = object_payload(sh)
            if len(value) != length:
                return None
        data.append(value)
    return data, special


@dataclass
class LayoutCache:
    """One save strategy's last layout and the structure it was planned for."""

    setting: tuple[int, int, int] | None = None  # file count, alignment, block bytes
    signature: list[tuple[Any, ...]] | None = None
    layout: Layout | None = None
    reused: int = 0  # saves that reused the layout (for tests and logs)

    def plan(
        self,
        leaves: list[ShardedBase],
        root: str,
        rank: int,
        file_count: int,
        alignment: int,
        block_bytes: int,
        save_tag: str = "",
    ) -> tuple[RankWrite, IndexPiece]:
        """:func:`~.writer.plan_rank`, reusing the last layout where the structure is
        unchanged (see the module docstring)."""
        planned = planned_leaves(leaves)
        setting = (file_count, alignment, block_bytes)
        signature = _signature(planned)
        layout = self.layout
        if layout is not None and setting == self.setting and signature == self.signature:
            taken = _data_of(planned, layout)
            if taken is not None:
                self.reused += 1
                return assemble(layout, *taken, root, rank, block_bytes, save_tag)
        self.layout = None  # a failing plan leaves nothing to reuse
        layout, data, special = plan_items(planned, file_count, alignment, block_bytes)
        self.setting, self.signature, self.layout = setting, signature, layout
        return assemble(layout, data, special, root, rank, block_bytes, save_tag)


__all__ = ["LayoutCache"]
