"""The structure of a ``.metadata`` checked before anything uses it.

The unpicklers admit only allowlisted types, but not their combination: a crafted
file may put a string where a shape belongs, chunks that overlap, or an N-D
reformulated shape that does not match the stored tensor. :func:`check_metadata`
refuses all of these with a :class:`CorruptCheckpointError` naming the file and the
key, so that no later step fails with a bare ``TypeError`` or, worse, returns
unread memory.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import chain
from types import ModuleType
from typing import Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dist_checkpointing._torch_compat import StorageInfo
from dist_checkpointing.errors import CorruptCheckpointError, UnsafeCheckpointError

from .bounded import short_repr

# Megatron-Core's key for the original shape of an N-D reformulated tensor (in
# ``Metadata.mcore_data[key]``); kept here so this module imports no strategy.
ND_REFORMULATED_SHAPE_KEY = "nd_reformulated_orig_global_shape"
MAX_DIMS = 64
MAX_NESTING = 512
MAX_DIM_SIZE = 1 << 62

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _short(obj: object) -> str:
    """The type of ``obj`` and, for a scalar, its (bounded) value."""
    if isinstance(obj, (str, int, float)):
        return f"{type(obj).__name__} {repr(obj)[:80]}"
    return type(obj).__name__


class _Checker:
    def __init__(self, source: str, budget: int | None = None) -> None:
        self.source = source
        self.budget = budget  # pair comparisons per chunk of a tensor (and a base)

    def fail(self, where: str, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.source}: {where}: {what}")

    def dims(self, value: object, where: str, what: str) -> tuple[int, ...]:
        if not isinstance(value, (tuple, list)) or len(value) > MAX_DIMS:
            raise self.fail(
                where, f"{what} must be a sequence of dimensions, found {_short(value)}"
            )
        for d in value:
            if type(d) is not int or not 0 <= d <= MAX_DIM_SIZE:
                raise self.fail(where, f"{what} holds {_short(d)}, not a dimension")
        return tuple(value)

    def tensor(self, key: str, md: TensorStorageMetadata) -> None:
        # Fields read as attributes, not through vars(): CPython makes an instance's
        # __dict__ on first access and keeps it (100,000 entries: 18 MiB). Same values:
        # these classes have no properties and, for these fields, no class defaults.
        chunks = getattr(md, "chunks", None)
        props = getattr(md, "properties", None)
        if (  # the common cases in a few operations (else the checks below say why)
            type(chunks) is list
            and type(props) is TensorProperties
            and isinstance(vars(props).get("dtype"), torch.dtype)
        ):
            size = getattr(md, "size", None)
            if (  # one chunk, the whole tensor
                len(chunks) == 1
                and type(chunks[0]) is ChunkStorageMetadata
                and _whole(size, chunks[0])
            ):
                return
            fast = _well_formed_boxes(size, chunks) if len(chunks) >= _MANY_CHUNKS else None
            if fast is not None:
                self._disjoint(key, fast)
                return
        where = f"tensor {key[:200]!r}"
        size = self.dims(getattr(md, "size", None), where, "size")
        if type(props) is not TensorProperties or not isinstance(
            vars(props).get("dtype"), torch.dtype
        ):
            raise self.fail(where, f"properties must name a dtype, found {_short(props)}")
        if type(chunks) is not list:
            raise self.fail(where, f"chunks must be a list, found {_short(chunks)}")
        boxes: list[Box] = []
        for chunk in chunks:
            if type(chunk) is not ChunkStorageMetadata:
                raise self.fail(where, f"a chunk is {_short(chunk)}")
            off = self.dims(getattr(chunk, "offsets", None), where, "chunk offsets")
            ext = self.dims(getattr(chunk, "sizes", None), where, "chunk sizes")
            if len(off) != len(size) or len(ext) != len(size):
                raise self.fail(where, f"chunk {off}+{ext} does not have {len(size)} dims")
            if any(o + e > s for o, e, s in zip(off, ext, size)):
                raise self.fail(where, f"chunk at {off} of sizes {ext} exceeds shape {size}")
            boxes.append((off, ext))
        self._disjoint(key, boxes)

    def _disjoint(self, key: str, boxes: list[Box]) -> None:
        """Refuse chunks of one tensor that share an element."""
        budget = None if self.budget is None else self.budget * (len(boxes) + 1024)
        pair = first_overlap(boxes, budget)
        if pair is not None:
            a, b = (tuple(map(tuple, boxes[i])) for i in pair)
            raise self.fail(
                f"tensor {key[:200]!r}",
                f"stored chunks overlap (offsets {a[0]} sizes {a[1]} and offsets {b[0]} "
                f"sizes {b[1]})",
            )

    def reformulated(self, key: str, orig: object, md: object) -> None:
        where = f"tensor {key[:200]!r}"
        shape = self.dims(orig, where, "the N-D reformulated shape")
        if type(md) is not TensorStorageMetadata:
            raise self.fail(where, "an N-D reformulated shape is given for a non-tensor")
        size = tuple(md.size)
        grid = size[:-1]
        if len(size) != len(shape) + 1 or any(g == 0 or s % g for s, g in zip(shape, grid)):
            raise self.fail(
                where, f"stored shape {size} is not an N-D reformulation of shape {shape}"
            )
        block = math.prod(s // g for s, g in zip(shape, grid))
        # Every cell of the grid is a stored block (at least one chunk each): the
        # grid can be no larger than the chunks the file lists.
        if size[-1] != block or math.prod(grid) > len(md.chunks):
            raise self.fail(
                where,
                f"stored shape {size} of shape {shape} declares {math.prod(grid)} blocks of "
                f"{size[-1]} elements, but lists {len(md.chunks)} chunks",
            )

    def storage(self, storage_data: object) -> None:
        if storage_data is None:
            return
        if type(storage_data) is not dict:
            raise self.fail("storage_data", f"expected a dict, found {_short(storage_data)}")
        index_type, text, number = MetadataIndex, str, int
        info_type = StorageInfo
        for index, info in storage_data.items():  # the common case, in few operations
            if (
                type(index) is not index_type
                or type(index.fqn) is not text
                or type(info) is not info_type  # (attributes as in tensor(), not vars())
                or type(getattr(info, "relative_path", None)) is not text
                or type(off := getattr(info, "offset", None)) is not number
                or type(length := getattr(info, "length", None)) is not number
                or off < 0
                or length < 0
            ):
                self.storage_entry(index, info)

    def storage_entry(self, index: object, info: object) -> None:
        """Raise the precise error of a bad ``storage_data`` entry."""
        if type(index) is not MetadataIndex or type(index.fqn) is not str:
            raise self.fail("storage_data", f"a key is {_short(index)}")
        where = f"storage of {index.fqn[:200]!r}"
        if type(info) is not StorageInfo:
            raise self.fail(where, f"found {_short(info)}, not a storage location")
        fields = vars(info)
        path, off, length = (fields.get(k) for k in ("relative_path", "offset", "length"))
        if type(path) is not str:
            raise self.fail(where, f"relative_path is {_short(path)}")
        for name, value in (("offset", off), ("length", length)):
            if type(value) is not int or value < 0:
                raise self.fail(where, f"{name} is {_short(value)}, not a byte count")
        raise self.fail(where, f"malformed entry {_short(info)}")  # pragma: no cover


def check_metadata(
    metadata: Metadata, source: str, *, budget: int | None = None, storage: bool = True
) -> None:
    """Refuse a ``.metadata`` whose fields have the wrong types or are inconsistent.

    ``budget``: at most that many pair comparisons per chunk of a tensor in the overlap
    check (None: no bound; a parse in the forked CPU-time guard needs none).
    ``storage=False``: leave ``storage_data`` to whoever builds it later (the items of
    an index read for some keys, checked as they are built).

    Raises:
        CorruptCheckpointError: naming ``source`` and the offending key.
        CheckTooCostly: the budget was exceeded (nothing wrong was found so far).
    """
    check = _Checker(source, budget)
    entries: dict[Any, Any] = vars(metadata)["state_dict_metadata"]
    for key, md in entries.items():
        if type(key) is not str:
            raise check.fail("state_dict_metadata", f"a key is {_short(key)}")
        if type(md) is TensorStorageMetadata:
            check.tensor(key, md)
        elif type(md) is not BytesStorageMetadata:
            raise check.fail(f"key {key[:200]!r}", f"entry is {_short(md)}")
    if storage:
        check.storage(vars(metadata).get("storage_data"))
    storage_meta = vars(metadata).get("storage_meta")
    if storage_meta is not None and type(storage_meta) is not StorageMeta:
        raise check.fail("storage_meta", f"expected a StorageMeta, found {_short(storage_meta)}")
    mcore = vars(metadata).get("mcore_data")
    if mcore is None:
        return
    if type(mcore) is not dict:
        raise check.fail("mcore_data", f"expected a dict, found {_short(mcore)}")
    for key, extra in mcore.items():
        if type(key) is not str or type(extra) is not dict:
            raise check.fail("mcore_data", f"entry {_short(key)} is {_short(extra)}")
        orig = extra.get(ND_REFORMULATED_SHAPE_KEY)
        if orig is not None:
            check.reformulated(key, orig, entries.get(key))


# A tensor of this many chunks or more (the distributed optimizer's flat shards, large
# tensor-parallel groups) has their bounds checked with numpy, in one call per check
# instead of a few Python calls per chunk: 64 chunks 215-233 -> 92-146 us per tensor
# on the 2-core VM. Below, the per-chunk checks cost no more.
_MANY_CHUNKS = 16


def _well_formed_boxes(size: object, chunks: list[Any]) -> list[Box] | None:
    """The chunks' ``(offsets, sizes)`` when the size and every chunk's fields are
    ``torch.Size`` (ints by construction) of one rank and each chunk lies inside the
    tensor: the common case, checked in few operations. None: take the checking path,
    which names what is wrong."""
    if type(size) is not torch.Size or len(size) > MAX_DIMS:
        return None
    n = len(size)
    chunk_type, size_type = ChunkStorageMetadata, torch.Size
    if any(type(c) is not chunk_type for c in chunks):
        return None
    try:
        offsets = [c.offsets for c in chunks]
        sizes = [c.sizes for c in chunks]
    except AttributeError:  # an instance without its fields
        return None
    if any(type(x) is not size_type or len(x) != n for x in chain(offsets, sizes)):
        return None
    boxes: list[Box] = list(zip(offsets, sizes))
    if not n or not boxes:
        return boxes
    try:  # 0 <= size <= MAX_DIM_SIZE; every chunk: offsets >= 0, sizes >= 0, o <= s - e
        if min(size) < 0 or max(size) > MAX_DIM_SIZE:
            return None
        count = len(boxes) * n
        o = np.fromiter(chain.from_iterable(offsets), np.int64, count).reshape(-1, n)
        e = np.fromiter(chain.from_iterable(sizes), np.int64, count).reshape(-1, n)
    except (TypeError, ValueError, OverflowError):  # not made by torch.Size's constructor
        return None
    if (o < 0).any() or (e < 0).any() or (o > np.array(size, dtype=np.int64) - e).any():
        return None
    return boxes


def _whole(size: object, chunk: ChunkStorageMetadata) -> bool:
    """Whether ``chunk`` covers all of a tensor of ``size``, all of them well-formed
    ``torch.Size`` (whose items are ints)."""
    off, ext = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
    return (
        type(size) is torch.Size
        and type(off) is torch.Size
        and type(ext) is torch.Size
        and len(size) <= MAX_DIMS
        and ext == size
        and len(off) == len(size)
        and not any(off)
        and (not size or (min(size) >= 0 and max(size) <= MAX_DIM_SIZE))
    )


class CheckTooCostly(Exception):
    """The overlap check of one tensor's chunks went over its comparison budget."""


