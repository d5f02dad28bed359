"""Saving and loading sharded state dicts: the library's entry points.

Megatron-Core's ``dist_checkpointing.serialization`` API (the 0.12-0.15
design with a strategy registry and ``common.pt``), also accepting the
parameters 0.16-0.19 added (``async_strategy``, ``verify_integrity``,
``content_metadata``) so code written for either release runs unchanged.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from .core import CheckpointingConfig, maybe_load_config, save_config
from .dict_utils import (
    dict_list_map_inplace,
    diff,
    extract_matching_values,
    merge,
    nested_values,
)
from .engine.async_save.calls import AsyncRequest
from .engine.checkpoint import integrity
from .engine.collectives import raise_on_all_ranks
from .engine.process import gc_paused
from .engine.storage.resolve import filesystem_for
from .errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    UnsupportedFeatureError,
)
from .mapping import (
    CommonStateDict,
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from .strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
)
from .validation import (
    StrictHandling,
    apply_strict_handling,
    gather_shard_records,
    local_metadata_of,
    parse_strict_flag,
    validate_sharding_integrity_on_all_ranks,
)

logger = logging.getLogger(__name__)

CONTENT_METADATA_KEY = "content_metadata"
_DCP_METADATA_FNAME = ".metadata"
# Files a save writes before its commit marker (metadata.json).
_SAVE_ARTIFACTS = frozenset({_DCP_METADATA_FNAME, "common.pt", "integrity.json"})

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


# --------------------------------------------------------------------------- strategies


def get_default_save_sharded_strategy(
    backend: str = "torch_dist", version: int = 1
) -> SaveShardedStrategy:
    """The registered default sharded save strategy for ``(backend, version)``."""
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


def get_default_save_common_strategy(
    backend: str = "torch", version: int = 1
) -> SaveCommonStrategy:
    """The registered default common save strategy for ``(backend, version)``."""
    return get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)


def get_default_load_sharded_strategy(checkpoint_dir: str | Path) -> LoadShardedStrategy:
    """The sharded load strategy for the checkpoint in ``checkpoint_dir``."""
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]


def _require_config(checkpoint_dir: str | Path) -> CheckpointingConfig:
    fs = filesystem_for(checkpoint_dir)
    if not fs.is_dir(str(checkpoint_dir)):
        raise CheckpointNotFoundError(f"Checkpoint directory {checkpoint_dir} does not exist")
    config = maybe_load_config(checkpoint_dir)
    if config is not None:
        return config
    names = fs.listdir(str(checkpoint_dir))
    if any(n in _SAVE_ARTIFACTS or n.endswith(".distcp") for n in names):
        raise IncompleteCheckpointError(
            f"{checkpoint_dir} holds an incomplete checkpoint: metadata.json is missing, so its "
            "save never finished (or is still being finalized)"
        )
    raise CheckpointNotFoundError(
        f"{checkpoint_dir} is not a distributed checkpoint (no metadata.json)"
    )


def verify_checkpoint_and_load_strategy(
    checkpoint_dir: str | Path,
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
) -> tuple[LoadShardedStrategy, LoadCommonStrategy]:
    """Check ``checkpoint_dir`` is a complete checkpoint and pick compatible strategies.

    Raises:
        CheckpointNotFoundError: no directory, or no checkpoint in it.
        IncompleteCheckpointError: a save that never finished.
        StrategyNotFoundError / IncompatibleStrategyError: no strategy fits.
    """
    config = _require_config(checkpoint_dir)
    if sharded_strategy is None:
        sharded_strategy = (config.sharded_backend, config.sharded_backend_version)
    if isinstance(sharded_strategy, tuple):
        sharded_strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, *sharded_strategy)
    if common_strategy is None:
        common_strategy = (config.common_backend, config.common_backend_version)
    if isinstance(common_strategy, tuple):
        common_strategy = get_default_strategy(StrategyAction.LOAD_COMMON, *common_strategy)
    assert isinstance(sharded_strategy, LoadShardedStrategy)
    assert isinstance(common_strategy, LoadCommonStrategy)
    sharded_strategy.check_backend_compatibility(config.sharded_backend)
    sharded_strategy.check_version_compatibility(config.sharded_backend_version)
    common_strategy.check_backend_compatibility(config.common_backend)
    common_strategy.check_version_compatibility(config.common_backend_version)
    return sharded_strategy, common_strategy


# --------------------------------------------------------------------------- helpers


def _is_sharded(x: Any) -> bool:
    return isinstance(x, ShardedBase)


def extract_nonpersistent(state_dict: ShardedStateDict) -> tuple[dict | list, dict | list]:
    """``(nonpersistent, rest)``: the LocalNonpersistentObject leaves and the others."""
    return extract_matching_values(state_dict, lambda x: isinstance(x, LocalNonpersistentObject))


def _filter_out_empty_flat(sharded_part: dict | list) -> dict | list:
    """Flat ShardedTensors with an empty range hold no data: drop them."""
    _, kept = extract_matching_values(
        sharded_part,
        lambda x: (
            isinstance(x, ShardedTensor)
            and x.flattened_range is not None
            and x.flattened_range.stop <= x.flattened_range.start
        ),
    )
    return kept


ProcessGroup = dist.ProcessGroup | None
_S = TypeVar("_S")
_F = TypeVar("_F", bound=Callable[..., Any])


def _rank(group: ProcessGroup = None) -> int:
    """This process's rank in ``group`` (the world by default)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def _multi_rank(group: ProcessGroup) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _first_rank(group: ProcessGroup) -> int:
    """The global rank of the group's first rank (collective ``dst``/``src``)."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def _barrier(group: ProcessGroup = None) -> None:
    if _multi_rank(group):
        dist.barrier(group=group)


def _with_group(strategy: _S, group: ProcessGroup) -> _S:
    """``strategy`` bound to ``group`` if it has no group of its own (a copy: the
    registered defaults are shared)."""
    if group is not None and getattr(strategy, "process_group", group) is None:
        strategy = copy.copy(strategy)
        strategy.process_group = group  # type: ignore[attr-defined]
    return strategy


def _check_common_consistency(common_state_dict: CommonStateDict, group: ProcessGroup) -> None:
    """Log (on the first rank) where other ranks' common state differs from its own."""
    if not _multi_rank(group):
        return
    is_first = _rank(group) == 0
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if is_first else None
    dist.gather_object(common_state_dict, gathered, dst=_first_rank(group), group=group)
    if gathered is None:
        return
    for rank, other in enumerate(gathered[1:], start=1):
        only_0, only_r, mismatch = diff(gathered[0], other)
        if only_0 or only_r or mismatch:
            logger.warning(
                "Common state differs between rank 0 and rank %d (rank 0 wins): only on rank 0: "
                "%s; only on rank %d: %s; different values: %s",
                rank,
                only_0,
                rank,
                only_r,
                [m[0] for m in mismatch],
            )


