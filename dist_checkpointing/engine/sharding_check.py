"""Sharding integrity: do the main replicas of every rank cover each global tensor exactly once?

Pure functions over per-rank metadata (:class:`ShardRecord` tuples or data-less
ShardedBase leaves), so multi-rank cases are tested in one process. Every
problem of every key is reported at once, naming the key and the ranks:
overlapping blocks, gaps (with the missing region where it is small enough to
compute), flat ranges that do not tile their block, and ShardedObjects that are
missing or duplicated.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np

from .._shard_geometry import object_unique_key
from ..mapping import (
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)

# Above this many elements a key's coverage error is described by volume only
# (describing the exact gaps needs a per-element count array).
# Per rank, the ShardedBase leaves or their ShardRecords (the checks accept both).
GlobalMetadata = list[list[Any]]

_MAX_ELEMENTS_FOR_GAP_REPORT = 1 << 22


@dataclass(frozen=True)
class _Block:
    """A main replica's region of a global tensor, with the rank that owns it."""

    rank: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def describe(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offset, self.shape)) + "]"


class ShardRecord(NamedTuple):
    """What the sharding and key checks need of one ShardedBase: small and cheap to
    gather across ranks (plain tuples pickle far faster than dataclasses)."""

    key: str
    # None: not a shard but a claim of the stored name ``key`` by the object shard named
    # in ``dtype`` (sent to the owner of that name, see sharding_split.records_by_owner).
    is_tensor: bool | None
    dtype: str  # "" for objects
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    chunk_shape: tuple[int, ...]  # the block in global coordinates; () for objects
    flat: tuple[int, int] | None  # the flattened range, if any
    is_main: bool


# Field positions of a record (a ShardRecord, or the plain tuple of its fields that the
# split check receives): the fast paths index them, as the wire tuples have no names.
_DTYPE, _SHAPE, _OFFSET, _CHUNK, _FLAT, _MAIN = 2, 3, 4, 5, 6, 7


_new_tuple = tuple.__new__


def shard_record(sh: ShardedBase | ShardRecord) -> ShardRecord:
    """The :class:`ShardRecord` of a ShardedTensor or ShardedObject."""
    if isinstance(sh, ShardRecord):
        return sh
    if isinstance(sh, ShardedTensor):
        # Built with tuple.__new__ (the named tuple's own __new__ is a Python function:
        # half of this function's time, once per tensor on every save and load).
        fr, rid, prepend = sh.flattened_range, sh.replica_id, sh.prepend_axis_num
        local = tuple(sh.local_shape)
        return _new_tuple(
            ShardRecord,
            (
                sh.key,
                True,
                str(sh.dtype),
                tuple(sh.global_shape),
                tuple(sh.global_offset),
                (1,) * prepend + local if prepend else local,
                None if fr is None else (fr.start, fr.stop),
                rid == 0 if type(rid) is int else is_main_replica(rid),
            ),
        )
    if isinstance(sh, ShardedObject):
        return ShardRecord(
            sh.key,
            False,
            "",
            tuple(sh.global_shape),
            tuple(sh.global_offset),
            (),
            None,
            is_main_replica(sh.replica_id),
        )
    raise TypeError(f"expected a ShardedTensor or ShardedObject, got {type(sh).__name__}")


def stored_object_name(rec: tuple[Any, ...]) -> str:
    """The name an object shard's record (a :class:`ShardRecord`, or the plain tuple of
    its fields) is stored under (its ``unique_key``)."""
    return object_unique_key(rec[0], rec[_OFFSET], rec[_SHAPE])


def _intersection(a: _Block, b: _Block) -> _Block | None:
    lo = tuple(max(x, y) for x, y in zip(a.offset, b.offset))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a.offset, a.shape, b.offset, b.shape))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return _Block(-1, lo, tuple(h - low for low, h in zip(lo, hi)))


