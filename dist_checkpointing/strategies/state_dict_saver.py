"""Collective planning and finalization of a DCP save, split for async saves.

Call sequence, every rank of the group:

1. ``save_state_dict_async_plan`` (in the calling process): the planner makes
   the local plan (or, where it tracks the structure and the cached plan was made
   from an equal ``structure_signature()``, rebinds that plan's items to the new
   data) and the writer tags it with its file prefix; the writer prepares
   (resolves and buckets) the data to write. Where every rank's local plan
   equals the cached one (one all-reduce decides; a rank whose plan does
   prepares it before), that is all. Else the coordinator gathers all local
   plans, builds the global plan and the metadata, and scatters each rank its
   part; the writer prepares the data, and a second all-reduce agrees on it.
2. The caller runs the writer's write function (in this process, or in the
   background).
3. ``save_state_dict_async_finalize``: each rank collects its write results;
   the coordinator gathers them and writes ``.metadata`` (the DCP commit
   point); then every rank learns the outcome. After a save that reused the
   structure, one all-reduce first asks whether every rank's write results
   (checksums aside) equal its last committed ones; if so, ranks send only their
   items' checksums and the coordinator rewrites the cached metadata as it is
   (the same bytes a full assembly would give, ``storage_meta`` aside).

Every step that can fail on one rank turns into an exception on every rank:
no rank is left waiting in a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter

from .._torch_compat import StorageInfo
from ..engine.collectives import RankGroup, describe_error
from ..engine.storage.bucketing import BucketLayout
from ..engine.storage.metadata_blob import expect_reuse
from ..engine.storage.metadata_parts import SharedParts, index_at
from ..engine.storage.result_table import ResultRow, ResultTable, data_files_from_tables
from ..errors import CheckpointingException, CheckpointWriteError

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class CachedStructure:
    """What a save can reuse when the next save has the same structure.

    ``local_plan`` is this rank's plan before global planning, ``central_plan``
    its final plan, ``metadata`` the global metadata (coordinator only).
    ``metadata_pending`` (the same on every rank) means the metadata is built at
    finalization from every rank's plan records (decentralized planning).
    ``reused`` (the same on every rank): this save reused the previous structure;
    ``results_digest``: this rank's write results (checksums aside) at the last
    committed save. When every rank's results are unchanged too, the coordinator
    rewrites the previous metadata as it is (only ``storage_meta`` changes) and
    ``metadata_rewritten`` is set on every rank. ``signature``: the planner's
    ``structure_signature()`` of the state dict ``local_plan`` was made from (where
    the planner tracks it): a save whose signature is equal reuses ``local_plan``'s
    items without building them; ``bucket_layout``: how the writer grouped the items
    into files (reused with them).
    """

    local_plan: SavePlan
    central_plan: SavePlan
    metadata: Metadata | None
    metadata_pending: bool = False
    reused: bool = False
    results_digest: int | None = None
    metadata_rewritten: bool = False
    signature: list[Any] | None = None
    bucket_layout: BucketLayout | None = None


def _decentralized(planner: SavePlanner) -> bool:
    return bool(getattr(planner, "supports_decentralized_plan", False))


def _commit_unchanged(
    storage_writer: StorageWriter, metadata: Metadata | None, gathered: list[Any]
) -> tuple[str, str]:
    """(Coordinator) Rewrite the previous save's metadata: every rank's structure and
    write results are unchanged, only the item checksums (and ``storage_meta``) are new
    (``gathered``: each rank's :meth:`ResultTable.locations`)."""
    if metadata is None:
        return ("error", "the coordinator has no cached metadata to write")
    data_files = data_files_from_tables(gathered)
    _, error = _attempt(lambda: storage_writer.finish_assembled(metadata, data_files))  # type: ignore[attr-defined]
    if error is not None:
        return ("error", f"writing .metadata failed: {error}")
    return ("ok", "")


def storage_data_from_records(records: Iterable[ResultRow]) -> dict[MetadataIndex, Any]:
    """``Metadata.storage_data`` straight from the rows of write results (no WriteResult).

    Equal offsets are one ``torch.Size``: pickle writes a shared object once and refers
    back to it after, so ``.metadata`` is smaller and its pickling holds fewer objects."""
    shape = SharedParts().size
    return {
        index_at(fqn, None if offset is None else shape(offset)): StorageInfo(
            path, file_offset, length, transforms
        )
        for fqn, offset, _, path, file_offset, length, transforms, _ in records
    }


def _finish(
    storage_writer: StorageWriter,
    metadata: Metadata,
    per_rank: list[ResultTable],
    kept: bool = False,
) -> None:
    """Complete ``metadata`` from every rank's write results and write it: our writer
    takes the storage data built here; another DCP writer gets WriteResults. ``kept``:
    the save caches its structure, so an unchanged next save writes this very object
    again (:func:`.metadata_blob.expect_reuse`)."""
    if not hasattr(storage_writer, "finish_assembled"):
        storage_writer.finish(metadata, [table.write_results() for table in per_rank])
        return
    metadata.storage_data = storage_data_from_records(r for t in per_rank for r in t.rows())
    if kept:
        expect_reuse(metadata)
    data_files = data_files_from_tables(per_rank)
    for table in per_rank:  # now in storage_data and data_files: not held while pickling
        table.clear()
    storage_writer.finish_assembled(metadata, data_files)


def _commit_metadata(
    storage_writer: StorageWriter,
    global_metadata: Metadata | None,
    gathered: list[Any],
    pending: bool,
    planner: SavePlanner | None,
) -> tuple[tuple[str, str], Metadata | None]:
    """(Coordinator) Build the metadata if pending, then write ``.metadata``."""
    failures = [f"rank {r}: {v}" for r, (s, v) in enumerate(gathered) if s == "error"]
    if failures:
        return ("error", "; ".join(failures)), None
    metadata = global_metadata
    if pending:
        metadata = planner.metadata_from_records([v[1] for _, v in gathered])  # type: ignore[union-attr]
        for _, v in gathered:  # merged into metadata: not held while it is pickled
            v[1][0].clear()
    if metadata is None:
        return ("error", "the coordinator has no global metadata to write"), None
    kept = bool(getattr(planner, "track_structure", False))
    _, finish_error = _attempt(
        lambda: _finish(storage_writer, metadata, [v[0] for _, v in gathered], kept)
    )
    if finish_error is not None:
        return ("error", f"writing .metadata failed: {finish_error}"), None
    return ("ok", ""), metadata


def _attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - propagated to every rank by the caller
        return None, e


def save_state_dict_async_plan(
    state_dict: Any,
    storage_writer: StorageWriter,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
    planner: SavePlanner | None = None,
    cached_ckpt_structure: CachedStructure | None = None,
    loaded_all_plans: list[SavePlan] | None = None,
) -> tuple[StorageWriter, Metadata | None, CachedStructure]:
    """Plan a save collectively and prepare the writer's data (steps 1-3 above).

    ``loaded_all_plans`` (Megatron-Core's plans recorded in a loaded checkpoint) is
    accepted and not needed: reuse is decided from ``cached_ckpt_structure``, so the
    saved checkpoint is the same with or without it.

    Returns:
        ``(storage_writer, metadata, structure)``: the writer ready to write, the
        global metadata (coordinator only, else None) and the structure to pass
        as ``cached_ckpt_structure`` to the next save.
    """
    if planner is None:
        raise CheckpointingException("save_state_dict_async_plan needs a planner")
    group = RankGroup(process_group, coordinator_rank)

    cached = cached_ckpt_structure
    signature: list[Any] | None = None

    def local_step() -> SavePlan:
        nonlocal signature
        # Files are named by the rank within the group (``__<rank>_<n>.distcp``).
        storage_writer.set_up_storage_writer(group.is_coordinator, rank=group.rank)
        planner.set_up_planner(state_dict, storage_writer.storage_meta(), group.is_coordinator)
        if getattr(planner, "track_structure", False):
            signature = planner.structure_signature()  # type: ignore[attr-defined]
            if cached is not None and cached.signature == signature:
                plan = planner.reuse_local_plan(cached.local_plan)  # type: ignore[attr-defined]
                return storage_writer.prepare_local_plan(plan)
        return storage_writer.prepare_local_plan(planner.create_local_plan())

    local_plan, error = _attempt(local_step)
    reuse = (
        cached is not None
        and not cached.metadata_pending
        and local_plan == cached.local_plan
        and (cached.metadata is not None or not group.is_coordinator)
    )
    if error is None and reuse and cached is not None:
        # Prepared before the vote, with the cached plan: when every rank reuses its
        # plan, that vote is the only one. Where this fails, the rank votes "not
        # cached": the plans are exchanged and prepared again, and a failure then is
        # raised on every rank by the second vote.
        plan = cached.central_plan
        _, failed = _attempt(lambda: _prepare(planner, storage_writer, plan, cached))
        reuse = failed is None
    (not_cached,) = group.fail_together(error, "save planning", [0 if reuse else 1])
    assert local_plan is not None
    pending = False
    reused = not_cached == 0 and cached is not None
    if reused and cached is not None:
        logger.debug("Reusing the cached checkpoint structure (no plan exchange)")
        central_plan, metadata = cached.central_plan, cached.metadata
    else:
        if _decentralized(planner):
            # Each rank's final plan is its local plan; the coordinator builds the
            # metadata at finalization (no gather/scatter of plans here).
            central_plan, metadata, pending = local_plan, None, True
        else:
            central_plan, metadata = _exchange_plans(group, local_plan, planner, storage_writer)
        _, error = _attempt(lambda: _prepare(planner, storage_writer, central_plan, None))
        group.fail_together(error, "preparing the data to write")
    digest = cached.results_digest if reused and cached is not None else None
    structure = CachedStructure(local_plan, central_plan, metadata, pending, reused, digest)
    structure.signature = signature
    structure.bucket_layout = getattr(storage_writer, "bucket_layout", None)
    return storage_writer, metadata, structure


def _prepare(
    planner: SavePlanner,
    storage_writer: StorageWriter,
    central_plan: SavePlan,
    reused: CachedStructure | None,
) -> SavePlan:
    """The writer resolves and buckets the data of ``central_plan`` (grouped as the
    ``reused`` structure grouped them, where given)."""
    final = planner.finish_plan(central_plan)
    if reused is not None and reused.bucket_layout is not None:
        storage_writer.bucket_layout = reused.bucket_layout  # type: ignore[attr-defined]
    storage_writer.prepare_write_data(final, planner)  # type: ignore[attr-defined]
    return final


def _exchange_plans(
    group: RankGroup, local_plan: SavePlan, planner: SavePlanner, storage_writer: StorageWriter
) -> tuple[SavePlan, Metadata | None]:
    all_plans = group.gather(local_plan)
    payload: list[Any] | None = None
    metadata: Metadata | None = None
    error: BaseException | None = None
    if group.is_coordinator:
        assert all_plans is not None

        def global_step() -> tuple[list[SavePlan], Metadata]:
            plans, md = planner.create_global_plan(all_plans)
            return storage_writer.prepare_global_plan(plans), md

        result, error = _attempt(global_step)
        if error is not None:
            message = describe_error(error)
            payload = [("error", message)] * group.world
        else:
            assert result is not None
            plans, metadata = result
            payload = [("ok", p) for p in plans]
    status, value = group.scatter(payload)
    if status == "error":
        if group.is_coordinator and error is not None:
            raise error
        raise CheckpointingException(f"global save planning failed on the coordinator: {value}")
    return value, metadata


def _group_of(dist_wrapper: Any, coordinator_rank: int | None = None) -> RankGroup:
    """The RankGroup of a process group (or None: the world) or of an object with a
    ``group`` attribute (DCP's distributed wrapper, which Megatron-Core passes), whose
    ``coordinator_rank`` is used unless one is given."""
    group = dist_wrapper
    if dist_wrapper is not None and not isinstance(dist_wrapper, dist.ProcessGroup):
        if not hasattr(dist_wrapper, "group"):
            raise CheckpointingException(
                f"expected a process group, None or a wrapper with a 'group' attribute, "
                f"got {type(dist_wrapper).__name__}"
            )
        group = dist_wrapper.group
        if coordinator_rank is None:
            coordinator_rank = getattr(dist_wrapper, "coordinator_rank", 0)
    return RankGroup(group, coordinator_rank or 0)


def verify_global_md_reuse(
    loaded_all_plans: list[SavePlan] | None, local_plan: SavePlan, rank: int, dist_wrapper: Any
) -> bool:
    """Whether every rank's ``local_plan`` equals its plan in ``loaded_all_plans`` (the
    plans a loaded checkpoint recorded), ``storage_data`` aside: then that checkpoint's
    global metadata could be reused. Collective over ``dist_wrapper`` (a process
    group, None for the world, or a wrapper with a ``group`` attribute) when plans
    are given."""
    if not loaded_all_plans:
        return False
    group = _group_of(dist_wrapper)
    if len(loaded_all_plans) != group.world:
        return False
    loaded = loaded_all_plans[rank]
    same = all(
        getattr(local_plan, f.name) == getattr(loaded, f.name, None)
        for f in fields(local_plan)
        if f.name != "storage_data"
    )
    (all_same,) = group.all_reduce_ints([int(same)], op=dist.ReduceOp.MIN)
    return all_same == 1


def _all_unchanged(
    group: RankGroup,
    structure: CachedStructure | None,
    storage_writer: StorageWriter,
    digest: int | None,
) -> bool:
    """Whether every rank reused the structure and wrote the same results as at the
    last committed save (one all-reduce, only after a save that reused the structure:
    ``reused`` is the same on every rank)."""
    if structure is None or not structure.reused:
        return False
    same = (
        digest is not None
        and digest == structure.results_digest
        and hasattr(storage_writer, "finish_assembled")
    )
    (all_same,) = group.all_reduce_ints([int(same)], op=dist.ReduceOp.MIN)
    return all_same == 1


def _release_plan(planner: SavePlanner | None, structure: CachedStructure | None) -> None:
    """Drop the references to the plan that the planner and ``structure`` hold."""
    release = getattr(planner, "release", None)
    if callable(release):
        release()
    if structure is not None:
        structure.local_plan = structure.central_plan = SavePlan([])
        structure.bucket_layout = None


def save_state_dict_async_finalize(
    storage_writer: StorageWriter,
    global_metadata: Metadata | None,
    dist_wrapper: Any = None,
    coordinator_rank: int | None = None,
    structure: CachedStructure | None = None,
    planner: SavePlanner | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    release_plan: bool = False,
) -> None:
    """Collect every rank's write results and commit ``.metadata`` (step 3 above).

    ``release_plan`` (a save whose ``structure`` is not kept for the next one): once
    the results are collected, the planner and ``structure`` let go of the plan and
    the data it resolved, so that the metadata is built without them (100,000 tensors:
    about 100 MiB less at the peak).

    ``dist_wrapper`` says which ranks take part: a process group (None: the world,
    or ``process_group``), or, as Megatron-Core passes it, DCP's distributed wrapper
    (any object with a ``group`` and a ``coordinator_rank`` attribute).
    With decentralized planning (``structure.metadata_pending``), every rank also
    sends its plan records and the coordinator builds the metadata with
    ``planner.metadata_from_records``; ``structure`` then caches it.

    Raises:
        CheckpointWriteError: on every rank, if any rank's write failed or the
            metadata could not be written.
    """
    group = _group_of(dist_wrapper if dist_wrapper is not None else process_group, coordinator_rank)
    pending = structure is not None and structure.metadata_pending

    def collect() -> tuple[ResultTable, Any]:
        retrieve = getattr(storage_writer, "retrieve_result_table", None)
        if retrieve is not None:  # ours: the results as columns, as a writer process sent them
            compact = retrieve()
        else:
            compact = ResultTable.of(storage_writer.retrieve_write_results())  # type: ignore[attr-defined]
        release = getattr(storage_writer, "release_write_results", None)
        if release is not None:  # the compact form is all that is used from here on
            release()  # (before the plan records are made: their memory is reused)
        records = planner.plan_records(structure.local_plan) if pending else None  # type: ignore[union-attr]
        return compact, records

    collected, error = _attempt(collect)
    if release_plan:
        _release_plan(planner, structure)
    digest = None if collected is None else collected[0].digest()
    unchanged = _all_unchanged(group, structure, storage_writer, digest)
    if error is not None:
        mine: Any = ("error", describe_error(error))
    elif unchanged:
        mine = collected[0].locations()  # type: ignore[index]
    else:
        mine = ("ok", collected)
    gathered = group.gather(mine)
    outcome: tuple[str, str] = ("ok", "")
    if group.is_coordinator:
        assert gathered is not None
        if unchanged:
            outcome = _commit_unchanged(storage_writer, global_metadata, gathered)
        else:
            outcome, built = _commit_metadata(
                storage_writer, global_metadata, gathered, pending, planner
            )
            if built is not None and structure is not None:
                structure.metadata = built
    status, message = group.broadcast(outcome)
    if status == "ok" and structure is not None:
        structure.metadata_pending = False
        structure.results_digest = digest
        structure.metadata_rewritten = unchanged
    if status == "error":
        if error is not None and isinstance(error, CheckpointingException):
            raise error
        raise CheckpointWriteError(f"Checkpoint save failed: {message}")
