"""Validation of sharded state dicts (Megatron-Core's module path): load strictness
and sharding integrity.

The strict-key checks are pure functions over metadata (lists of data-less
:class:`~dist_checkpointing.mapping.ShardedBase` per rank); the coverage checks
live in :mod:`dist_checkpointing.engine.sharding_check`. The thin collective
wrappers gather that metadata and make every rank raise the same error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from collections.abc import Iterable, Sequence
from enum import Enum

import torch.distributed as dist

from ._integrity_api import INTEGRITY_FNAME as INTEGRITY_FNAME
from ._integrity_api import save_integrity_manifest as save_integrity_manifest
from ._integrity_api import verify_checkpoint as verify_checkpoint
from ._integrity_api import verify_integrity_manifest as verify_integrity_manifest
from .core import CheckpointingConfig, maybe_load_config
from .dict_utils import diff, extract_matching_values, nested_values
from .engine import knobs
from .engine.checkpoint import commit, integrity, reading
from .engine.collectives import RankGroup, describe_error
from .engine.sharding_check import (
    GlobalMetadata,
    ShardRecord,
    shard_record,
    sharding_integrity_problems,
)
from .engine.sharding_split import raise_sharding_problems
from .engine.storage.location import CheckpointDir
from .errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    KeyMismatchError,
)
from .mapping import CommonStateDict, ShardedBase, ShardedStateDict, is_sharded_base
from .strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    expect_strategy,
    registered_strategies,
    resolve_strategy,
)

logger = logging.getLogger(__name__)

LocalMetadata = list[ShardedBase]


CkptShardedMetadata = dict[str, ShardedBase]


class StrictHandling(Enum):
    """What ``load`` does about keys that differ between the request and the checkpoint.

    *Unexpected* keys are requested by this rank but absent from the checkpoint;
    *missing* keys are in the checkpoint but requested by no rank (computing them
    takes collectives: each requested key goes to its owner rank, and the owners' lists
    of missing keys are gathered; only the ``*_ALL`` modes do it).

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
        """Whether the mode needs what every rank requests (to compute missing keys)."""
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


def validate_sharding_integrity(
    global_metadata: GlobalMetadata, common_state_dict: CommonStateDict | None = None
) -> None:
    """Raise :class:`ShardingError` listing every sharding problem (see
    :func:`sharding_integrity_problems`).

    With ``common_state_dict`` (Megatron-Core's second parameter) first compare the
    common state across the world and warn where it differs
    (:func:`validate_common_state_dict`; collective).
    """
    if common_state_dict is not None:
        validate_common_state_dict(common_state_dict)
    validate_sharding_integrity_from_problems(sharding_integrity_problems(global_metadata))


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
    """Raise :class:`KeyMismatchError` (or log a warning) listing the mismatched keys.

    The message starts with Megatron-Core's wording (users' tooling greps for
    "Missing keys" and "Unexpected keys"), then says what to do.
    """
    if not missing_keys and not unexpected_keys:
        return
    title, body = "", ""
    if missing_keys:
        title += (
            "Some keys found in the checkpoint are missing in the provided sharded state dict. "
        )
        body += f"Missing keys (for all ranks): {sorted(missing_keys)}. "
    if unexpected_keys:
        title += (
            "Unexpected keys (not found in the checkpoint) encountered in the provided "
            "sharded state dict. "
        )
        body += f"Unexpected keys (for this rank): {sorted(unexpected_keys)}. "
    msg = (
        f"{title}\n{body}\nMissing keys are in the checkpoint but requested by no rank; "
        "unexpected keys are requested by this rank but absent from the checkpoint. Choose "
        "another `strict` mode (see StrictHandling) to log, return or ignore them."
    )
    if raise_error:
        raise KeyMismatchError(msg)
    logger.warning(msg)


def drop_keys(sharded_state_dict: ShardedStateDict, keys: set[str]) -> ShardedStateDict:
    """The sharded state dict without the ShardedBase leaves whose key is in ``keys``."""
    if not keys:
        return sharded_state_dict
    _, kept = extract_matching_values(
        sharded_state_dict, lambda x: is_sharded_base(x) and x.key in keys
    )
    return kept  # type: ignore[return-value]


def apply_strict_handling(
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    ckpt_sharded_metadata: CkptShardedMetadata,
    local_metadata: LocalMetadata,
    global_metadata: GlobalMetadata | None,
    *,
    missing_keys: set[str] | None = None,
) -> tuple[ShardedStateDict, set[str], set[str]]:
    """Apply a strict mode: returns the request to load and the missing/unexpected keys
    (``missing_keys``: found without ``global_metadata``, by key owners)."""
    if not StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        return sharded_state_dict, set(), set()
    if not StrictHandling.requires_global_app_metadata(strict):
        global_metadata = missing_keys = None
    missing, unexpected = determine_missing_and_unexpected_keys(
        ckpt_sharded_metadata, local_metadata, global_metadata
    )
    if missing_keys is not None:
        missing = set(missing_keys)
    if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
        report_missing_and_unexpected_keys(missing, unexpected, raise_error=True)
    elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
        report_missing_and_unexpected_keys(missing, unexpected, raise_error=False)
    sharded_state_dict = drop_keys(sharded_state_dict, unexpected)
    if strict == StrictHandling.IGNORE_ALL:
        missing, unexpected = set(), set()
    return sharded_state_dict, missing, unexpected


