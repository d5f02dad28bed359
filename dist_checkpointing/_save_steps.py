"""The steps of :func:`~dist_checkpointing.serialization.save`, apart from its recipe.

Strategy resolution for a save, the common part, writing the sharded part (now or
as an async request) and finalization (integrity manifest, then the commit of
:mod:`.engine.checkpoint.commit`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from ._accounting import OpAccount
from .core import CheckpointingConfig, config_bytes
from .dict_utils import extract_matching_values
from .engine.checkpoint import commit, integrity
from .engine.collectives import ProcessGroup, RankGroup
from .engine.storage.location import CheckpointDir
from .errors import CheckpointingException, UnsupportedFeatureError
from .mapping import ShardedObject, ShardedStateDict, StateDict
from .state_dict_utils import save_preprocess
from .strategies.async_utils import AsyncRequest
from .strategies.base import (
    AsyncSaveShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    bind_process_group,
    expect_strategy,
    resolve_strategy,
)

logger = logging.getLogger(__name__)


def save_strategies(
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


def open_for_save(
    checkpoint_dir: str | os.PathLike[str],
    strategies: tuple[Any, Any],
    async_sharded_save: bool,
    async_strategy: str | None,
    validate_access_integrity: bool,
    process_group: ProcessGroup,
) -> tuple[SaveShardedStrategy, SaveCommonStrategy, CheckpointDir]:
    """The strategies and the directory of a save. A failure here on one rank joins the
    first collective the other ranks reach (:func:`save_preprocess`'s vote), which
    raises it on every rank."""
    try:
        check_async_strategy(async_strategy)
        sharded, common = save_strategies(*strategies, async_sharded_save, process_group)
        ckpt = CheckpointDir.of(checkpoint_dir)
        ckpt.require_dir("Checkpoint destination directory", for_writing=True)
    except Exception as exc:  # one verdict: this rank joins the others' first collective
        opening = commit.Opening(None, RankGroup(process_group), lambda name: False)
        save_preprocess(
            {}, validate_access_integrity, None, process_group, None, exc, opening=opening
        )
        raise  # (save_preprocess raised it already, on every rank)
    return sharded, common, ckpt


def check_async_strategy(async_strategy: str | None) -> None:
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


def save_opening(
    ckpt: CheckpointDir,
    sharded_strategy: SaveShardedStrategy,
    common_strategy: SaveCommonStrategy,
    group: RankGroup,
    verify_integrity: bool,
    extra: StateDict,
) -> commit.Opening:
    """The start of the commit protocol, carried by the save's first vote. Its first
    writes (made by the coordinator before that vote, whose verdict covers them): the
    common part, with ``extra`` added, where the common strategy writes on the save's
    coordinator alone (``saves_on_coordinator_only``) and the sharded strategy keeps
    the ShardedObjects. Else none: :func:`save_common_part` saves the common part
    after the vote, with an all-reduce of its own."""
    owns = functools.partial(owns_file, sharded_strategy, common_strategy)
    opening = commit.Opening(ckpt, group, owns, verify_integrity)
    if not (
        common_strategy.saves_on_coordinator_only and sharded_strategy.can_handle_sharded_objects
    ):
        return opening
    own_group = RankGroup(getattr(common_strategy, "process_group", group.group))
    if own_group.coordinator_global_rank != group.coordinator_global_rank:
        return opening

    def write(common_part: StateDict) -> None:
        common_part.update(extra)
        common_strategy.save_common(common_part, ckpt)

    opening.first_writes = write
    return opening


def save_common_part(
    ckpt: CheckpointDir,
    sharded_strategy: SaveShardedStrategy,
    common_strategy: SaveCommonStrategy,
    sharded_part: ShardedStateDict,
    common_part: StateDict,
    group: RankGroup,
) -> ShardedStateDict:
    """Save the common state (and, if the sharded strategy cannot, the ShardedObjects);
    returns what is left for the sharded strategy. Collective: a failure on any rank
    (``common.pt`` is written by the coordinator) raises on every rank."""
    error: BaseException | None = None
    rest: Any = sharded_part
    try:
        common_strategy.save_common(common_part, ckpt)
        if not sharded_strategy.can_handle_sharded_objects:
            objects, rest = extract_matching_values(
                sharded_part, lambda x: isinstance(x, ShardedObject)
            )
            if objects:
                common_strategy.save_sharded_objects(objects, ckpt)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - raised on every rank by fail_together
        error = exc
    group.fail_together(error, f"Saving the common state of {ckpt}")
    return rest  # type: ignore[no-any-return]


def finalize_save(
    ckpt: CheckpointDir,
    sharded_strategy: SaveShardedStrategy,
    common_strategy: SaveCommonStrategy,
    verify_integrity: bool,
    group: RankGroup,
    account: OpAccount,
) -> None:
    """Integrity manifest (optional), then the commit (every rank calls it)."""

    def written() -> list[str]:
        return sharded_strategy.files_written_by(ckpt, group.rank) + common_strategy.files(ckpt)

    with account.phase("finalize"):
        error: BaseException | None = None
        config = CheckpointingConfig(
            sharded_strategy.backend,
            sharded_strategy.version,
            common_strategy.backend,
            common_strategy.version,
        )
        try:
            if verify_integrity:
                names = written()
                if group.is_coordinator:  # the format's metadata (.metadata) is covered too
                    names += [n for n in sharded_strategy.commit_files if ckpt.has(n)]
                integrity.record(ckpt, group, names, ckpt.context.file_digests)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
        try:  # a failure on any rank: nothing is committed, on every rank
            group.fail_together(error, f"Finalizing the save of {ckpt}")
        except BaseException:
            commit.abort(ckpt, group)
            raise
        commit.commit(ckpt, group, config_bytes(config))
    account.report(lambda: _sizes_and_names(ckpt, written()))


def _sizes_and_names(ckpt: CheckpointDir, names: list[str]) -> tuple[int, list[str]]:
    """Total bytes of ``names`` and the names (one directory listing, not two)."""
    return sum(ckpt.size(n) for n in names), names


def write_sharded(
    ckpt: CheckpointDir,
    sharded: SaveShardedStrategy,
    sharded_part: ShardedStateDict,
    finalize: Callable[[], None],
    group: RankGroup,
    account: OpAccount,
    async_sharded_save: bool,
) -> AsyncRequest | None:
    """Write now and finalize, or return the request that will (async; it aborts the
    commit protocol if its call fails)."""
    if not async_sharded_save:
        with account.phase("plan+stage+write"):
            sharded.save(sharded_part, ckpt)
        finalize()
        return None
    assert isinstance(sharded, AsyncSaveShardedStrategy)
    with account.phase("plan"):
        request = sharded.async_save(sharded_part, ckpt)
    request.add_finalize_fn(finalize)
    request.add_abort_fn(functools.partial(commit.abort, ckpt, group))
    account.mark_blocked()
    return request


def owns_file(sharded: SaveShardedStrategy, common: SaveCommonStrategy, name: str) -> bool:
    """Whether ``name`` is a checkpoint file (one a save may replace or delete)."""
    return (
        sharded.owns_file(name)
        or common.owns_file(name)
        or name in (commit.COMMIT_MARKER, integrity.INTEGRITY_FNAME)
    )
