"""DCP planners that plan directly from our ShardedTensors and ShardedObjects.

Save (``MCoreSavePlanner``), call sequence on every rank:
    1. ``set_up_planner(by_key, storage_meta, is_coordinator)`` with the leaves
       grouped by sharded key (``converter.group_by_key``);
    2. ``create_local_plan()``: one write item per stored chunk, one BytesIO
       item per ShardedObject (on every rank that holds a main replica). With
       ``track_structure``, ``structure_signature()`` first; where it equals the one a
       cached plan was made from, ``reuse_local_plan(cached_plan)`` instead;
    3. coordinator only: ``create_global_plan(all_plans)``: DCP's dedup and
       metadata, plus ``Metadata.mcore_data`` (logical shapes of flat tensors);
    4. ``finish_plan(central_plan)``; then the storage writer calls
       ``resolve_data(item)`` for every item it writes;
    5. after the writes, where the plan is not cached for the next save:
       ``release()``.

Load (``MCoreLoadPlanner``), call sequence on every rank:
    1. ``set_up_planner(by_key, metadata, is_coordinator)``;
    2. ``create_local_plan()``: validates every requested global shape against
       the stored one (all mismatches in one error, before any read), then
       maps each request onto the stored chunks;
    3. the storage reader calls ``resolve_tensor`` / ``commit_tensor`` for each
       tensor read item and ``load_bytes`` for each object;
    4. ``check_complete()``: every request was filled; the buffers of destinations
       requested under several keys are copied into them.

Where each read lands (staging buffers for destinations that cannot take the
stored bytes directly, assembling reformulated blocks) is planned by
:class:`~.read_planning.ReadLayout`.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ..._shard_geometry import box_slices
from ...engine.storage.metadata_parts import SharedParts, index_at
from ...errors import (
    CheckpointingException,
    CorruptCheckpointError,
    KeyMismatchError,
    ShapeMismatchError,
)
from ...mapping import ShardedBase, ShardedObject, ShardedTensor, tensor_structure
from .layout import (
    ND_REFORMULATED_SHAPE_KEY,
    stored_chunk,
)
from .read_planning import ReadLayout, read_items

logger = logging.getLogger(__name__)

ByKey = dict[str, list[ShardedBase]]
ObjectLoader = Callable[[bytes, str], Any]


def serialize_object(data: Any) -> io.BytesIO:
    """A ShardedObject payload as Megatron-Core stores it: ``torch.save([data])``."""
    buf = io.BytesIO()
    torch.save([data], buf)
    buf.seek(0)
    return buf


class MCoreSavePlanner(DefaultSavePlanner):
    """Save planner for our sharded state dicts (see the module docstring).

    Args:
        object_serializer: turns a ShardedObject payload into bytes.
        track_structure: the saver records :meth:`structure_signature` with the
            plan, so that a later save of the same structure reuses the plan
            (:meth:`reuse_local_plan`) instead of building every item again.
    """

    def __init__(
        self,
        object_serializer: Callable[[Any], io.BytesIO] = serialize_object,
        dedup_replicated_tensors: bool = False,
        track_structure: bool = False,
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._serialize = object_serializer
        self._dedup = dedup_replicated_tensors
        self.track_structure = track_structure
        self._data: dict[MetadataIndex, Any] = {}
        self.mcore_data: dict[str, dict[str, Any]] = {}

    def set_up_planner(
        self,
        state_dict: ByKey,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        parts = SharedParts()  # one torch.Size per shape, one TensorProperties per dtype
        for key, shards in self.state_dict.items():
            for sh in shards:
                if isinstance(sh, ShardedTensor):
                    items.append(self._tensor_item(key, sh, parts))
                elif isinstance(sh, ShardedObject):
                    index = MetadataIndex(key)
                    items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
                    self._data[index] = sh.data
        self.plan = SavePlan(items, planner_data=self.mcore_data)
        return self.plan

    def structure_signature(self) -> list[tuple[Any, ...]]:
        """What :meth:`create_local_plan` makes of the state dict, leaf by leaf in plan
        order: two state dicts with equal signatures get equal plans (data aside).
        About 0.3 microseconds per leaf, against about 10 to build its item."""
        signature = tensor_structure
        return [
            signature(sh) if isinstance(sh, ShardedTensor) else (key,)
            for key, shards in self.state_dict.items()
            for sh in shards
            if isinstance(sh, (ShardedTensor, ShardedObject))
        ]

    def reuse_local_plan(self, previous: SavePlan) -> SavePlan:
        """``previous`` (a plan of a state dict with the same
        :meth:`structure_signature`) with this state dict's data: the same item
        objects, so that the saver's comparison with the cached plan is one identity
        check per item."""
        leaves = [
            sh
            for shards in self.state_dict.values()
            for sh in shards
            if isinstance(sh, (ShardedTensor, ShardedObject))
        ]
        if len(leaves) != len(previous.items):  # the signature said otherwise: a bug
            raise CheckpointingException(
                f"the cached plan has {len(previous.items)} items for {len(leaves)} leaves"
            )
        data = self._data
        for item, sh in zip(previous.items, leaves):
            value: Any = sh.data
            if item.tensor_data is not None:
                if value is None:
                    raise ShapeMismatchError(f"ShardedTensor '{sh.key}' has no data to save")
                sizes = item.tensor_data.chunk.sizes
                value = value if value.shape == sizes else value.reshape(sizes)
            data[item.index] = value
        self.mcore_data = previous.planner_data
        self.plan = SavePlan(previous.items, planner_data=previous.planner_data)
        return self.plan

    def release(self) -> None:
        """Forget the plan, the data it resolved and the state dict: the saver calls it
        once the writes are done, where the plan is not kept for the next save."""
        self.plan = SavePlan([])
        self._data = {}
        self.state_dict = {}

    def _tensor_item(self, key: str, sh: ShardedTensor, parts: SharedParts) -> WriteItem:
        chunk = stored_chunk(sh)
        if sh.flattened_range is not None:
            self.mcore_data[key] = {ND_REFORMULATED_SHAPE_KEY: tuple(sh.global_shape)}
        elif key not in self.mcore_data:
            self.mcore_data[key] = {}
        data = sh.data
        if data is None:
            raise ShapeMismatchError(f"ShardedTensor '{key}' has no data to save")
        # Shapes and properties shared between items (immutable): 100,000 items hold
        # about 30 MiB less while they are written.
        shared = parts.chunk(chunk.offsets, chunk.sizes)
        index = index_at(key, shared.offsets)
        # A new view per item costs microseconds: reshape only when the shape differs.
        sizes = shared.sizes
        if data.shape != sizes:
            if data.numel() != sizes.numel():  # data replaced after construction
                raise ShapeMismatchError(
                    f"ShardedTensor '{key}': its data has shape {tuple(data.shape)}, not the "
                    f"{sizes.numel()} elements of its chunk {tuple(sizes)}"
                )
            data = data.reshape(sizes)
        self._data[index] = data
        return WriteItem(
            index=index,
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=shared,
                properties=parts.properties(sh.dtype),
                size=parts.size(chunk.global_shape),
            ),
        )

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self._dedup:
            global_plan, metadata = super().create_global_plan(all_plans)
        else:
            # Only main replicas are planned and the sharding was validated already:
            # no dedup, no per-item index rewriting (index hints are optional).
            global_plan, metadata = create_default_global_save_plan(
                all_plans, rewrite_index_hints=False
            )
        mcore_data: dict[str, dict[str, Any]] = {}
        for plan in all_plans:
            for key, value in (plan.planner_data or {}).items():
                if value or key not in mcore_data:
                    mcore_data[key] = value
        # Plain dicts and tuples only: the pickled Metadata must reference torch classes only.
        metadata.mcore_data = mcore_data  # type: ignore[attr-defined]
        global_plan = [SavePlan(p.items, p.storage_data, None, p.usable) for p in global_plan]
        return global_plan, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    # Decentralized planning: without deduplication, a rank's final plan is its local
    # plan, and the coordinator needs only a compact description of every rank's
    # items to build the metadata (at finalization, with the write results).

    @property
    def supports_decentralized_plan(self) -> bool:
        """Whether ranks can skip the plan exchange (no deduplication needed)."""
        return not self._dedup

    @staticmethod
    def plan_records(plan: SavePlan) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
        """A compact, cheaply pickled description of a local plan's items: a record per
        item (equal shapes as one tuple, which pickle sends once) and the ``mcore_data``
        entries that are not empty (:meth:`metadata_from_records` adds the others)."""
        records: list[tuple[Any, ...]] = []
        tuples: dict[int, tuple[int, ...]] = {}  # by the id of a (shared) torch.Size

        def as_tuple(shape: torch.Size) -> tuple[int, ...]:
            made = tuples.get(id(shape))
            if made is None:
                made = tuples[id(shape)] = tuple(shape)
            return made

        for item in plan.items:
            td = item.tensor_data
            if td is None:
                records.append((item.index.fqn,))
            else:
                chunk = td.chunk
                records.append(
                    (
                        item.index.fqn,
                        as_tuple(chunk.offsets),
                        as_tuple(chunk.sizes),
                        as_tuple(td.size),
                        td.properties.dtype,
                    )
                )
        extras = {key: value for key, value in (plan.planner_data or {}).items() if value}
        return records, extras

    @staticmethod
    def metadata_from_records(
        all_records: list[tuple[list[tuple[Any, ...]], dict[str, Any]]],
    ) -> Metadata:
        """The global Metadata (without storage data) from every rank's plan records.

        Every tensor has an entry in ``mcore_data``; those without extras share one
        empty dict (read-only, as the rest of a built ``Metadata``)."""
        md: dict[str, Any] = {}
        mcore_data: dict[str, dict[str, Any]] = {}
        no_extras: dict[str, Any] = {}
        parts = SharedParts()  # equal shapes and dtypes: one object each (a faster pickle)
        shape = parts.size
        for records, planner_data in all_records:
            for rec in records:
                if len(rec) == 1:
                    md[rec[0]] = BytesStorageMetadata()
                    continue
                fqn, offsets, sizes, size, dtype = rec
                tmd = md.get(fqn)
                if tmd is None:
                    tmd = md[fqn] = TensorStorageMetadata(parts.properties(dtype), shape(size), [])
                    if fqn not in mcore_data:
                        mcore_data[fqn] = no_extras
                tmd.chunks.append(parts.chunk(offsets, sizes))
            for key, value in planner_data.items():
                if value or key not in mcore_data:
                    mcore_data[key] = value
        metadata = Metadata(state_dict_metadata=md)
        metadata.mcore_data = mcore_data  # type: ignore[attr-defined]
        return metadata

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = self._data[write_item.index]
        if write_item.type == WriteItemType.BYTE_IO:
            return self._serialize(data)
        tensor: torch.Tensor = data
        return tensor


class MCoreLoadPlanner(DefaultLoadPlanner):
    """Load planner for our sharded state dicts (see the module docstring).

    Args:
        object_loader: ``(bytes, source) -> payload`` for ShardedObjects (the
            safe loader of the strategy; it decides what types are allowed).
    """

    def __init__(self, object_loader: ObjectLoader) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._load_object = object_loader
        # Every requested copy of an object shard, by key (a rank may hold several).
        self._objects: dict[str, list[ShardedObject]] = {}
        self._layout: ReadLayout | None = None

    def set_up_planner(
        self, state_dict: ByKey, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.state_dict = state_dict
        self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self._layout = None if metadata is None else ReadLayout(metadata)

    @property
    def layout(self) -> ReadLayout:
        """Where this load's reads land (available after :meth:`set_up_planner`)."""
        if self._layout is None:
            raise CorruptCheckpointError("the load planner was set up without metadata")
        return self._layout

    # ------------------------------------------------------------------ planning

    def validate_requests(self) -> None:
        """Check every request against the stored metadata before reading anything."""
        assert self.metadata is not None
        sd_md = self.metadata.state_dict_metadata
        missing, mismatched = [], []
        for key, shards in self.state_dict.items():
            md = sd_md.get(key)
            if md is None:
                missing.append(key)
                continue
            for sh in shards:
                if isinstance(sh, ShardedObject):
                    if not isinstance(md, BytesStorageMetadata):
                        mismatched.append(f"'{key}': requested an object, stored a tensor")
                    continue
                assert isinstance(sh, ShardedTensor)
                if not isinstance(md, TensorStorageMetadata):
                    mismatched.append(f"'{sh.key}': requested a tensor, stored an object")
                    continue
                stored = self.layout.stored_logical_shape(key, md)
                if tuple(sh.global_shape) != stored and not sh.allow_shape_mismatch:
                    mismatched.append(
                        f"'{sh.key}': requested global shape {tuple(sh.global_shape)}, "
                        f"stored {stored}"
                    )
        if missing:
            raise KeyMismatchError(
                f"Keys not found in the checkpoint: {sorted(missing)}. Use a non-default "
                "`strict` mode to skip keys that are not in the checkpoint."
            )
        if mismatched:
            raise ShapeMismatchError(
                "Requested tensors do not match the checkpoint (set allow_shape_mismatch=True "
                "on a ShardedTensor to load only the overlap):\n  " + "\n  ".join(mismatched)
            )

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        self.validate_requests()
        mismatch_allowed = set()
        for key, shards in self.state_dict.items():
            for sh in shards:
                if isinstance(sh, ShardedObject):
                    self._objects.setdefault(key, []).append(sh)
                else:
                    assert isinstance(sh, ShardedTensor)
                    self.layout.plan_tensor(key, sh)
                    if sh.allow_shape_mismatch:
                        mismatch_allowed.add(key)
        self.layout.isolate_shared()
        items: list[ReadItem] = [
            ReadItem(
                type=LoadItemType.BYTE_IO,
                dest_index=MetadataIndex(key),
                dest_offsets=torch.Size((0,)),
                storage_index=MetadataIndex(key),
                storage_offsets=torch.Size((0,)),
                lengths=torch.Size((0,)),
            )
            for key in self._objects
        ]
        for key, chunk_targets in self.layout.chunks.items():
            md = self.metadata.state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata)
            reads = read_items(key, md, [c for c, _ in chunk_targets])
            self.layout.count_reads(key, reads, chunk_targets, key in mismatch_allowed)
            items.extend(reads)
        self.layout.finish_ready()
        self.plan = LoadPlan(items)
        return self.plan

    # ------------------------------------------------------------------ reading

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self.layout.dest(read_item)
        lengths = read_item.lengths
        if dest.shape == lengths and not any(read_item.dest_offsets):
            return dest  # the whole destination: no new view (microseconds per item)
        return dest[box_slices(tuple(read_item.dest_offsets), tuple(lengths))]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        staging = self.layout.staging(read_item)
        if staging is None:
            return
        staging.pending -= 1
        if staging.pending == 0:
            self.layout.finish_staging(staging)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        data = value.getvalue()
        for sh in self._objects[key]:  # each copy gets its own payload
            payload = self._load_object(data, key)
            # Megatron-Core stores torch.save([payload]); a bare payload is accepted too.
            if isinstance(payload, list) and len(payload) == 1:
                payload = payload[0]
            sh.data = payload

    def check_complete(self) -> None:
        """Raise if some staging buffer did not receive all its reads; else copy the
        buffers of destinations requested under several keys into them."""
        incomplete = self.layout.incomplete()
        if incomplete:
            raise CorruptCheckpointError(
                f"{len(incomplete)} staging buffer(s) were not completely read; "
                "the checkpoint's data files do not match its metadata"
            )
        self.layout.finish_shared()