def local_metadata_of(sharded_state_dict: ShardedStateDict) -> LocalMetadata:
    """The data-less ShardedBase leaves of a sharded state dict."""
    return [sh.without_data() for sh in nested_values(sharded_state_dict) if is_sharded_base(sh)]


def local_shard_records(sharded_state_dict: ShardedStateDict) -> list[ShardRecord]:
    """This rank's :class:`ShardRecord` s (no communication)."""
    return [shard_record(sh) for sh in nested_values(sharded_state_dict) if is_sharded_base(sh)]


def gather_shard_records(
    sharded_state_dict: ShardedStateDict, process_group: dist.ProcessGroup | None = None
) -> tuple[list[ShardRecord], list[list[ShardRecord]]]:
    """This rank's and every rank's :class:`ShardRecord` s (an ``all_gather_object``
    of plain tuples: the fast form of :func:`determine_global_metadata`)."""
    local = local_shard_records(sharded_state_dict)
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
    raise_sharding_problems(problems)


def adjust_non_strict_load(
    sharded_state_dict: ShardedStateDict, sharded_keys_to_remove: set[str]
) -> ShardedStateDict:
    """The request without the leaves whose key is in ``sharded_keys_to_remove``
    (Megatron-Core's name for :func:`drop_keys`)."""
    return drop_keys(sharded_state_dict, sharded_keys_to_remove)


def maybe_report_missing_and_unexpected_keys(
    missing_keys: set[str], unexpected_keys: set[str], raise_error: bool = True
) -> None:
    """Megatron-Core's name for :func:`report_missing_and_unexpected_keys`."""
    report_missing_and_unexpected_keys(missing_keys, unexpected_keys, raise_error)


def validate_sharded_objects_handling(
    sharded_strategy: SaveShardedStrategy | LoadShardedStrategy,
    common_strategy: SaveCommonStrategy | LoadCommonStrategy,
) -> None:
    """Raise unless one of the two strategies saves/loads ShardedObjects."""
    if not (
        sharded_strategy.can_handle_sharded_objects or common_strategy.can_handle_sharded_objects
    ):
        raise CheckpointingException(
            f"Either sharded strategy or common strategy must implement ShardedObjects handling. "
            f"Both {sharded_strategy} and {common_strategy} specify can_handle_sharded_objects=False"
        )