def save_preprocess(
    sharded_state_dict: ShardedStateDict,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Callable[[CommonStateDict], StateDict]
    | None = None,
    process_group: ProcessGroup = None,
) -> tuple[ShardedStateDict, StateDict]:
    """Apply factories, drop non-persistent values, split sharded and common parts,
    and validate the sharding on every rank (collective when validating)."""
    apply_factories(sharded_state_dict)
    _, persistent = extract_nonpersistent(sharded_state_dict)
    sharded_part, common_part = extract_matching_values(persistent, _is_sharded)
    sharded_part = _filter_out_empty_flat(sharded_part)
    if validate_access_integrity:
        _, global_metadata = gather_shard_records(sharded_part, process_group)  # type: ignore[arg-type]
        validate_sharding_integrity_on_all_ranks(global_metadata, process_group)
        to_check = common_part
        if preprocess_common_before_consistancy_check is not None:
            to_check = preprocess_common_before_consistancy_check(common_part)  # type: ignore[arg-type]
        _check_common_consistency(to_check, process_group)  # type: ignore[arg-type]
    return sharded_part, common_part  # type: ignore[return-value]


def _resolve_save_strategies(
    sharded_strategy: SaveShardedStrategy | tuple[str, int] | None,
    common_strategy: SaveCommonStrategy | tuple[str, int] | None,
) -> tuple[SaveShardedStrategy, SaveCommonStrategy]:
    if sharded_strategy is None:
        sharded_strategy = get_default_save_sharded_strategy()
    elif isinstance(sharded_strategy, tuple):
        sharded_strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, *sharded_strategy)
    if common_strategy is None:
        common_strategy = get_default_save_common_strategy()
    elif isinstance(common_strategy, tuple):
        common_strategy = get_default_strategy(StrategyAction.SAVE_COMMON, *common_strategy)
    if not isinstance(sharded_strategy, SaveShardedStrategy):
        raise CheckpointingException(f"{sharded_strategy!r} is not a SaveShardedStrategy")
    if not isinstance(common_strategy, SaveCommonStrategy):
        raise CheckpointingException(f"{common_strategy!r} is not a SaveCommonStrategy")
    return sharded_strategy, common_strategy


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


def _check_directory(checkpoint_dir: str | Path) -> None:
    if not filesystem_for(checkpoint_dir).is_dir(str(checkpoint_dir)):
        raise CheckpointNotFoundError(
            f"Checkpoint destination directory does not exist: {checkpoint_dir}"
        )