def _overlap_problems(key: str, blocks: list[_Block]) -> list[str]:
    """Pairs of blocks that overlap (sweep over axis 0 to avoid most pairs)."""
    problems: list[str] = []
    if not blocks or not blocks[0].shape:
        if len(blocks) > 1:
            ranks = sorted(b.rank for b in blocks)
            problems.append(f"'{key}': scalar saved as main replica by several ranks {ranks}")
        return problems
    order = sorted(blocks, key=lambda b: b.offset[0])
    for i, a in enumerate(order):
        end0 = a.offset[0] + a.shape[0]
        for b in order[i + 1 :]:
            if b.offset[0] >= end0:
                break
            common = _intersection(a, b)
            if common is not None:
                problems.append(
                    f"'{key}': main replicas overlap at {common.describe()} "
                    f"(rank {a.rank} block {a.describe()}, rank {b.rank} block {b.describe()})"
                )
    return problems


def _volume_inside(global_shape: tuple[int, ...], blocks: list[_Block]) -> int:
    """Elements of the blocks that lie inside the global tensor (parts outside are
    reported as their own problem and must not hide a gap)."""
    return sum(
        math.prod(max(0, min(o + s, g) - o) for o, s, g in zip(b.offset, b.shape, global_shape))
        for b in blocks
    )


def _gap_description(global_shape: tuple[int, ...], blocks: list[_Block]) -> str:
    numel = math.prod(global_shape)
    covered = _volume_inside(global_shape, blocks)
    if numel > _MAX_ELEMENTS_FOR_GAP_REPORT:
        return f"{numel - covered} of {numel} elements are not covered"
    counts = np.zeros(global_shape, dtype=np.int32)
    for b in blocks:
        counts[tuple(slice(o, o + s) for o, s in zip(b.offset, b.shape))] += 1
    missing = np.argwhere(counts == 0)
    lo, hi = missing.min(axis=0), missing.max(axis=0) + 1
    region = "[" + ", ".join(f"{int(a)}:{int(b)}" for a, b in zip(lo, hi)) + "]"
    return f"{len(missing)} of {numel} elements are not covered (within region {region})"


def _flat_blocks(key: str, shards: list[tuple[int, ShardRecord]]) -> tuple[list[_Block], list[str]]:
    """Group flat main replicas by block; each block's flat ranges must tile it exactly."""
    problems: list[str] = []
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[int, tuple[int, int]]]] = (
        defaultdict(list)
    )
    for rank, sh in shards:
        assert sh.flat is not None  # only flat shards are passed here
        groups[(sh.global_offset, sh.chunk_shape)].append((rank, sh.flat))
    blocks = []
    for (offset, shape), ranges in groups.items():
        numel = math.prod(shape)
        block = _Block(ranges[0][0], offset, shape)
        pos = 0
        for rank, (start, stop) in sorted(ranges, key=lambda r: r[1]):
            if start == stop:
                continue  # an empty range covers nothing and overlaps nothing
            if start > pos:
                problems.append(
                    f"'{key}': flat elements [{pos}, {start}) of block {block.describe()} "
                    "are not covered by any rank"
                )
            elif start < pos:
                problems.append(
                    f"'{key}': flat range [{start}, {stop}) of rank {rank} overlaps "
                    f"another rank's range in block {block.describe()}"
                )
            pos = max(pos, stop)
        if pos < numel:
            problems.append(
                f"'{key}': flat elements [{pos}, {numel}) of block {block.describe()} "
                "are not covered by any rank"
            )
        blocks.append(block)
    return blocks, problems


def _offset_of(rec: tuple[Any, ...]) -> Any:
    return rec[_OFFSET]


