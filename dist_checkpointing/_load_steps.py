"""The steps of :func:`~dist_checkpointing.serialization.load`, apart from its recipe.

Opening the checkpoint (preloading its small files where that saves requests, picking
its strategies), the load's first verdict and where it is taken, the sharding check of
the request, and the integrity check of the files read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._accounting import OpAccount
from ._torch_compat import METADATA_FILE_NAME
from .core import CONFIG_FNAME
from .dict_utils import nested_values
from .engine.checkpoint import integrity, preload
from .engine.collectives import ProcessGroup, RankGroup
from .engine.sharding_split import validate_sharding_split
from .engine.storage.location import CheckpointDir
from .engine.storage.metadata_index import INDEX_NAME as METADATA_INDEX_NAME
from .mapping import ShardedObject, ShardedStateDict, StateDict
from .state_dict_utils import check_is_dict, load_preprocess
from .strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    allow_types,
    bind_process_group,
)
from .strategies.common import COMMON_STATE_FNAME
from .validation import (
    StrictHandling,
    local_shard_records,
    parse_strict_flag,
    verify_checkpoint_and_load_strategy,
)

# The whole files a load reads first, fetched by one rank for all where that saves
# requests (object stores; see engine.checkpoint.preload).
_SMALL_FILES = (CONFIG_FNAME, METADATA_FILE_NAME, METADATA_INDEX_NAME, COMMON_STATE_FNAME)


def verdict_in_sharding_check(strict: StrictHandling | str, validate: bool) -> bool:
    """Whether a load's first verdict (every rank opened the checkpoint and read its
    request) rides the sharding check's first all-reduce: in the default mode, which
    does not compare the request with the checkpoint first. Decided from the arguments
    alone, so that every rank makes the same first collective."""
    try:
        return validate and parse_strict_flag(strict) == StrictHandling.ASSUME_OK_UNEXPECTED
    except Exception:  # noqa: BLE001 - a bad flag is raised on every rank by the verdict
        return False


def check_sharding(
    request: ShardedStateDict, error: BaseException | None, group: RankGroup, what: str
) -> None:
    """(Collective) The sharding check of ``request`` whose first all-reduce also
    carries this rank's ``error`` (raised on every rank as ``what``'s failure)."""
    records = []
    if error is None:
        try:
            records = local_shard_records(request)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the check
            error = exc
    validate_sharding_split(records, group, local_error=error, what=what)


def keys_of(request: ShardedStateDict) -> set[str]:
    """The keys ``request`` asks for (a ShardedObject's with its offset)."""
    return {
        sh.unique_key if isinstance(sh, ShardedObject) else sh.key for sh in nested_values(request)
    }


def check_files_read(
    ckpt: CheckpointDir,
    strategies: tuple[LoadShardedStrategy, LoadCommonStrategy],
    request: ShardedStateDict,
    process_group: ProcessGroup,
) -> None:
    """(Collective) Check the data files the ranks read against the checkpoint's
    integrity manifest, each digested by one of its readers: a damaged file raises on
    every rank, not only on its reader."""
    sharded, _ = strategies  # .metadata and common.pt were checked before unpickling
    integrity.verify_files_read(
        ckpt, lambda: sharded.files_holding(ckpt, keys_of(request)), RankGroup(process_group)
    )


def metadata_files(ckpt: CheckpointDir, sharded: LoadShardedStrategy) -> list[str]:
    """The format metadata files the checkpoint has (covered by its manifest)."""
    return [name for name in sharded.metadata_files if ckpt.has(name)]


@dataclass
class OpenedLoad:
    """What a rank holds once it opened a load (before the load's first collective)."""

    strategies: tuple[LoadShardedStrategy, LoadCommonStrategy]
    common_state_dict: StateDict
    request: ShardedStateDict  # the ShardedBase leaves to read (factories applied)
    nonpersistent: StateDict
    factories: ShardedStateDict
    strict: StrictHandling


def open_load(
    ckpt: CheckpointDir,
    sharded_state_dict: ShardedStateDict,
    strategies: tuple[
        LoadShardedStrategy | tuple[str, int] | None, LoadCommonStrategy | tuple[str, int] | None
    ],
    strict: StrictHandling | str,
    account: OpAccount,
    *,
    verify_checksums: bool | None,
    verify_integrity: bool,
    allowed_types: Sequence[type],
    process_group: ProcessGroup,
) -> OpenedLoad:
    """Preload the small files where that saves requests (collective), check that the
    checkpoint is complete, pick its load strategies (``strategies``: the sharded and
    common ones asked for), load the common state and split the request. A failure here
    is this rank's: the caller's first verdict raises it on every rank."""
    if preload.wanted(ckpt):  # collective: before anything of this rank's alone can raise
        preload.preload_small_files(ckpt, RankGroup(process_group), _SMALL_FILES)
    sharded, common = verify_checkpoint_and_load_strategy(
        ckpt, strategies[0], strategies[1], verify_checksums=verify_checksums
    )
    sharded, common = allow_types(sharded, allowed_types), allow_types(common, allowed_types)
    if verify_integrity:  # what is unpickled first is checked before it is
        integrity.verify_files(ckpt, metadata_files(ckpt, sharded) + common.files(ckpt))
    with account.phase("common"):
        common_state_dict = common.load_common(ckpt)
    check_is_dict(sharded_state_dict)
    request, nonpersistent, factories = load_preprocess(sharded_state_dict)
    return OpenedLoad(
        (bind_process_group(sharded, process_group), common),
        common_state_dict,
        request,
        nonpersistent,
        factories,
        parse_strict_flag(strict),
    )


__all__ = [
    "check_sharding",
    "keys_of",
    "metadata_files",
    "OpenedLoad",
    "open_load",
    "verdict_in_sharding_check",
    "check_files_read",
]
