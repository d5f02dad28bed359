"""Saving and loading sharded state dicts: the library's entry points.

Megatron-Core's ``dist_checkpointing.serialization`` API (the 0.12-0.15
design with a strategy registry and ``common.pt``), also accepting the
parameters 0.16-0.19 added (``async_strategy``, ``verify_integrity``,
``content_metadata``) so code written for either release runs unchanged.

Each entry point resolves ``checkpoint_dir`` once into a
:class:`~dist_checkpointing.engine.storage.location.CheckpointDir` and reads as
a short recipe; preprocessing is in :mod:`.state_dict_utils`, the commit
protocol in :mod:`.engine.checkpoint.commit`, the strategies (which know their
file names) in :mod:`.strategies`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ._accounting import OpAccount, tensor_bytes
from ._load_steps import (
    OpenedLoad,
    check_files_read,
    check_sharding,
    keys_of,
    metadata_files,
    open_load,
    verdict_in_sharding_check,
)
from ._save_steps import (
    finalize_save,
    open_for_save,
    save_common_part,
    save_opening,
    write_sharded,
)
from .dict_utils import merge
from .engine.checkpoint import commit, integrity
from .engine.collectives import ProcessGroup, RankGroup
from .engine.process import gc_paused
from .engine.sharding_split import keys_nobody_requested, validate_sharding_split
from .engine.storage.location import CheckpointDir
from .errors import (
    CheckpointingException,
)
from .mapping import (
    CommonStateDict,
    ShardedStateDict,
    StateDict,
    apply_factory_merges,
)
from .state_dict_utils import save_preprocess
from .strategies.async_utils import AsyncRequest
from .strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    allow_types,
    expect_strategy,
    get_default_strategy,
)
from .validation import (
    CkptShardedMetadata,
    StrictHandling,
    local_shard_records,
    validate_integrity_and_strict_load,
    verify_checkpoint_and_load_strategy,
)

logger = logging.getLogger(__name__)

CONTENT_METADATA_KEY = "content_metadata"

__all__ = [
    "save",
    "load",
    "load_common_state_dict",
    "load_tensors_metadata",
    "load_sharded_metadata",
    "load_plain_tensors",
    "load_content_metadata",
    "remove_sharded_tensors",
    "get_default_save_sharded_strategy",
    "get_default_save_common_strategy",
    "get_default_load_sharded_strategy",
    "verify_checkpoint_and_load_strategy",
    "CkptShardedMetadata",
]

_F = TypeVar("_F", bound=Callable[..., Any])

# --------------------------------------------------------------------------- strategies


def get_default_save_sharded_strategy(
    backend: str = "torch_dist", version: int = 1
) -> SaveShardedStrategy:
    """The registered default sharded save strategy for ``(backend, version)``."""
    strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)
    return expect_strategy(strategy, SaveShardedStrategy)


def get_default_save_common_strategy(
    backend: str = "torch", version: int = 1
) -> SaveCommonStrategy:
    """The registered default common save strategy for ``(backend, version)``."""
    strategy = get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)
    return expect_strategy(strategy, SaveCommonStrategy)


def get_default_load_sharded_strategy(
    checkpoint_dir: str | os.PathLike[str],
) -> LoadShardedStrategy:
    """The sharded load strategy for the checkpoint in ``checkpoint_dir``."""
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]


def _gc_paused_call(fn: _F) -> _F:
    """Run ``fn`` with the cyclic GC paused (see :func:`engine.process.gc_paused`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------------- save


@_gc_paused_call
def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: SaveShardedStrategy | tuple[str, int] | None = None,
    common_strategy: SaveCommonStrategy | tuple[str, int] | None = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Callable[[CommonStateDict], StateDict]
    | None = None,
    content_metadata: dict[str, Any] | None = None,
    *,
    async_strategy: str | None = None,
    verify_integrity: bool = False,
    process_group: ProcessGroup = None,
) -> AsyncRequest | None:
    """Save a sharded state dict to ``checkpoint_dir`` (collective: every rank calls it).

    Steps:
        1. apply ShardedTensorFactories, drop LocalNonpersistentObjects, split the
           sharded part (ShardedTensor/ShardedObject leaves) from the common part;
        2. validate that every global tensor is covered exactly once by main
           replicas (every rank raises the same error otherwise) and, in the same
           vote, begin the commit protocol (save lock, staged names: an existing
           checkpoint stays loadable); save the common part (``common.pt``);
        3. write the shards (in the background with ``async_sharded_save``);
        4. finalize: ``commit.json`` commits the save (``docs/format.rst``).

    Args:
        sharded_state_dict: the state dict with ShardedBase leaves.
        checkpoint_dir: an existing (preferably empty) directory.
        sharded_strategy: a SaveShardedStrategy or ``(backend, version)``.
        common_strategy: a SaveCommonStrategy or ``(backend, version)``.
        validate_access_integrity: check the sharding before saving.
        async_sharded_save: return an :class:`AsyncRequest` instead of writing now;
            schedule it on an ``AsyncCallsQueue`` and finalize it on every rank.
        preprocess_common_before_consistancy_check: (sic: Megatron-Core's spelling)
            applied to the common state before it is compared across ranks.
        async_strategy: Megatron-Core 0.19's choice of async writer: ``"mcore"``
            (or None) selects ours; ``"nvrx"`` is not supported.
        verify_integrity: record a sha256 of every file written (``integrity.json``).
        content_metadata: a dict stored with the common state, read back by
            :func:`load_content_metadata`.
        process_group: the ranks that save this checkpoint together (default: the
            world); default strategies are bound to it.

    Returns:
        The AsyncRequest with ``async_sharded_save=True``, else None.
    """
    group = RankGroup(process_group)
    sharded, common, ckpt = open_for_save(
        checkpoint_dir,
        (sharded_strategy, common_strategy),
        async_sharded_save,
        async_strategy,
        validate_access_integrity,
        process_group,
    )
    account = OpAccount(logger, "save", ckpt, group.rank)
    extra = {} if content_metadata is None else {CONTENT_METADATA_KEY: content_metadata}
    opening = save_opening(ckpt, sharded, common, group, verify_integrity, extra)
    with account.phase("validate"):
        sharded_part, common_part = save_preprocess(
            sharded_state_dict, validate_access_integrity,
            preprocess_common_before_consistancy_check, process_group,
            sharded.validated_structure, opening=opening,
        )  # fmt: skip
    finalize = functools.partial(
        finalize_save, ckpt, sharded, common, verify_integrity, group, account
    )
    try:
        if opening.first_writes is None:  # else written before the vote, by the coordinator
            with account.phase("common"):
                sharded_part = save_common_part(
                    ckpt, sharded, common, sharded_part, common_part | extra, group)  # fmt: skip
        return write_sharded(
            ckpt, sharded, sharded_part, finalize, group, account, async_sharded_save
        )
    except BaseException:
        commit.abort(ckpt, group)
        raise