def _tiles_exactly(shards: list[tuple[int, tuple[Any, ...]]]) -> bool:
    """A cheap sufficient test for the common layouts: every shard agrees on shape and
    dtype, none is flat, and the main replicas tile the tensor along at most one axis
    (one whole block, or row/column blocks end to end). False means "look closer"."""
    first = shards[0][1]
    shape, dtype = first[_SHAPE], first[_DTYPE]
    main: list[tuple[Any, ...]] = []
    for _, sh in shards:
        if sh[_SHAPE] != shape or sh[_DTYPE] != dtype or sh[_FLAT] is not None:
            return False
        if sh[_MAIN]:
            main.append(sh)
    if len(main) == 1:
        return main[0][_CHUNK] == shape and not any(main[0][_OFFSET])
    if not main or not shape:
        return False
    main.sort(key=_offset_of)  # by the axis offset where the rest are 0 (else False below)
    n = len(shape)
    pos = 0
    if n == 1:  # blocks of a vector: end to end
        for sh in main:
            offset, chunk = sh[_OFFSET], sh[_CHUNK]
            if len(offset) != 1 or len(chunk) != 1 or offset[0] != pos:
                return False
            pos += chunk[0]
        return bool(pos == shape[0])
    chunk0 = main[0][_CHUNK]
    axis = -1
    for i, (c, g) in enumerate(zip(chunk0, shape)):
        if c != g:
            if axis >= 0:
                return False
            axis = i
    if axis < 0 or len(chunk0) != n:
        return False
    # Off the axis every block must start at 0 and span the tensor: compare the
    # offset and block with the axis entry left out (one C-level getter per key).
    rest = itemgetter(*(i for i in range(n) if i != axis))
    rest_shape, rest_zero = rest(shape), rest((0,) * n)
    for sh in main:
        offset, chunk = sh[_OFFSET], sh[_CHUNK]
        if len(offset) != n or len(chunk) != n or offset[axis] != pos:
            return False
        if rest(offset) != rest_zero or rest(chunk) != rest_shape:
            return False
        pos += chunk[axis]
    return bool(pos == shape[axis])


def _tensor_key_problems_full(key: str, shards: list[tuple[int, ShardRecord]]) -> list[str]:
    """Every problem of one tensor key (the general check, for any layout)."""
    shapes = {(sh.global_shape, sh.dtype) for _, sh in shards}
    if len(shapes) > 1:
        by_rank = sorted({(r, sh.global_shape, sh.dtype) for r, sh in shards})
        detail = ", ".join(f"rank {r}: {s} {d}" for r, s, d in by_rank)
        return [f"'{key}': ranks disagree on global shape/dtype ({detail})"]
    global_shape = shards[0][1].global_shape
    main = [(r, sh) for r, sh in shards if sh.is_main]
    if not main:
        return [f"'{key}': no rank holds a main replica (replica_id 0)"]
    flat = [(r, sh) for r, sh in main if sh.flat is not None]
    blocks = [_Block(r, sh.global_offset, sh.chunk_shape) for r, sh in main if sh.flat is None]
    problems: list[str] = []
    if flat:
        flat_blocks, problems = _flat_blocks(key, flat)
        blocks += flat_blocks
    for b in blocks:
        if any(o + s > g for o, s, g in zip(b.offset, b.shape, global_shape)):
            problems.append(
                f"'{key}': rank {b.rank} block {b.describe()} lies outside global shape {global_shape}"
            )
    overlaps = _overlap_problems(key, blocks)
    problems += overlaps
    covered = _volume_inside(tuple(global_shape), blocks)
    if not overlaps and covered != math.prod(global_shape):
        problems.append(f"'{key}': {_gap_description(tuple(global_shape), blocks)}")
    return problems


def _object_key_problems(key: str, shards: list[tuple[int, ShardRecord]]) -> list[str]:
    shapes = {sh.global_shape for _, sh in shards}
    if len(shapes) > 1:
        return [f"'{key}': ranks disagree on the object grid shape {sorted(shapes)}"]
    owners: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for rank, sh in shards:
        if sh.is_main:
            owners[sh.global_offset].append(rank)
    problems = [
        f"'{key}': shard at offset {off} has {len(ranks)} main replicas (ranks {sorted(ranks)})"
        for off, ranks in sorted(owners.items())
        if len(ranks) > 1
    ]
    grid = shapes.pop()
    if len(owners) != math.prod(grid):
        missing = [off for off in np.ndindex(*grid) if tuple(int(i) for i in off) not in owners]
        problems.append(
            f"'{key}': {len(missing)} of {math.prod(grid)} object shards have no main replica "
            f"(e.g. offsets {[tuple(int(i) for i in m) for m in missing[:5]]})"
        )
    return problems


