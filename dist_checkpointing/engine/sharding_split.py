"""The sharding-integrity check split by key over the ranks, and the structure digest
that lets an unchanged structure skip it.

Every key has one owner rank (:func:`key_owner`: a stable hash of the key modulo the
world size). Each rank sends each of its :class:`~.sharding_check.ShardRecord` s to
the owner of its key only (one all-to-all); each owner checks the keys it owns with
the same pure functions as the single-rank check (:func:`~.sharding_check.keyed_problems`);
one all-reduce of the problem count gives every rank the verdict, and only when
some key has a problem are the problem lines (text, not records) gathered, so every
rank raises the same :class:`~dist_checkpointing.errors.ShardingError`, word for word
the one a single rank checking everything would raise.

The keys of a checkpoint that no rank of a load requests (the ``*_ALL`` strict modes)
are found the same way: :func:`keys_nobody_requested`.

Cost per save, with ``T`` the records of a rank, ``W`` the ranks and ``K_r`` the
records sent to rank ``r``: each rank builds, hashes and pickles ``O(T + W)`` and
checks ``O(K_r)`` records; nothing is ``O(W x T)`` on any rank (an all-gather gave
every rank all ``W x T`` records). A key held by every rank still sends ``W``
records to its owner.

With a :class:`ValidatedStructure` (every save strategy keeps one:
``SaveShardedStrategy.validated_structure``), a rank whose records have the same digest
as at the last save every rank of the same group validated votes "unchanged"; when
every rank does (one all-reduce), the check is skipped: those records, with those
partners, passed it. Only a rank whose own records changed groups them by owner before
the vote. Loads check their request every time.
"""

from __future__ import annotations

import hashlib
import pickle
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import ShardingError
from .collectives import RankGroup, describe_error
from .sharding_check import (
    KeyProblems,
    ShardRecord,
    keyed_problems,
    merge_key_problems,
    sharding_integrity_problems,
    stored_object_name,
)

# A record on the wire: a ShardRecord as a plain tuple (pickles several times faster).
WireRecord = tuple[Any, ...]


@dataclass
class ValidatedStructure:
    """This rank's record digest at the last save whose sharding every rank validated
    (None: no such save yet). One per save strategy; pass it to every save."""

    digest: int | None = None


def key_owner(key: str, world: int) -> int:
    """The rank that checks ``key``: the same on every rank and in every process."""
    return zlib.crc32(key.encode("utf-8")) % world


def records_by_owner(records: Sequence[ShardRecord], world: int) -> list[list[WireRecord]]:
    """This rank's records as plain tuples, one list per owner rank (what rank ``r``
    receives is list ``r`` of every rank).

    Equal dtype names and shapes become one object, which pickle then sends once and
    refers to afterwards: a model's records share a few of each, and the exchange pickles
    and unpickles a third as many objects (about 4 -> 1 microsecond per record)."""
    out: list[list[WireRecord]] = [[] for _ in range(world)]
    owners: dict[str, list[WireRecord]] = {}
    one: dict[Any, Any] = {}
    same = one.setdefault
    for rec in records:
        key, is_tensor, dtype, shape, offset, chunk, flat, is_main = rec
        dest = owners.get(key)
        if dest is None:
            dest = owners[key] = out[key_owner(key, world)]
        if not is_tensor and is_main:  # the owner of its stored name checks no tensor has it
            name = stored_object_name(rec)
            out[key_owner(name, world)].append((name, None, key, (), (), (), None, is_main))
        dest.append(
            (
                key,
                is_tensor,
                same(dtype, dtype),
                same(shape, shape),
                same(offset, offset),
                same(chunk, chunk),
                flat,
                is_main,
            )
        )
    return out


def keys_nobody_requested(
    stored: Iterable[str], requested: Iterable[str], group: RankGroup
) -> set[str]:
    """The keys of ``stored`` (the same on every rank) that no rank of ``group`` has in
    its ``requested``: the same set on every rank (collective).

    Each rank sends each key it requests to the owner of the key (one all-to-all); each
    owner lists the stored keys it owns that nobody sent, and those lists (empty unless
    keys are missing) are all-gathered. ``O(T)`` per rank for ``T`` requested keys,
    where gathering every rank's request was ``O(W x T)``."""
    if not group.distributed:
        return set(stored) - set(requested)
    world = group.world
    out: list[list[str]] = [[] for _ in range(world)]
    for key in set(requested):
        out[key_owner(key, world)].append(key)
    seen = {key for part in group.all_to_all(out) for key in part}
    mine = sorted(k for k in set(stored) if k not in seen and key_owner(k, world) == group.rank)
    return {key for part in group.all_gather(mine) for key in part}


