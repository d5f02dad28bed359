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
from collections.abc import Callable
from typing import Any, TypeVar

from .core import CheckpointingConfig, config_bytes
from .dict_utils import extract_matching_values, merge, nested_values
from .engine.checkpoint import commit, integrity
from .engine.collectives import ProcessGroup, RankGroup
from .engine.process import gc_paused
from .engine.storage.location import CheckpointDir
from .errors import (
    CheckpointingException,
    UnsupportedFeatureError,
)
from .mapping import (
    CommonStateDict,
    ShardedObject,
    ShardedStateDict,
    StateDict,
    apply_factory_merges,
)
from .state_dict_utils import load_preprocess, save_preprocess
from .strategies.async_utils import AsyncRequest
from .strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    bind_process_group,
    expect_strategy,
    get_default_strategy,
    resolve_strategy,
)
from .validation import (
    StrictHandling,
    gather_shard_records,
    local_metadata_of,
    parse_strict_flag,
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


def _save_strategies(
    sharded_strategy: SaveShardedStrategy | tuple[str, int] | None,
    common_strategy: SaveCommonStrategy | tuple[str, int] | None,
    async_sharded_save: bool,
    process_group: ProcessGroup,
) -> tuple[SaveShardedStrategy, SaveCommonStrategy]:
    sharded = resolve_strategy(sharded_strategy, ("torch_dist", 1), StrategyAction.SAVE_SHARDED)
    common = resolve_strategy(common_strategy, ("torch", 1), StrategyAction.SAVE_COMMON)
    sharded = expect_strategy(sharded, SaveShardedStrategy)
    common = expect_strategy(common, SaveCommonStrategy)
    if async_sharded_save and not isinstance(sharded, AsyncSaveShardedStrategy):
        raise CheckpointingException(f"{sharded} does not support async saves")
    return bind_process_group(sharded, process_group), bind_process_group(common, process_group)


def _check_async_strategy(async_strategy: str | None) -> None:
    if async_strategy in (None, "mcore"):
        return
    if async_strategy == "nvrx":
        raise UnsupportedFeatureError(
            "async_strategy='nvrx' asks for nvidia-resiliency-ext's async writer, which "
            "dist_checkpointing does not use; pass async_strategy='mcore' (or omit it) to use "
            "the built-in async writer"
        )
    raise UnsupportedFeatureError(
        f"Unknown async_strategy {async_strategy!r}; supported: 'mcore' (the built-in writer)"
    )


def _gc_paused_call(fn: _F) -> _F:
    """Run ``fn`` with the cyclic GC paused (see :func:`engine.process.gc_paused`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------------- save


def _save_common_part(
    ckpt: CheckpointDir,
    sharded_strategy: SaveShardedStrategy,
    common_strategy: SaveCommonStrategy,
    sharded_part: ShardedStateDict,
    common_part: StateDict,
) -> ShardedStateDict:
    """Save the common state (and, if the sharded strategy cannot, the ShardedObjects);
    returns what is left for the sharded strategy."""
    common_strategy.save_common(common_part, ckpt)
    if sharded_strategy.can_handle_sharded_objects:
        return sharded_part
    objects, rest = extract_matching_values(sharded_part, lambda x: isinstance(x, ShardedObject))
    if objects:
        common_strategy.save_sharded_objects(objects, ckpt)  # type: ignore[arg-type]
    return rest  # type: ignore[return-value]


def _finalize_save(
    ckpt: CheckpointDir,
    sharded_strategy: SaveShardedStrategy,
    common_strategy: SaveCommonStrategy,
    verify_integrity: bool,
    group: RankGroup,
) -> None:
    """Integrity manifest (optional), then the commit marker (every rank calls it)."""
    if verify_integrity:
        names = sharded_strategy.files_written_by(ckpt, group.rank) + common_strategy.files(ckpt)
        integrity.record(ckpt, group, names)
    config = CheckpointingConfig(
        sharded_strategy.backend,
        sharded_strategy.version,
        common_strategy.backend,
        common_strategy.version,
    )
    commit.commit(ckpt, group, config_bytes(config))


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
    *,
    async_strategy: str | None = None,
    verify_integrity: bool = False,
    content_metadata: dict[str, Any] | None = None,
    process_group: ProcessGroup = None,
) -> AsyncRequest | None:
    """Save a sharded state dict to ``checkpoint_dir`` (collective: every rank calls it).

    Steps:
        1. apply ShardedTensorFactories, drop LocalNonpersistentObjects, split the
           sharded part (ShardedTensor/ShardedObject leaves) from the common part;
        2. validate that every global tensor is covered exactly once by main
           replicas (every rank raises the same error otherwise);
        3. the coordinator removes an older checkpoint's commit files, then saves
           the common part (``common.pt``);
        4. the sharded strategy writes the shards (in the background with
           ``async_sharded_save``);
        5. finalize: ``.metadata`` then ``metadata.json`` mark the checkpoint complete.

    Args:
        sharded_state_dict: the state dict with ShardedBase leaves.
        checkpoint_dir: an existing (preferably empty) directory.
        sharded_strategy: a SaveShardedStrategy or ``(backend, version)``.
        common_strategy: a SaveCommonStrategy or ``(backend, version)``.
        validate_access_integrity: check the sharding before saving.
        async_sharded_save: return an :class:`AsyncRequest` instead of writing now;
            schedule it on an ``AsyncCallsQueue`` and finalize it on every rank.
        preprocess_common_before_consistancy_check: (sic, Megatron-Core's
            spelling of "consistency") a function applied to the common state
            before comparing it across ranks (drop values expected to differ).
        async_strategy: Megatron-Core 0.19's choice of async writer: ``"mcore"``
            (or None) selects ours; ``"nvrx"`` is not supported.
        verify_integrity: record a sha256 of every data file (``integrity.json``).
        content_metadata: a dict stored with the common state, read back by
            :func:`load_content_metadata`.
        process_group: the ranks that save this checkpoint together (default: the
            world); default strategies are bound to it.

    Returns:
        The AsyncRequest with ``async_sharded_save=True``, else None.
    """
    _check_async_strategy(async_strategy)
    sharded, common = _save_strategies(
        sharded_strategy, common_strategy, async_sharded_save, process_group
    )
    ckpt = CheckpointDir.of(checkpoint_dir)
    ckpt.require_dir("Checkpoint destination directory", for_writing=True)
    sharded_part, common_part = save_preprocess(
        sharded_state_dict,
        validate_access_integrity,
        preprocess_common_before_consistancy_check,
        process_group,
    )
    group = RankGroup(process_group)
    _begin_on_every_rank(ckpt, group, (*sharded.commit_files, integrity.INTEGRITY_FNAME))
    if content_metadata is not None:
        common_part[CONTENT_METADATA_KEY] = content_metadata
    sharded_part = _save_common_part(ckpt, sharded, common, sharded_part, common_part)
    finalize = functools.partial(_finalize_save, ckpt, sharded, common, verify_integrity, group)
    if not async_sharded_save:
        sharded.save(sharded_part, ckpt)
        finalize()
        return None
    assert isinstance(sharded, AsyncSaveShardedStrategy)
    request = sharded.async_save(sharded_part, ckpt)
    request.add_finalize_fn(finalize)
    return request


def _begin_on_every_rank(
    ckpt: CheckpointDir, group: RankGroup, commit_files: tuple[str, ...]
) -> None:
    """:func:`commit.begin` (the coordinator acts); its failure (e.g. storage refused
    the listing) is raised on every rank."""
    error: Exception | None = None
    try:
        commit.begin(ckpt, group, commit_files)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    group.fail_together(error, f"preparing checkpoint {ckpt}")


# --------------------------------------------------------------------------- load


def load_common_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
) -> StateDict:
    """The common (non-sharded) state of the checkpoint."""
    ckpt = CheckpointDir.of(checkpoint_dir)
    _, common = verify_checkpoint_and_load_strategy(ckpt, common_strategy=common_strategy)
    return common.load_common(ckpt)


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


def load_tensors_metadata(
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
) -> ShardedStateDict:
    """Data-less ShardedTensors (global shape, dtype) of every stored tensor, by key."""
    ckpt = CheckpointDir.of(checkpoint_dir)
    strategy, _ = verify_checkpoint_and_load_strategy(ckpt, sharded_strategy)
    return strategy.load_tensors_metadata(ckpt)


def load_sharded_metadata(
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
) -> ShardedStateDict:
    """Data-less ShardedTensors by key and ShardedObjects by unique key."""
    ckpt = CheckpointDir.of(checkpoint_dir)
    strategy, common = verify_checkpoint_and_load_strategy(ckpt, sharded_strategy, common_strategy)
    metadata = strategy.load_sharded_metadata(ckpt)
    if not strategy.can_handle_sharded_objects:
        merge(metadata, common.load_sharded_metadata(ckpt))
    return metadata


def load_plain_tensors(checkpoint_dir: str | os.PathLike[str]) -> StateDict:
    """Every stored tensor, whole, by key (every rank loads everything)."""
    ckpt = CheckpointDir.of(checkpoint_dir)
    request = load_tensors_metadata(ckpt)
    return load(request, ckpt, validate_access_integrity=False)  # type: ignore[return-value]


def remove_sharded_tensors(checkpoint_dir: str | os.PathLike[str], key_prefix: str) -> None:
    """Remove the tensors whose key starts with ``key_prefix`` (run on one rank)."""
    ckpt = CheckpointDir.of(checkpoint_dir)
    strategy, _ = verify_checkpoint_and_load_strategy(ckpt)
    strategy.remove_sharded_tensors(ckpt, key_prefix)


def _check_request(
    ckpt: CheckpointDir,
    request: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    strategies: tuple[LoadShardedStrategy, LoadCommonStrategy],
    process_group: ProcessGroup,
) -> tuple[ShardedStateDict, set[str], set[str]]:
    """Gather what the checks need, then :func:`validate_integrity_and_strict_load`."""
    ckpt_metadata = None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        ckpt_metadata = load_sharded_metadata(ckpt, *strategies)
    local_metadata: list[Any] = local_metadata_of(request)
    global_metadata: list[list[Any]] | None = None
    if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
        local_metadata, global_metadata = gather_shard_records(request, process_group)
    return validate_integrity_and_strict_load(
        request,
        strict,
        validate_access_integrity,
        local_metadata,
        global_metadata,
        ckpt_metadata,
        process_group=process_group,
    )


def _verify_files_read(
    ckpt: CheckpointDir,
    strategies: tuple[LoadShardedStrategy, LoadCommonStrategy],
    request: ShardedStateDict,
) -> None:
    """Check the files this rank reads against the checkpoint's integrity manifest."""
    keys = {
        sh.unique_key if isinstance(sh, ShardedObject) else sh.key for sh in nested_values(request)
    }
    sharded, common = strategies
    files = sharded.files_holding(ckpt, keys) | set(common.files(ckpt))
    integrity.verify_files(ckpt, files)


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
    process_group: ProcessGroup = None,
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """Load the checkpoint into the layout described by ``sharded_state_dict`` (collective).

    Steps:
        1. pick the strategies from the checkpoint's ``metadata.json``;
        2. load the common state (it forms the base of the result);
        3. apply factories; LocalNonpersistentObjects are returned unwrapped;
        4. compare the request with the checkpoint per ``strict`` and validate
           that main replicas cover every requested tensor exactly once;
        5. read the shards (each rank reads only the bytes it needs) and merge
           them and the factories' results into the common state.

    Args:
        sharded_state_dict: the request: ShardedTensors (with or without data),
            ShardedObjects (data None), factories, non-persistent objects.
        checkpoint_dir: the checkpoint directory.
        sharded_strategy: a LoadShardedStrategy or ``(backend, version)``.
        common_strategy: a LoadCommonStrategy or ``(backend, version)``.
        validate_access_integrity: check the request's sharding.
        strict: how to handle keys that differ (see :class:`StrictHandling`).
        verify_integrity: check the files this rank reads (data files and
            ``common.pt``) against the checkpoint's ``integrity.json``.
        process_group: the ranks that load together (default: the world).

    Returns:
        The loaded state dict; with ``RETURN_*`` strict modes also the sets of
        missing and unexpected keys.
    """
    ckpt = CheckpointDir.of(checkpoint_dir)
    sharded, common = verify_checkpoint_and_load_strategy(ckpt, sharded_strategy, common_strategy)
    strategies = (bind_process_group(sharded, process_group), common)
    common_state_dict = common.load_common(ckpt)
    request, nonpersistent, factories = load_preprocess(sharded_state_dict)
    strict = parse_strict_flag(strict)
    request, missing, unexpected = _check_request(
        ckpt, request, strict, validate_access_integrity, strategies, process_group
    )
    if verify_integrity:
        _verify_files_read(ckpt, strategies, request)
    loaded = strategies[0].load(request, ckpt)
    merge(common_state_dict, loaded)
    merge(common_state_dict, nonpersistent)
    result: StateDict = apply_factory_merges(common_state_dict, factories)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return result, missing, unexpected
    return result