# The sections of the report, in the order they are listed.
_SECTION_MIXED, _SECTION_TENSOR, _SECTION_OBJECT = 0, 1, 2

# One key's problems, tagged so that reports computed by different ranks (each for
# the keys it owns) merge into exactly the report one rank would compute.
KeyProblems = tuple[int, str, list[str]]


def keyed_problems(global_metadata: Sequence[Sequence[Any]]) -> list[KeyProblems]:
    """:func:`sharding_integrity_problems` as ``(section, key, lines)`` per key with a
    problem (merge reports of disjoint key sets with :func:`merge_key_problems`).

    A rank's entries may be ShardedBase leaves, :class:`ShardRecord` s, or plain tuples
    of a record's fields in order (what the split check receives)."""
    tensors: dict[str, list[tuple[int, tuple[Any, ...]]]] = defaultdict(list)
    objects: dict[str, list[tuple[int, tuple[Any, ...]]]] = defaultdict(list)
    names: dict[str, str] = {}  # the stored name of each object shard -> its object key
    for rank, rank_metadata in enumerate(global_metadata):
        for sh in rank_metadata:
            kind = type(sh)
            if kind is not tuple and kind is not ShardRecord:
                if not isinstance(sh, (ShardedTensor, ShardedObject, ShardRecord)):
                    continue
                sh = shard_record(sh)
            key, is_tensor = sh[0], sh[1]
            if is_tensor:
                tensors[key].append((rank, sh))
            elif is_tensor is None:
                names[key] = sh[_DTYPE]
            else:
                objects[key].append((rank, sh))
                if sh[_MAIN]:  # the shards that are stored
                    names[stored_object_name(sh)] = key
    out: list[KeyProblems] = [
        (_SECTION_MIXED, key, [f"'{key}': used both as a ShardedTensor and as a ShardedObject"])
        for key in tensors.keys() & objects.keys()
    ]
    out += [
        (
            _SECTION_MIXED,
            name,
            [
                f"'{name}': a ShardedTensor key that is the stored name of ShardedObject "
                f"'{names[name]}' (one of its shards): one would overwrite the other"
            ],
        )
        for name in tensors.keys() & names.keys()
    ]
    for key, shards in tensors.items():
        if not _tiles_exactly(shards):
            out.append((_SECTION_TENSOR, key, _tensor_key_problems_full(key, _named(shards))))
    for key, shards in objects.items():
        out.append((_SECTION_OBJECT, key, _object_key_problems(key, _named(shards))))
    return [p for p in out if p[2]]


def _named(shards: list[tuple[int, tuple[Any, ...]]]) -> list[tuple[int, ShardRecord]]:
    make = ShardRecord._make
    return [(rank, sh if type(sh) is ShardRecord else make(sh)) for rank, sh in shards]


def merge_key_problems(parts: list[list[KeyProblems]]) -> list[str]:
    """One report from the keyed problems of disjoint key sets, one line each."""
    merged = sorted((p for part in parts for p in part), key=lambda p: (p[0], p[1]))
    return [line for _, _, lines in merged for line in lines]


def sharding_integrity_problems(global_metadata: GlobalMetadata) -> list[str]:
    """Every problem with the sharding described by all ranks' metadata, one line each.

    For each ShardedTensor key: all ranks agree on global shape and dtype, and
    the main replicas (flat ranges included) cover the global tensor exactly
    once. For each ShardedObject key: one main replica per shard of the grid.
    """
    return merge_key_problems([keyed_problems(global_metadata)])