def _clear_commit_markers(checkpoint_dir: str | Path, group: ProcessGroup) -> None:
    """Make sure an overwritten directory never looks complete during the new save.

    Called after validation (a rejected save leaves an old checkpoint intact) and
    before anything is written (the first rank does it before it writes
    ``common.pt`` or takes part in the save planning, which other ranks' data
    writes wait for).
    """
    fs = filesystem_for(checkpoint_dir)
    if _rank(group) != 0:
        return
    names = fs.listdir(str(checkpoint_dir))
    if names:
        logger.warning("Overwriting the existing content of %s", checkpoint_dir)
    # The commit markers go first, so a crash mid-save leaves an incomplete checkpoint.
    for marker in ("metadata.json", integrity.INTEGRITY_FNAME, _DCP_METADATA_FNAME):
        if marker in names:
            fs.remove(fs.join(str(checkpoint_dir), marker))


def _own_data_files(checkpoint_dir: str | Path, group: ProcessGroup) -> list[str]:
    prefix = f"__{_rank(group)}_"
    names = filesystem_for(checkpoint_dir).listdir(str(checkpoint_dir))
    return [n for n in names if n.startswith(prefix) and n.endswith(".distcp")]


def _commit(
    checkpoint_dir: str | Path,
    config: CheckpointingConfig,
    verify_integrity: bool,
    group: ProcessGroup,
) -> None:
    """Finalize a save: integrity manifest (optional), then ``metadata.json`` (first rank)."""
    first = _rank(group) == 0
    if verify_integrity:
        digests = integrity.digest_files(checkpoint_dir, _own_data_files(checkpoint_dir, group))
        fs = filesystem_for(checkpoint_dir)
        if first and fs.exists(fs.join(str(checkpoint_dir), "common.pt")):
            digests.update(integrity.digest_files(checkpoint_dir, ["common.pt"]))
        all_digests: list[Any] | None = [digests]
        if _multi_rank(group):
            all_digests = [None] * dist.get_world_size(group) if first else None
            dist.gather_object(digests, all_digests, dst=_first_rank(group), group=group)
        if first:
            assert all_digests is not None
            merged: dict[str, str] = {}
            for d in all_digests:
                merged.update(d)
            integrity.write_manifest(checkpoint_dir, merged)
    if first:
        save_config(config, checkpoint_dir)
    _barrier(group)


# --------------------------------------------------------------------------- save


def _gc_paused_call(fn: _F) -> _F:
    """Run ``fn`` with the cyclic GC paused (see :func:`utils.gc_paused`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@_gc_paused_call
def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str | Path,
    sharded_strategy: SaveShardedStrategy | tuple[str, int] | None = None,
    common_strategy: SaveCommonStrategy | tuple[str, int] | None = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Callable[[CommonStateDict], StateDict]
    | None = None,
    *,
    async_strategy: str | None = None,
    verify_integrity: bool = False,
    content_metadata: dict | None = None,
    process_group: ProcessGroup = None,
) -> AsyncRequest | None:
    """Save a sharded state dict to ``checkpoint_dir`` (collective: every rank calls it).

    Steps:
        1. apply ShardedTensorFactories, drop LocalNonpersistentObjects, split the
           sharded part (ShardedTensor/ShardedObject leaves) from the common part;
        2. validate that every global tensor is covered exactly once by main
           replicas (every rank raises the same error otherwise);
        3. rank 0 saves the common part (``common.pt``);
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
    sharded_strategy, common_strategy = _resolve_save_strategies(sharded_strategy, common_strategy)
    sharded_strategy = _with_group(sharded_strategy, process_group)
    common_strategy = _with_group(common_strategy, process_group)
    if async_sharded_save and not isinstance(sharded_strategy, AsyncSaveShardedStrategy):
        raise CheckpointingException(f"{sharded_strategy} does not support async saves")
    _check_directory(checkpoint_dir)
    sharded_part, common_part = save_preprocess(
        sharded_state_dict,
        validate_access_integrity,
        preprocess_common_before_consistancy_check,
        process_group,
    )
    _clear_commit_markers(checkpoint_dir, process_group)
    if content_metadata is not None:
        common_part[CONTENT_METADATA_KEY] = content_metadata
    common_strategy.save_common(common_part, checkpoint_dir)
    if not sharded_strategy.can_handle_sharded_objects:
        objects, sharded_part = extract_matching_values(  # type: ignore[assignment]
            sharded_part, lambda x: isinstance(x, ShardedObject)
        )
        if objects:
            common_strategy.save_sharded_objects(objects, checkpoint_dir)  # type: ignore[arg-type]
    config = CheckpointingConfig(
        sharded_strategy.backend,
        sharded_strategy.version,
        common_strategy.backend,
        common_strategy.version,
    )

    def finalize() -> None:
        _commit(checkpoint_dir, config, verify_integrity, process_group)

    if not async_sharded_save:
        sharded_strategy.save(sharded_part, checkpoint_dir)
        finalize()
        return None
    assert isinstance(sharded_strategy, AsyncSaveShardedStrategy)
    request = sharded_strategy.async_save(sharded_part, checkpoint_dir)
    request.add_finalize_fn(finalize)
    return request


