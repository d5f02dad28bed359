"""Validation of sharded state dicts: sharding integrity and load strictness.

The checks are pure functions over metadata (lists of data-less
:class:`~dist_checkpointing.mapping.ShardedBase` per rank), so multi-rank
logic can be tested in one process; the thin collective wrappers at the end
gather that metadata and make every rank raise the same error.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import numpy as np
import torch.distributed as dist

from .dict_utils import extract_matching_values, nested_values
from .engine.collectives import RankGroup, describe_error
from .errors import InvalidArgumentError, KeyMismatchError, ShardingError
from .mapping import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)

logger = logging.getLogger(__name__)

LocalMetadata = list[ShardedBase]
# Per rank, the ShardedBase leaves or their ShardRecords (the checks accept both).
GlobalMetadata = list[list]
CkptShardedMetadata = dict[str, ShardedBase]

# Above this many elements a key's coverage error is described by volume only
# (describing the exact gaps needs a per-element count array).
_MAX_ELEMENTS_FOR_GAP_REPORT = 1 << 22


class StrictHandling(Enum):
    """What ``load`` does about keys that differ between the request and the checkpoint.

    *Unexpected* keys are requested by this rank but absent from the checkpoint;
    *missing* keys are in the checkpoint but requested by no rank (computing them
    needs a gather of every rank's request, so only the ``*_ALL`` modes do it).

    - ``ASSUME_OK_UNEXPECTED``: no check (an unexpected key fails later, at read time).
    - ``LOG_UNEXPECTED`` / ``LOG_ALL``: log them, skip unexpected keys.
    - ``RAISE_UNEXPECTED`` / ``RAISE_ALL``: raise :class:`KeyMismatchError`.
    - ``RETURN_UNEXPECTED`` / ``RETURN_ALL``: ``load`` also returns the key sets.
    - ``IGNORE_ALL``: skip unexpected keys silently.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: StrictHandling) -> bool:
        """Whether the mode compares the request against the checkpoint's keys."""
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: StrictHandling) -> bool:
        """Whether the mode needs every rank's request (to compute missing keys)."""
        return val in (
            StrictHandling.IGNORE_ALL,
            StrictHandling.RAISE_ALL,
            StrictHandling.RETURN_ALL,
            StrictHandling.LOG_ALL,
        )

    @staticmethod
    def requires_returning_mismatch_keys(val: StrictHandling) -> bool:
        """Whether ``load`` returns ``(state_dict, missing_keys, unexpected_keys)``."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: str | StrictHandling) -> StrictHandling:
    """A :class:`StrictHandling` from itself or its string value (e.g. ``"raise_all"``)."""
    if isinstance(strict, StrictHandling):
        return strict
    if isinstance(strict, str):
        try:
            return StrictHandling(strict.lower())
        except ValueError:
            pass
    options = ", ".join(repr(s.value) for s in StrictHandling)
    raise InvalidArgumentError(f"Invalid strict flag {strict!r}; expected one of {options}")


# --------------------------------------------------------------------------- sharding


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
    is_tensor: bool
    dtype: str  # "" for objects
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    chunk_shape: tuple[int, ...]  # the block in global coordinates; () for objects
    flat: tuple[int, int] | None  # the flattened range, if any
    is_main: bool


def shard_record(sh: ShardedBase | ShardRecord) -> ShardRecord:
    """The :class:`ShardRecord` of a ShardedTensor or ShardedObject."""
    if isinstance(sh, ShardRecord):
        return sh
    if isinstance(sh, ShardedTensor):
        fr = sh.flattened_range
        return ShardRecord(
            sh.key,
            True,
            str(sh.dtype),
            tuple(sh.global_shape),
            tuple(sh.global_offset),
            (1,) * sh.prepend_axis_num + tuple(sh.local_shape),
            None if fr is None else (fr.start, fr.stop),
            is_main_replica(sh.replica_id),
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


def _tensor_key_problems(key: str, shards: list[tuple[int, ShardRecord]]) -> list[str]:
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


def sharding_integrity_problems(global_metadata: GlobalMetadata) -> list[str]:
    """Every problem with the sharding described by all ranks' metadata, one line each.

    For each ShardedTensor key: all ranks agree on global shape and dtype, and
    the main replicas (flat ranges included) cover the global tensor exactly
    once. For each ShardedObject key: one main replica per shard of the grid.
    """
    tensors: dict[str, list[tuple[int, ShardRecord]]] = defaultdict(list)
    objects: dict[str, list[tuple[int, ShardRecord]]] = defaultdict(list)
    for rank, rank_metadata in enumerate(global_metadata):
        for sh in rank_metadata:
            if not isinstance(sh, (ShardedTensor, ShardedObject, ShardRecord)):
                continue
            rec = shard_record(sh)
            (tensors if rec.is_tensor else objects)[rec.key].append((rank, rec))
    problems = [
        f"'{key}': used both as a ShardedTensor and as a ShardedObject"
        for key in sorted(tensors.keys() & objects.keys())
    ]
    for key in sorted(tensors):
        problems += _tensor_key_problems(key, tensors[key])
    for key in sorted(objects):
        problems += _object_key_problems(key, objects[key])
    return problems


def validate_sharding_integrity(global_metadata: GlobalMetadata) -> None:
    """Raise :class:`ShardingError` listing every sharding problem (see
    :func:`sharding_integrity_problems`)."""
    validate_sharding_integrity_from_problems(sharding_integrity_problems(global_metadata))


# --------------------------------------------------------------------------- keys


def determine_missing_and_unexpected_keys(
    ckpt_sharded_metadata: CkptShardedMetadata,
    local_metadata: Iterable[ShardedBase],
    global_metadata: GlobalMetadata | None = None,
) -> tuple[set[str], set[str]]:
    """``(missing, unexpected)`` keys of a load request against a checkpoint.

    Unexpected keys are requested here but absent from the checkpoint (they can
    differ between ranks); missing keys are in the checkpoint but requested by
    no rank (empty when ``global_metadata`` is None).
    """
    ckpt_keys = {sh.key for sh in ckpt_sharded_metadata.values()}
    unexpected = {sh.key for sh in local_metadata} - ckpt_keys
    missing: set[str] = set()
    if global_metadata is not None:
        requested = {sh.key for rank_md in global_metadata for sh in rank_md}
        missing = ckpt_keys - requested
    return missing, unexpected


def report_missing_and_unexpected_keys(
    missing_keys: set[str], unexpected_keys: set[str], raise_error: bool = True
) -> None:
    """Raise :class:`KeyMismatchError` (or log a warning) listing the mismatched keys."""
    if not missing_keys and not unexpected_keys:
        return
    parts = []
    if missing_keys:
        parts.append(
            "keys in the checkpoint that no rank requested (missing, all ranks): "
            f"{sorted(missing_keys)}"
        )
    if unexpected_keys:
        parts.append(
            "requested keys absent from the checkpoint (unexpected, this rank): "
            f"{sorted(unexpected_keys)}"
        )
    msg = "Load request does not match the checkpoint: " + "; ".join(parts)
    if raise_error:
        raise KeyMismatchError(msg)
    logger.warning(msg)


def drop_keys(sharded_state_dict: ShardedStateDict, keys: set[str]) -> ShardedStateDict:
    """The sharded state dict without the ShardedBase leaves whose key is in ``keys``."""
    if not keys:
        return sharded_state_dict
    _, kept = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedBase) and x.key in keys
    )
    return kept  # type: ignore[return-value]


def apply_strict_handling(
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    ckpt_sharded_metadata: CkptShardedMetadata,
    local_metadata: LocalMetadata,
    global_metadata: GlobalMetadata | None,
) -> tuple[ShardedStateDict, set[str], set[str]]:
    """Apply a strict mode: returns the request to load and the missing/unexpected keys."""
    if not StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        return sharded_state_dict, set(), set()
    if not StrictHandling.requires_global_app_metadata(strict):
        global_metadata = None
    missing, unexpected = determine_missing_and_unexpected_keys(
        ckpt_sharded_metadata, local_metadata, global_metadata
    )
    if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
        report_missing_and_unexpected_keys(missing, unexpected, raise_error=True)
    elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
        report_missing_and_unexpected_keys(missing, unexpected, raise_error=False)
    sharded_state_dict = drop_keys(sharded_state_dict, unexpected)
    if strict == StrictHandling.IGNORE_ALL:
        missing, unexpected = set(), set()
    return sharded_state_dict, missing, unexpected


# --------------------------------------------------------------------------- collectives


def local_metadata_of(sharded_state_dict: ShardedStateDict) -> LocalMetadata:
    """The data-less ShardedBase leaves of a sharded state dict."""
    return [
        sh.without_data() for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedBase)
    ]


def gather_shard_records(
    sharded_state_dict: ShardedStateDict, process_group: dist.ProcessGroup | None = None
) -> tuple[list[ShardRecord], list[list[ShardRecord]]]:
    """This rank's and every rank's :class:`ShardRecord` s (an ``all_gather_object``
    of plain tuples: the fast form of :func:`determine_global_metadata`)."""
    local = [
        shard_record(sh) for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedBase)
    ]
    group = RankGroup(process_group)
    if not group.distributed:
        return local, [local]
    gathered = group.all_gather([tuple(r) for r in local])
    return local, [[ShardRecord(*t) for t in rank_records] for rank_records in gathered]


def determine_global_metadata(
    sharded_state_dict: ShardedStateDict, process_group: dist.ProcessGroup | None = None
) -> tuple[LocalMetadata, GlobalMetadata]:
    """This rank's and every rank's metadata (an ``all_gather_object``)."""
    local = local_metadata_of(sharded_state_dict)
    return local, RankGroup(process_group).all_gather(local)


def validate_sharding_integrity_on_all_ranks(
    global_metadata: GlobalMetadata, process_group: dist.ProcessGroup | None = None
) -> None:
    """Check the sharding on the first rank of the group; every rank raises the same error."""
    group = RankGroup(process_group)
    problems: list[str] | None = None
    if group.is_coordinator:
        try:
            problems = sharding_integrity_problems(global_metadata)
        except Exception as e:  # noqa: BLE001 - must reach the other ranks, not hang them
            problems = [f"the sharding check itself failed: {describe_error(e)}"]
    problems = group.broadcast(problems)
    if problems:
        validate_sharding_integrity_from_problems(problems)


def validate_sharding_integrity_from_problems(problems: Sequence[str]) -> None:
    """Raise the :class:`ShardingError` for already computed problems."""
    if problems:
        raise ShardingError(
            f"Invalid sharding ({len(problems)} problem(s)); every global tensor must be "
            "covered exactly once by main replicas (replica_id 0):\n  " + "\n  ".join(problems)
        )