def pickled_common_state(common_state_dict: CommonStateDict) -> bytes | str:
    """The common state as :func:`validate_common_state_dict` compares it: pickled
    here, not inside a collective, so that a value one rank cannot pickle is compared
    as the error it raised (a string) instead of leaving the other ranks waiting."""
    try:
        return pickle.dumps(common_state_dict, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - reported as a difference, never a hang
        return f"<common state that cannot be pickled: {type(exc).__name__}: {exc}>"


def common_state_digest(pickled: bytes | str) -> int:
    """A 63-bit digest of :func:`pickled_common_state`'s result: where every rank's is
    the same, so is every rank's pickled common state (but for a 2**-63 chance)."""
    data = pickled if isinstance(pickled, bytes) else pickled.encode("utf-8", "replace")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def validate_common_state_dict(
    common_state_dict: CommonStateDict,
    process_group: dist.ProcessGroup | None = None,
    *,
    pickled: bytes | str | None = None,
) -> None:
    """Warn (on the first rank) where other ranks' common state differs from its own.

    Collective over ``process_group`` (one gather to the first rank). The first
    rank's common state is the one saved; the warning keeps Megatron-Core's wording,
    then says what each entry holds. ``pickled``: :func:`pickled_common_state` of
    ``common_state_dict``, where the caller has it. A save gathers only where the
    ranks' digests differ (:func:`~.state_dict_utils.save_preprocess`).
    """
    group = RankGroup(process_group)
    if not group.distributed:
        return
    blob = pickled_common_state(common_state_dict) if pickled is None else pickled
    gathered = group.gather(blob)
    if gathered is None:
        return
    # The ranks of this job, as in gather_object.
    states = [pickle.loads(b) if isinstance(b, bytes) else b for b in gathered]
    differences = {}
    for rank, other in enumerate(states[1:], start=1):
        only_first, only_other, mismatch = diff(states[0], other)
        if only_first or only_other or mismatch:
            differences[rank] = (only_first, only_other, mismatch)
    if differences:
        logger.warning(
            "There is difference in the common state dict in different ranks. The differences "
            "are %s (per rank: keys only on rank 0, keys only on that rank, keys whose values "
            "differ; rank 0's common state is the one saved)",
            differences,
        )


def validate_integrity_and_strict_load(
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    local_metadata: LocalMetadata | None = None,
    global_metadata: GlobalMetadata | None = None,
    ckpt_sharded_metadata: CkptShardedMetadata | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    missing_keys: set[str] | None = None,
) -> tuple[ShardedStateDict, set[str], set[str]]:
    """Check the request against the checkpoint per ``strict`` and validate its sharding.

    Collective over ``process_group``: a key mismatch that raises on one rank raises
    on every rank (:class:`~dist_checkpointing.errors.RankFailureError` on the
    others), and the sharding check runs once with every rank raising its verdict.
    ``missing_keys``: the checkpoint's keys no rank requests, found by key owners
    (:func:`.sharding_split.keys_nobody_requested`) instead of from ``global_metadata``.

    Returns:
        The request without unexpected keys, and the missing and unexpected keys.

    Raises:
        CheckpointingException: a strict mode needs ``ckpt_sharded_metadata`` or
            the sharding check needs ``global_metadata``, and it was not given.
    """
    missing: set[str] = set()
    unexpected: set[str] = set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        if ckpt_sharded_metadata is None:
            raise CheckpointingException(
                f"strict={strict.value!r} compares the request with the checkpoint, "
                "but no ckpt_sharded_metadata was given"
            )
        if local_metadata is None:
            local_metadata = local_metadata_of(sharded_state_dict)
        error: Exception | None = None
        try:
            sharded_state_dict, missing, unexpected = apply_strict_handling(
                sharded_state_dict,
                strict,
                ckpt_sharded_metadata,
                local_metadata,
                global_metadata,
                missing_keys=missing_keys,
            )
        except Exception as e:  # noqa: BLE001 - a key mismatch on one rank fails every rank
            error = e
        RankGroup(process_group).fail_together(error, "Checking the requested keys")
    if validate_access_integrity:
        if global_metadata is None:
            raise CheckpointingException(
                "validate_access_integrity needs the global metadata of every rank"
            )
        validate_sharding_integrity_on_all_ranks(global_metadata, process_group)
    return sharded_state_dict, missing, unexpected


# --------------------------------------------------------------------------- checkpoint


def _holds_checkpoint_files(names: list[str]) -> bool:
    """Whether any of ``names`` is a file some registered format (or the integrity
    manifest) writes: the sign of a save that never finished."""
    save_strategies = [
        s for (action, _, _), s in registered_strategies().items() if action.startswith("save")
    ]
    return any(
        n == integrity.INTEGRITY_FNAME
        or commit.is_protocol_file(n)
        or any(s.owns_file(n) for s in save_strategies)
        for n in names
    )


def _require_config(ckpt: CheckpointDir, verify_checksums: bool | None) -> CheckpointingConfig:
    ckpt.require_dir()
    if verify_checksums is None:
        verify_checksums = bool(knobs.VERIFY_CHECKSUMS.get())
    if reading.open_for_read(ckpt, verify_checksums) is None:
        logger.info("%s has no commit record: checksum verification is unavailable", ckpt)
    config = maybe_load_config(ckpt)
    if config is not None:
        return config
    if _holds_checkpoint_files(ckpt.listdir()):
        raise IncompleteCheckpointError(
            f"{ckpt} holds an incomplete checkpoint: {commit.COMMIT_MARKER} is missing, so "
            "its save never finished (or is still being finalized)"
        )
    raise CheckpointNotFoundError(
        f"{ckpt} is not a distributed checkpoint (no {commit.COMMIT_MARKER})"
    )


def verify_checkpoint_and_load_strategy(
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
    *,
    verify_checksums: bool | None = None,
) -> tuple[LoadShardedStrategy, LoadCommonStrategy]:
    """Check ``checkpoint_dir`` is a complete checkpoint and pick compatible strategies.

    With a commit record (see :mod:`.engine.checkpoint.commit`), every file and
    item read afterwards through the same handle is checked against its recorded
    checksums, unless ``verify_checksums`` is False (default: the
    ``VERIFY_CHECKSUMS`` knob, on).

    Raises:
        CheckpointNotFoundError: no directory, or no checkpoint in it.
        IncompleteCheckpointError: a save that never finished.
        StrategyNotFoundError / IncompatibleStrategyError: no strategy fits.
    """
    config = _require_config(CheckpointDir.of(checkpoint_dir), verify_checksums)
    sharded = resolve_strategy(
        sharded_strategy,
        (config.sharded_backend, config.sharded_backend_version),
        StrategyAction.LOAD_SHARDED,
    )
    common = resolve_strategy(
        common_strategy,
        (config.common_backend, config.common_backend_version),
        StrategyAction.LOAD_COMMON,
    )
    sharded = expect_strategy(sharded, LoadShardedStrategy)
    common = expect_strategy(common, LoadCommonStrategy)
    sharded.check_backend_compatibility(config.sharded_backend)
    sharded.check_version_compatibility(config.sharded_backend_version)
    common.check_backend_compatibility(config.common_backend)
    common.check_version_compatibility(config.common_backend_version)
    return sharded, common
