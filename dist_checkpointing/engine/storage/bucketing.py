"""Which items go into which data file of a rank, and what the files are called.

Pure functions: size-balanced bucketing of a rank's write items (one bucket per
data file), the data file names (``__<rank>_<n>.distcp``), and resolving each
item's data into a :class:`~.write_workers.WriteBucket` ready to be written.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ..._torch_compat import DATA_FILE_SUFFIX
from ...errors import CheckpointingException
from .item_template import _itemsize
from .names import safe_name
from .write_workers import WriteBucket


def data_file_prefix(rank: int) -> str:
    """Data files of group rank ``rank`` are named ``__<rank>_<n>.distcp``."""
    return f"__{rank}_"


def data_file_name(prefix: str, n: int, separation_hint: str = "", save_tag: str = "") -> str:
    """The name of data file ``n`` with ``prefix`` (see :func:`data_file_prefix`);
    files of items separated by ``separation_hint`` start with the hint, as
    Megatron-Core names them (``optimizer.__0_2.distcp``). A save through the
    commit protocol into a directory that holds checkpoint files adds its tag
    (``__0_2.<tag>.distcp``), so that its files never replace those of the
    checkpoint it overwrites before it is committed."""
    tag = f".{save_tag}" if save_tag else ""
    # The same check as every name read from a checkpoint: a hint such as "../x."
    # must not place a data file outside the checkpoint directory.
    return safe_name(f"{separation_hint}{prefix}{n}{tag}{DATA_FILE_SUFFIX}", source="save")


def is_data_file_of(name: str, rank: int) -> bool:
    """Whether ``name`` is a data file written by group rank ``rank`` (with or
    without a separation-hint prefix and a save tag)."""
    pattern = (
        rf".*{re.escape(data_file_prefix(rank))}\d+(\.[0-9a-f]+)?{re.escape(DATA_FILE_SUFFIX)}"
    )
    return re.fullmatch(pattern, name, flags=re.DOTALL) is not None


def item_size(item: WriteItem) -> int:
    """Bytes of the tensor chunk of ``item`` (0 for bytes items)."""
    if item.tensor_data is None:
        return 0
    numel = 1
    for s in item.tensor_data.chunk.sizes:  # the chunk, not the global tensor
        numel *= s
    return numel * _itemsize(item.tensor_data.properties.dtype)


def split_by_size(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Split ``items`` into ``bins`` lists of similar total size.

    Bytes items go round-robin; tensor items largest-first onto the least-filled
    bin. Bins may be empty.
    """
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    byte_items = [it for it in items if it.type == WriteItemType.BYTE_IO]
    tensor_items = [it for it in items if it.type != WriteItemType.BYTE_IO]
    for i, it in enumerate(byte_items):
        buckets[i % bins].append(it)
    sized = sorted(((item_size(it), i) for i, it in enumerate(tensor_items)), reverse=True)
    heap = [(0, b) for b in range(bins)]
    for size, i in sized:
        total, b = heapq.heappop(heap)
        buckets[b].append(tensor_items[i])
        heapq.heappush(heap, (total + size, b))
    return buckets


def plan_buckets(
    items: Sequence[WriteItem], thread_count: int, separation_hint: str | None
) -> list[list[WriteItem]]:
    """Group ``items`` into the non-empty buckets (one file each) of one rank.

    Without ``separation_hint`` there are up to ``thread_count`` buckets. With it,
    items whose fqn starts with the hint get their own buckets: up to
    ``max(1, thread_count // 2)`` for the other items, then as many for the hinted ones.
    """
    if separation_hint is None:
        groups = [list(items)]
        bins = thread_count
    else:
        groups = [
            [it for it in items if not it.index.fqn.startswith(separation_hint)],
            [it for it in items if it.index.fqn.startswith(separation_hint)],
        ]
        bins = max(1, thread_count // 2)
    return [b for group in groups for b in split_by_size(group, bins) if b]


@dataclass(frozen=True)
class BucketLayout:
    """The grouping :func:`plan_buckets` made of the item list ``items`` (the very
    list object) for ``thread_count`` and ``separation_hint``: a save that reuses its
    cached plan reuses this too (:func:`build_buckets`)."""

    items: Sequence[WriteItem]
    thread_count: int
    separation_hint: str | None
    groups: list[list[WriteItem]]

    def fits(self, items: Sequence[WriteItem], thread_count: int, hint: str | None) -> bool:
        return (
            self.items is items
            and self.thread_count == thread_count
            and self.separation_hint == hint
        )


def _is_whole_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous and covers exactly its storage (torch.save saves all of it)."""
    # Cheapest test first; ``nbytes`` is ``numel() * element_size()`` in one call.
    return (
        t.storage_offset() == 0 and t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes
    )


def _prepare_tensor(t: torch.Tensor) -> torch.Tensor:
    """Detach; copy CPU views so that only the chunk's bytes are saved."""
    if t.requires_grad or type(t) is not torch.Tensor:
        t = t.detach()  # a plain tensor needs no new view (microseconds per item)
    if t.is_cpu and not _is_whole_storage(t):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def build_buckets(
    items: Sequence[WriteItem],
    resolve: Callable[[WriteItem], Any],
    path_of: Callable[[str], str],
    prefix: str,
    thread_count: int,
    separation_hint: str | None,
    save_tag: str = "",
    checksum_block_bytes: int = 0,
    layout: BucketLayout | None = None,
    digest: bool = False,
) -> tuple[list[WriteBucket], BucketLayout]:
    """The rank's buckets: items grouped by :func:`plan_buckets` (or as ``layout``
    groups them, where it :meth:`~BucketLayout.fits`), each item's data resolved
    (``resolve``, the planner's ``resolve_data``), files named from ``prefix``; and
    the grouping, for the next save of the same plan. ``digest``: the buckets' writers
    also compute each file's sha256 (for the integrity manifest).

    CPU tensors are kept as they are (views of larger storages are copied);
    accelerator tensors are staged later (by the request's staging step,
    ``StageBuckets``).
    """
    if layout is None or not layout.fits(items, thread_count, separation_hint):
        groups = plan_buckets(items, thread_count, separation_hint)
        layout = BucketLayout(items, thread_count, separation_hint, groups)
    buckets = []
    for n, group in enumerate(layout.groups):
        hinted = separation_hint is not None and group[0].index.fqn.startswith(separation_hint)
        hint = separation_hint if hinted and separation_hint else ""
        name = data_file_name(prefix, n, hint, save_tag)
        bucket = WriteBucket(
            path_of(name), name, checksum_block_bytes=checksum_block_bytes, digest=digest
        )
        for item in group:
            data = resolve(item)
            if item.type == WriteItemType.BYTE_IO:
                bucket.byte_items.append((item, data))
            elif isinstance(data, torch.Tensor):
                bucket.tensor_items.append((item, _prepare_tensor(data)))
            else:
                raise CheckpointingException(
                    f"the planner resolved tensor item {item.index.fqn!r} to a "
                    f"{type(data).__name__}, expected a torch.Tensor"
                )
        buckets.append(bucket)
    return buckets, layout


__all__ = [
    "BucketLayout",
    "build_buckets",
    "data_file_name",
    "data_file_prefix",
    "is_data_file_of",
    "item_size",
    "plan_buckets",
    "split_by_size",
]