# --------------------------------------------------------------------------- load


def load_common_state_dict(
    checkpoint_dir: str | Path,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
) -> StateDict:
    """The common (non-sharded) state of the checkpoint."""
    _, common = verify_checkpoint_and_load_strategy(checkpoint_dir, common_strategy=common_strategy)
    return common.load_common(checkpoint_dir)


def load_content_metadata(
    checkpoint_dir: str | Path | None = None, *, preloaded_state_dict: StateDict | None = None
) -> dict | None:
    """The ``content_metadata`` given to :func:`save`, or None."""
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise CheckpointingException(
                "load_content_metadata needs checkpoint_dir or a state dict"
            )
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(CONTENT_METADATA_KEY)


def load_tensors_metadata(
    checkpoint_dir: str | Path,
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
) -> ShardedStateDict:
    """Data-less ShardedTensors (global shape, dtype) of every stored tensor, by key."""
    strategy, _ = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy)
    return strategy.load_tensors_metadata(checkpoint_dir)


def load_sharded_metadata(
    checkpoint_dir: str | Path,
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
) -> ShardedStateDict:
    """Data-less ShardedTensors by key and ShardedObjects by unique key."""
    strategy, common = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy
    )
    metadata = strategy.load_sharded_metadata(checkpoint_dir)
    if not strategy.can_handle_sharded_objects:
        merge(metadata, common.load_sharded_metadata(checkpoint_dir))
    return metadata


def load_plain_tensors(checkpoint_dir: str | Path) -> StateDict:
    """Every stored tensor, whole, by key (every rank loads everything)."""
    request = load_tensors_metadata(checkpoint_dir)
    return load(request, checkpoint_dir, validate_access_integrity=False)  # type: ignore[return-value]


def remove_sharded_tensors(checkpoint_dir: str | Path, key_prefix: str) -> None:
    """Remove the tensors whose key starts with ``key_prefix`` (run on one rank)."""
    strategy, _ = verify_checkpoint_and_load_strategy(checkpoint_dir)
    strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)


def _files_read_by(checkpoint_dir: str | Path, keys: set[str]) -> set[str]:
    from .engine.storage.reader import FileSystemReader

    metadata = FileSystemReader(str(checkpoint_dir)).read_metadata()
    return {
        info.relative_path
        for index, info in (metadata.storage_data or {}).items()
        if index.fqn in keys
    }


@_gc_paused_call
def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str | Path,
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
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy
    )
    sharded_strategy = _with_group(sharded_strategy, process_group)
    common_state_dict = common_strategy.load_common(checkpoint_dir)
    nonpersistent, sharded_state_dict = extract_nonpersistent(sharded_state_dict)  # type: ignore[assignment]
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    factories, _ = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory)
    )
    apply_factories(sharded_state_dict)
    sharded_state_dict, _ = extract_matching_values(sharded_state_dict, _is_sharded)  # type: ignore[assignment]

    strict = parse_strict_flag(strict)
    ckpt_metadata = None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        ckpt_metadata = load_sharded_metadata(checkpoint_dir, sharded_strategy, common_strategy)
    local_metadata: list[Any] = local_metadata_of(sharded_state_dict)
    global_metadata: list[list[Any]] | None = None
    if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
        local_metadata, global_metadata = gather_shard_records(sharded_state_dict, process_group)
    missing: set[str] = set()
    unexpected: set[str] = set()
    error: Exception | None = None
    if ckpt_metadata is not None:
        try:
            sharded_state_dict, missing, unexpected = apply_strict_handling(
                sharded_state_dict, strict, ckpt_metadata, local_metadata, global_metadata
            )
        except Exception as e:  # noqa: BLE001 - a key mismatch on one rank fails every rank
            error = e
        raise_on_all_ranks(error, process_group, what="Checking the requested keys")
    if validate_access_integrity:
        assert global_metadata is not None
        validate_sharding_integrity_on_all_ranks(global_metadata, process_group)
    if verify_integrity:
        keys = {
            sh.unique_key if isinstance(sh, ShardedObject) else sh.key
            for sh in nested_values(sharded_state_dict)
        }
        files = _files_read_by(checkpoint_dir, keys)
        fs = filesystem_for(checkpoint_dir)
        if fs.exists(fs.join(str(checkpoint_dir), "common.pt")):
            files.add("common.pt")
        integrity.verify_files(checkpoint_dir, files)

    loaded = sharded_strategy.load(sharded_state_dict, checkpoint_dir)
    merge(common_state_dict, loaded)
    merge(common_state_dict, nonpersistent)
    result = apply_factory_merges(common_state_dict, factories)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return result, missing, unexpected
    return result