# --------------------------------------------------------------------------- load


@_gc_paused_call
def load_common_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
    *,
    verify_checksums: bool | None = None,
    allowed_types: Sequence[type] = (),
) -> StateDict:
    """The common (non-sharded) state of the checkpoint; ``allowed_types`` and
    ``verify_checksums`` as in :func:`load`."""
    ckpt = CheckpointDir.of(checkpoint_dir)
    _, common = verify_checkpoint_and_load_strategy(
        ckpt, common_strategy=common_strategy, verify_checksums=verify_checksums
    )
    return allow_types(common, allowed_types).load_common(ckpt)


def load_content_metadata(
    checkpoint_dir: str | os.PathLike[str] | None = None,
    *,
    preloaded_state_dict: StateDict | None = None,
) -> dict[str, Any] | None:
    """The ``content_metadata`` given to :func:`save`, or None."""
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise CheckpointingException(
                "load_content_metadata needs checkpoint_dir or a state dict"
            )
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(CONTENT_METADATA_KEY)


@_gc_paused_call
def load_tensors_metadata(
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    *,
    verify_checksums: bool | None = None,
) -> ShardedStateDict:
    """Data-less ShardedTensors (global shape, dtype) of every stored tensor, by key."""
    ckpt = CheckpointDir.of(checkpoint_dir)
    strategy, _ = verify_checkpoint_and_load_strategy(
        ckpt, sharded_strategy, verify_checksums=verify_checksums
    )
    return strategy.load_tensors_metadata(ckpt)