def _distinct_sorted(values: list[Any]) -> list[Any]:
    """``sorted(set(values))`` without hashing (tuples of ints from a file can be made
    to collide, and a set of them would take quadratic time)."""
    values = sorted(values)
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def _uniform_grid(boxes: list[Box]) -> bool:
    """True when the boxes all have one extent, every offset is a multiple of it and no
    offset repeats (tensor-parallel shards of one tensor, the most common layout): two
    distinct offsets then differ by a whole extent in some dimension. False means "not
    shown". The boxes must be non-empty."""
    ext0 = boxes[0][1]
    ndim = len(ext0)
    for off, ext in boxes:
        if ext != ext0 or len(off) != ndim:
            return False
        for o, e in zip(off, ext0):
            if o % e:
                return False
    offsets = sorted(off for off, _ in boxes)
    return all(a != b for a, b in zip(offsets, offsets[1:]))


def _grid_disjoint(boxes: list[Box]) -> bool:
    """True when the boxes are disjoint by a cheap argument: in every dimension their
    intervals are equal or disjoint (a grid, the usual layout), and no box repeats.
    False means "not shown", not "overlapping"."""
    if _uniform_grid(boxes):
        return True
    if len(_distinct_sorted(boxes)) != len(boxes):
        return False
    for d in range(len(boxes[0][0])):
        intervals = _distinct_sorted([(off[d], ext[d]) for off, ext in boxes])
        if any(a[0] + a[1] > b[0] for a, b in zip(intervals, intervals[1:])):
            return False
    return True