def owned_key_problems(received: Sequence[Sequence[WireRecord]]) -> list[KeyProblems]:
    """The problems of the keys this rank owns; ``received[r]`` came from rank ``r``
    (plain tuples: records are made only for the keys the quick test does not pass)."""
    return keyed_problems(received)


def structure_digest(
    records: Sequence[ShardRecord],
    rank: int,
    world: int,
    members: Sequence[int] | None = None,
) -> int:
    """A 63-bit digest of this rank's records, its rank, the world size and the global
    ranks of the group (``members``; default: the world, ranks ``0 .. world - 1``).

    Only ever compared with this process's own earlier digest, so it is Python's
    ``hash`` of the records (about 0.1 microsecond per record; strings are hashed with
    a key of this process): two different structures share a digest with a chance of
    about 2**-63. Records with a field that cannot be hashed fall back to a BLAKE2b of
    their pickle.
    """
    group = tuple(range(world)) if members is None else tuple(members)
    try:
        value = hash((tuple(records), rank, world, group))
    except TypeError:  # an unhashable field (e.g. a list where a tuple belongs)
        blob = pickle.dumps(([tuple(r) for r in records], rank, world, group), protocol=4)
        value = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little")
    return value & (2**63 - 1)


def raise_sharding_problems(problems: Sequence[str]) -> None:
    """Raise the :class:`ShardingError` that lists ``problems`` (if any)."""
    if problems:
        raise ShardingError(
            f"Invalid sharding ({len(problems)} problem(s)); every global tensor must be "
            "covered exactly once by main replicas (replica_id 0):\n  " + "\n  ".join(problems)
        )


def _owner_check(group: RankGroup, received: Sequence[Sequence[WireRecord]]) -> list[KeyProblems]:
    try:
        return owned_key_problems(received)
    except Exception as e:  # noqa: BLE001 - must reach the other ranks, not hang them
        return [
            (
                -1,
                "",
                [f"the sharding check itself failed on rank {group.rank}: {describe_error(e)}"],
            )
        ]


def validate_sharding_split(
    records: Sequence[ShardRecord],
    group: RankGroup,
    validated: ValidatedStructure | None = None,
    local_error: BaseException | None = None,
    *,
    ballot: Sequence[int] = (),
    what: str = "grouping shard records",
) -> list[int]:
    """Check the sharding of every rank's ``records``, each key on its owner rank
    (collective over ``group``; every rank raises the same :class:`ShardingError`).

    With ``validated``: skipped after one all-reduce when no rank's records changed
    since the last save every rank validated; updated after a passing check.
    ``local_error``: this rank failed before the check (its records are not to be
    used): raised on every rank in the check's first all-reduce. ``ballot``: ints of
    the caller's own (every rank passes as many), taken by that all-reduce: returned,
    each the largest any rank passed. ``what``: the operation a rank failure is reported
    for (:meth:`.RankGroup.fail_together`), where ``local_error`` is the caller's.
    """
    digest: int | None = None
    if local_error is not None and not group.distributed:
        raise local_error
    if not group.distributed:  # one rank: the same cache, no vote
        digest = None if validated is None else structure_digest(records, 0, 1, group.members)
        if validated is not None and validated.digest == digest:
            return list(ballot)
        raise_sharding_problems(sharding_integrity_problems([list(records)]))
        if validated is not None:
            validated.digest = digest
        return list(ballot)
    outgoing: list[list[WireRecord]] | None = None
    error: BaseException | None = local_error
    changed = True
    try:
        if error is None and validated is not None:
            digest = structure_digest(records, group.rank, group.world, group.members)
            changed = digest != validated.digest
        if error is None and changed:  # (unchanged records were grouped at the last check)
            outgoing = records_by_owner(records, group.world)
    except Exception as e:  # noqa: BLE001 - raised on every rank by fail_together
        error = e
    any_changed, *agreed = group.fail_together(
        error, what, [int(changed), *ballot], dist.ReduceOp.MAX
    )
    if any_changed == 0:
        return agreed
    if outgoing is None:  # this rank's records are unchanged, another rank's are not
        outgoing = records_by_owner(records, group.world)
    mine = _owner_check(group, group.all_to_all(outgoing))
    (count,) = group.all_reduce_ints([len(mine)])
    if count:
        raise_sharding_problems(merge_key_problems(group.all_gather(mine)))
    if validated is not None:
        validated.digest = digest
    return agreed


__all__ = [
    "ValidatedStructure",
    "WireRecord",
    "key_owner",
    "keys_nobody_requested",
    "owned_key_problems",
    "raise_sharding_problems",
    "records_by_owner",
    "structure_digest",
    "validate_sharding_split",
]