@_gc_paused_call
def load_sharded_metadata(
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
    *,
    verify_checksums: bool | None = None,
) -> ShardedStateDict:
    """Data-less ShardedTensors by key and ShardedObjects by unique key."""
    ckpt = CheckpointDir.of(checkpoint_dir)
    strategy, common = verify_checkpoint_and_load_strategy(
        ckpt, sharded_strategy, common_strategy, verify_checksums=verify_checksums
    )
    metadata = strategy.load_sharded_metadata(ckpt)
    if not strategy.can_handle_sharded_objects:
        merge(metadata, common.load_sharded_metadata(ckpt))
    return metadata


@_gc_paused_call
def load_plain_tensors(
    checkpoint_dir: str | os.PathLike[str], *, verify_checksums: bool | None = None
) -> StateDict:
    """Every stored tensor, whole, by key (every rank loads everything)."""
    ckpt = CheckpointDir.of(checkpoint_dir)
    request = load_tensors_metadata(ckpt, verify_checksums=verify_checksums)
    return load(  # type: ignore[return-value]
        request, ckpt, validate_access_integrity=False, verify_checksums=verify_checksums
    )


@_gc_paused_call
def remove_sharded_tensors(checkpoint_dir: str | os.PathLike[str], key_prefix: str) -> None:
    """Remove the tensors whose key starts with ``key_prefix`` (run on one rank).

    Crash-safe: the new ``.metadata`` is committed (with the commit record, when
    the checkpoint has one) before any data file is deleted.
    """
    ckpt = CheckpointDir.of(checkpoint_dir)
    strategy, _ = verify_checkpoint_and_load_strategy(ckpt)
    strategy.remove_sharded_tensors(ckpt, key_prefix)
    # The manifest covers .metadata, which was rewritten, and the deleted data files.
    integrity.refresh_manifest(ckpt, metadata_files(ckpt, strategy))


def _validate_load(
    ckpt: CheckpointDir,
    opened: OpenedLoad | None,
    error: BaseException | None,
    strict: StrictHandling | str,
    validate_access_integrity: bool,
    verify_integrity: bool,
    group: RankGroup,
) -> tuple[OpenedLoad, set[str], set[str]]:
    """(Collective) The load's first verdict (``error``: this rank failed to open it),
    in the sharding check's first all-reduce where the mode allows, then the request's
    checks per ``strict``: ``opened`` with the request to read, and the missing and
    unexpected keys."""
    folded = verdict_in_sharding_check(strict, validate_access_integrity)
    if folded:
        request = {} if opened is None else opened.request
        check_sharding(request, error, group, f"Loading {ckpt}")
    else:
        group.fail_together(error, f"Loading {ckpt}")
    assert opened is not None  # else raised above
    missing: set[str] = set()
    unexpected: set[str] = set()
    if not folded:
        opened.request, missing, unexpected = _check_request(
            ckpt,
            opened.request,
            opened.strict,
            validate_access_integrity,
            opened.strategies,
            group.group,
        )
    if verify_integrity:
        check_files_read(ckpt, opened.strategies, opened.request, group.group)
    return opened, missing, unexpected