def first_overlap(boxes: Sequence[Box], budget: int | None = None) -> tuple[int, int] | None:
    """Indices of two boxes (offsets, sizes) that share an element, or None.

    A sweep along the dimension where the boxes' offsets differ most (the last one
    for flat chunks of one block, the first for row shards): only boxes still open
    there are compared. A regular grid is recognized first, in O(n log n). Crafted
    boxes can keep many open at once (quadratic); with ``budget``, more than that many
    pair comparisons raise :class:`CheckTooCostly`.
    """
    nonempty = [i for i, (_, ext) in enumerate(boxes) if all(ext)]
    if len(nonempty) < 2:
        return None
    if _grid_disjoint([boxes[i] for i in nonempty]):
        return None
    ndim = len(boxes[nonempty[0]][0])
    dim = max(range(ndim), key=lambda d: len({boxes[i][0][d] for i in nonempty}), default=0)
    nonempty.sort(key=lambda i: boxes[i][0][dim : dim + 1])
    active: list[int] = []
    left = math.inf if budget is None else budget
    for i in nonempty:
        off, ext = boxes[i]
        if off:
            active = [j for j in active if boxes[j][0][dim] + boxes[j][1][dim] > off[dim]]
        left -= len(active)
        if left < 0:
            raise CheckTooCostly(f"more than {budget} comparisons of {len(boxes)} chunks")
        for j in active:
            o2, e2 = boxes[j]
            if all(a < c + d and c < a + b for a, b, c, d in zip(off, ext, o2, e2)):
                return j, i
        active.append(i)
    return None


