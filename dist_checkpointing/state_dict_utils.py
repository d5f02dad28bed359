"""Preparing a sharded state dict for a save or a load (Megatron-Core's module path).

``save_preprocess``: apply factories, drop non-persistent leaves, split the
sharded part from the common part, validate the sharding (collective).
``load_preprocess``: apply factories (kept for merging back), unwrap the
non-persistent leaves, keep the sharded request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from .engine.checkpoint import commit
from .engine.collectives import ProcessGroup, RankGroup, all_equal, equal_ballot
from .engine.sharding_split import ValidatedStructure, validate_sharding_split
from .errors import UnsupportedFeatureError
from .mapping import (
    CommonStateDict,
    LocalNonpersistentObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
)
from .utils import extract_nonpersistent, extract_sharded_base
from .validation import (
    common_state_digest,
    local_shard_records,
    pickled_common_state,
    validate_common_state_dict,
)

logger = logging.getLogger(__name__)


def filter_out_empty_flatten_tensor(sharded_state_dict: ShardedStateDict) -> ShardedStateDict:
    """Drop flat ShardedTensors whose range is empty (they hold no data)."""
    _, kept = extract_matching_values(
        sharded_state_dict,
        lambda x: (
            isinstance(x, ShardedTensor)
            and x.flattened_range is not None
            and x.flattened_range.stop <= x.flattened_range.start
        ),
    )
    return kept  # type: ignore[return-value]


@dataclass
class _LeafKinds:
    """Which optional steps a state dict needs (one pass over its leaves)."""

    factories: bool = False
    nonpersistent: bool = False
    empty_flat: bool = False


# Tensors no layout stores as bytes: quantized and sub-byte dtypes (torch.save writes
# some of them, but they do not load back), and any layout but strided (sparse, ...).
_UNSTORABLE_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "quint8", "qint8", "qint32", "quint4x2", "quint2x4",
        *(f"uint{n}" for n in range(1, 8)),
        *(f"int{n}" for n in range(1, 8)),
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
)  # fmt: skip


def _check_storable(sh: ShardedTensor) -> None:
    data = sh.data
    if data is not None and (data.layout is not torch.strided or data.dtype in _UNSTORABLE_DTYPES):
        what = data.dtype if data.layout is torch.strided else data.layout
        raise UnsupportedFeatureError(
            f"ShardedTensor {sh.key!r}: tensors of {what} cannot be saved (only dense "
            "tensors of non-quantized dtypes of whole bytes)"
        )


def _leaf_kinds(state_dict: ShardedStateDict, saving: bool = False) -> _LeafKinds:
    """Which steps ``state_dict`` needs; ``saving``: also refuse tensors no layout stores."""
    if not isinstance(state_dict, (dict, list)):  # the full path reports the error
        return _LeafKinds(True, True, True)
    kinds = _LeafKinds()
    for v in nested_values(state_dict):
        if isinstance(v, ShardedTensor):
            if saving:
                _check_storable(v)
            fr = v.flattened_range
            if fr is not None and fr.stop <= fr.start:
                kinds.empty_flat = True
        elif isinstance(v, ShardedTensorFactory):
            kinds.factories = True
        elif isinstance(v, LocalNonpersistentObject):
            kinds.nonpersistent = True
    return kinds


def check_is_dict(sharded_state_dict: Any) -> None:
    """Raise ``TypeError`` unless ``sharded_state_dict`` is a dict (what ``save`` and
    ``load`` take: the loaded state is merged into the common state, a dict)."""
    if not isinstance(sharded_state_dict, dict):
        raise TypeError(
            f"a sharded state dict must be a dict, got {type(sharded_state_dict).__name__}"
        )


def split_for_save(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """The local steps of :func:`save_preprocess` (no communication): apply factories,
    drop LocalNonpersistentObjects and empty flat ranges, split the ShardedBase leaves
    (the sharded part) from the rest (the common part)."""
    check_is_dict(sharded_state_dict)
    # Each step is a pass that copies the containers: one cheap pass first finds which
    # are needed (a factory may build anything, so with one every step runs).
    kinds = _leaf_kinds(sharded_state_dict, saving=True)
    persistent = sharded_state_dict
    if kinds.factories:
        apply_factories(sharded_state_dict)
    if kinds.factories or kinds.nonpersistent:
        _, persistent = extract_nonpersistent(sharded_state_dict)
    sharded_part, common_part = extract_sharded_base(persistent)
    if kinds.factories or kinds.empty_flat:
        sharded_part = filter_out_empty_flatten_tensor(sharded_part)
    return sharded_part, common_part


def save_preprocess(
    sharded_state_dict: ShardedStateDict,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Callable[[CommonStateDict], StateDict]
    | None = None,
    process_group: ProcessGroup = None,
    validated_structure: ValidatedStructure | None = None,
    local_error: BaseException | None = None,
    *,
    opening: commit.Opening | None = None,
) -> tuple[ShardedStateDict, StateDict]:
    """Split ``sharded_state_dict`` into its sharded and common parts for saving.

    Steps: :func:`split_for_save`, and (when validating) check on every rank of
    ``process_group`` that main replicas cover every global tensor exactly once (each
    key on one owner rank, :mod:`.engine.sharding_split`; skipped while
    ``validated_structure`` says no rank's shards changed since the last passing
    check), and log common-state differences between ranks.

    One vote (an all-reduce) carries the sharding check's "changed" flags, a digest
    of each rank's common state (the common states are gathered, to log their
    differences, only where the digests differ: Megatron-Core gathers them at every
    save) and, with ``opening`` (:class:`.engine.checkpoint.commit.Opening`, every
    rank passes one or none), the start of the commit protocol, after which the
    coordinator makes the opening's first writes (given the common part): a cached
    save's opening costs that one all-reduce.

    Collective: a step that fails on one rank (``local_error``: the caller's own steps
    before this one failed) raises on every rank, in the vote, never leaving the
    other ranks waiting.

    Returns:
        ``(sharded_part, common_part)``.
    """
    error = local_error
    sharded_part: ShardedStateDict = {}
    common_part: StateDict = {}
    records: list[Any] = []
    to_check: Any = None
    pickled: bytes | str = b""
    digest = 0
    ballot = [] if opening is None else [0] * opening.WIDTH
    if error is None:
        try:
            sharded_part, common_part = split_for_save(sharded_state_dict)
            if validate_access_integrity:
                records = local_shard_records(sharded_part)
                to_check = common_part
                if preprocess_common_before_consistancy_check is not None:
                    to_check = preprocess_common_before_consistancy_check(common_part)
                pickled = pickled_common_state(to_check)
                digest = common_state_digest(pickled)
            if opening is not None:
                ballot = opening.ballot(common_part)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
    group = RankGroup(process_group)
    ballot += equal_ballot([digest])
    try:
        if validate_access_integrity:
            agreed = validate_sharding_split(
                records, group, validated_structure, local_error=error, ballot=ballot
            )
        else:
            what = "Preparing the state dict to save"
            agreed = group.fail_together(error, what, ballot, dist.ReduceOp.MAX)
    except BaseException as exc:
        cause = exc if opening is None else opening.failed(exc)
        if cause is exc:
            raise
        raise cause from exc
    if opening is not None:
        opening.join(agreed)
    if not all_equal(agreed[-2:]):  # the largest and smallest digests differ
        try:
            validate_common_state_dict(to_check, process_group, pickled=pickled)
        except Exception as exc:  # noqa: BLE001 - a warning's failure must not stop one rank
            logger.warning("could not compare the ranks' common states: %s", exc)
    return sharded_part, common_part


def load_preprocess(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict, ShardedStateDict]:
    """Split a load request into what the strategies read and what is merged back.

    Returns:
        ``(sharded_state_dict, nonpersistent_state_dict, sh_ten_factories)``: the
        ShardedBase leaves to read (factories applied), the unwrapped
        LocalNonpersistentObjects, and the factories (for ``apply_factory_merges``).
    """
    kinds = _leaf_kinds(sharded_state_dict)
    if not kinds.factories and not kinds.nonpersistent:  # the common case: one pass
        request, _ = extract_sharded_base(sharded_state_dict)
        empty: Any = {} if isinstance(sharded_state_dict, dict) else []
        return request, empty, {}  # what the steps below return for such a request
    nonpersistent, request = extract_nonpersistent(sharded_state_dict)
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    # Lists become dicts keyed by index, so a list that mixes factories and other
    # leaves merges back position by position (Megatron-Core's semantics).
    factories, _ = extract_matching_values(
        request, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(request)
    request, _ = extract_sharded_base(request)
    return request, nonpersistent, factories  # type: ignore[return-value]


__all__ = [
    "check_is_dict",
    "filter_out_empty_flatten_tensor",
    "load_preprocess",
    "save_preprocess",
]