def _check_request(
    ckpt: CheckpointDir,
    request: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    strategies: tuple[LoadShardedStrategy, LoadCommonStrategy],
    process_group: ProcessGroup,
) -> tuple[ShardedStateDict, set[str], set[str]]:
    """The checks of :func:`validate_integrity_and_strict_load`, by key owners: the
    sharding check sends each record to the owner of its key, and the ``*_ALL`` modes'
    missing keys are found by the owners too (engine/sharding_split): no rank gathers
    every rank's request."""
    group = RankGroup(process_group)
    every = StrictHandling.requires_global_app_metadata(strict)
    records = local_shard_records(request) if validate_access_integrity or every else []
    ckpt_metadata, missing = None, None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        ckpt_metadata = load_sharded_metadata(ckpt, *strategies)
        if every:
            stored = (sh.key for sh in ckpt_metadata.values())
            missing = keys_nobody_requested(stored, (r.key for r in records), group)
    checked = validate_integrity_and_strict_load(
        request,
        strict,
        False,
        ckpt_sharded_metadata=ckpt_metadata,
        process_group=process_group,
        missing_keys=missing,
    )
    if validate_access_integrity:
        validate_sharding_split(records, group)
    return checked


@_gc_paused_call
def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
    validate_access_integrity: bool = True,
    strict: StrictHandling | str = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    verify_integrity: bool = False,
    verify_checksums: bool | None = None,
    process_group: ProcessGroup = None,
    allowed_types: Sequence[type] = (),
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """Load the checkpoint into the layout described by ``sharded_state_dict`` (collective).

    Steps: 1. pick the strategies from the checkpoint's ``metadata.json``; 2. load
    the common state (the base of the result); 3. apply factories (non-persistent
    objects are returned unwrapped); 4. compare the request with the checkpoint per
    ``strict``, check that main replicas cover every requested tensor exactly once;
    5. read the shards (only the bytes each rank needs), merge them and the
    factories' results into the common state.

    Args:
        sharded_state_dict: the request: ShardedTensors (with or without data),
            ShardedObjects (data None), factories, non-persistent objects.
        checkpoint_dir: the checkpoint directory.
        sharded_strategy: a LoadShardedStrategy or ``(backend, version)``.
        common_strategy: a LoadCommonStrategy or ``(backend, version)``.
        validate_access_integrity: check the request's sharding.
        strict: how to handle keys that differ (see :class:`StrictHandling`).
        verify_integrity: check the files read (each data file on one of its readers,
            metadata and ``common.pt`` on every rank) against ``integrity.json``.
        verify_checksums: check every byte read against the checksums recorded
            when it was written (``ChecksumMismatchError`` names key, file and
            offset); default: the ``VERIFY_CHECKSUMS`` knob (on). Checkpoints
            without a commit record (written by Megatron-Core) load unverified.
        process_group: the ranks that load together (default: the world).
        allowed_types: classes (beyond tensors, containers and primitives) that the
            common state and ShardedObjects may contain, e.g. ``[argparse.Namespace]``;
            added to what the load strategies allow, for this call only.

    Returns:
        The loaded state dict; with ``RETURN_*`` strict modes also the sets of
        missing and unexpected keys.
    """
    ckpt = CheckpointDir.of(checkpoint_dir)
    group = RankGroup(process_group)
    account = OpAccount(logger, "load", ckpt, group.rank)
    opened: OpenedLoad | None = None
    error: BaseException | None = None
    try:
        opened = open_load(
            ckpt,
            sharded_state_dict,
            (sharded_strategy, common_strategy),
            strict,
            account,
            verify_checksums=verify_checksums,
            verify_integrity=verify_integrity,
            allowed_types=allowed_types,
            process_group=process_group,
        )
    except Exception as exc:  # noqa: BLE001 - one verdict: raised on every rank below
        error = exc
    with account.phase("validate"):
        opened, missing, unexpected = _validate_load(
            ckpt, opened, error, strict, validate_access_integrity, verify_integrity, group
        )
    request, strategies = opened.request, opened.strategies
    with account.phase("plan+read"):
        loaded = strategies[0].load(request, ckpt)
    account.report(
        lambda: (tensor_bytes(loaded), strategies[0].files_holding(ckpt, keys_of(request)))
    )
    merge(opened.common_state_dict, loaded)
    merge(opened.common_state_dict, opened.nonpersistent)
    result: StateDict = apply_factory_merges(opened.common_state_dict, opened.factories)
    if StrictHandling.requires_returning_mismatch_keys(opened.strict):
        return result, missing, unexpected
    return result