_LEAVES = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray}
    | {torch.dtype, torch.layout, torch.memory_format, torch.Size}
)


def _children(obj: object) -> list[object]:
    if isinstance(obj, enum.Enum):  # a member's __dict__ names its class: not data
        return []
    if type(obj) in (dict, OrderedDict):
        mapping = cast(dict[object, object], obj)
        return (
            [*mapping.keys(), *mapping.values(), *vars(obj).values()]
            if type(obj) is OrderedDict
            else [*mapping.keys(), *mapping.values()]
        )
    if type(obj) in (list, tuple, set, frozenset):
        return list(cast(Iterable[object], obj))
    return list(vars(obj).values()) if hasattr(obj, "__dict__") else []


def check_plain(root: object, source: str, max_depth: int = MAX_NESTING) -> None:
    """Refuse a result that holds a callable, class or module (a pickle may hand one
    out as data, and whoever uses it could change it for the whole process), or that
    nests deeper than ``max_depth`` (CPython hashes nested tuples recursively in C).

    Iterative: the height of every object is computed once, whatever its sharing.

    Raises:
        UnsafeCheckpointError: a callable, class or module.
        CorruptCheckpointError: too deep.
    """
    heights: dict[int, int] = {}
    entered: set[int] = set()
    todo: list[tuple[object, bool]] = [(root, False)]
    while todo:
        obj, done = todo.pop()
        if type(obj) in _LEAVES:
            continue
        key = id(obj)
        if done:
            height = 1 + max((heights.get(id(c), 0) for c in _children(obj)), default=0)
            if height > max_depth:
                raise CorruptCheckpointError(f"{source}: it nests deeper than {max_depth} levels")
            heights[key] = height
            continue
        if key in entered:
            continue
        entered.add(key)
        if callable(obj) or isinstance(obj, ModuleType):
            raise UnsafeCheckpointError(
                f"{source}: refusing to load: the pickle hands out {_short(obj)} "
                f"{short_repr(getattr(obj, '__qualname__', ''))} as data"
            )
        todo.append((obj, True))
        todo.extend((child, False) for child in _children(obj))


__all__ = ["CheckTooCostly", "check_metadata", "check_plain", "first_overlap"]
