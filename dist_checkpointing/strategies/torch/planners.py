"""DCP planners that plan directly from our ShardedTensors and ShardedObjects.

Save (``MCoreSavePlanner``), call sequence on every rank:
    1. ``set_up_planner(by_key, storage_meta, is_coordinator)`` with the leaves
       grouped by sharded key (``_replace_state_dict_keys_with_sharded_keys``);
    2. ``create_local_plan()``: one write item per stored chunk, one BytesIO
       item per ShardedObject (on every rank that holds a main replica);
    3. coordinator only: ``create_global_plan(all_plans)``: DCP's dedup and
       metadata, plus ``Metadata.mcore_data`` (logical shapes of flat tensors);
    4. ``finish_plan(central_plan)``; then the storage writer calls
       ``resolve_data(item)`` for every item it writes.

Load (``MCoreLoadPlanner``), call sequence on every rank:
    1. ``set_up_planner(by_key, metadata, is_coordinator)``;
    2. ``create_local_plan()``: validates every requested global shape against
       the stored one (all mismatches in one error, before any read), then
       maps each request onto the stored chunks;
    3. the storage reader calls ``resolve_tensor`` / ``commit_tensor`` for each
       tensor read item and ``load_bytes`` for each object;
    4. ``check_complete()``: every request was filled.

A request whose destination cannot take the stored bytes directly (a
non-contiguous view, another dtype such as FP8, a flat slice of a block, a
different flat layout) reads into a contiguous staging tensor; when the last
read item of a staging tensor commits, it is copied into the destination.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
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
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ...errors import CorruptCheckpointError, KeyMismatchError, ShapeMismatchError
from ...mapping import ShardedBase, ShardedObject, ShardedTensor
from .layout import (
    ND_REFORMULATED_SHAPE_KEY,
    block_shape,
    flat_range_rows,
    reformulated_global_shape,
    stored_chunk,
)

logger = logging.getLogger(__name__)

ByKey = dict[str, list[ShardedBase]]
ObjectLoader = Callable[[bytes, str], Any]


def _size(x: tuple[int, ...]) -> torch.Size:
    return torch.Size(x)


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
    """

    def __init__(
        self,
        object_serializer: Callable[[Any], io.BytesIO] = serialize_object,
        dedup_replicated_tensors: bool = False,
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._serialize = object_serializer
        self._dedup = dedup_replicated_tensors
        self._data: dict[MetadataIndex, Any] = {}
        self.mcore_data: dict[str, dict] = {}

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
        for key, shards in self.state_dict.items():
            for sh in shards:
                if isinstance(sh, ShardedTensor):
                    items.append(self._tensor_item(key, sh))
                elif isinstance(sh, ShardedObject):
                    index = MetadataIndex(key)
                    items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
                    self._data[index] = sh.data
        self.plan = SavePlan(items, planner_data=self.mcore_data)
        return self.plan

    def _tensor_item(self, key: str, sh: ShardedTensor) -> WriteItem:
        chunk = stored_chunk(sh)
        if sh.flattened_range is not None:
            self.mcore_data[key] = {ND_REFORMULATED_SHAPE_KEY: tuple(sh.global_shape)}
        else:
            self.mcore_data.setdefault(key, {})
        index = MetadataIndex(key, _size(chunk.offsets))
        if sh.data is None:
            raise ShapeMismatchError(f"ShardedTensor '{key}' has no data to save")
        self._data[index] = sh.data.reshape(chunk.sizes)
        return WriteItem(
            index=index,
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=_size(chunk.offsets), sizes=_size(chunk.sizes)),
                properties=TensorProperties(dtype=sh.dtype),
                size=_size(chunk.global_shape),
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
        mcore_data: dict[str, dict] = {}
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
    def plan_records(plan: SavePlan) -> tuple[list[tuple], dict]:
        """A compact, cheaply pickled description of a local plan's items."""
        records: list[tuple] = []
        for item in plan.items:
            td = item.tensor_data
            if td is None:
                records.append((item.index.fqn,))
            else:
                records.append(
                    (
                        item.index.fqn,
                        tuple(td.chunk.offsets),
                        tuple(td.chunk.sizes),
                        tuple(td.size),
                        td.properties.dtype,
                    )
                )
        return records, plan.planner_data or {}

    @staticmethod
    def metadata_from_records(all_records: list[tuple[list[tuple], dict]]) -> Metadata:
        """The global Metadata (without storage data) from every rank's plan records."""
        md: dict[str, Any] = {}
        mcore_data: dict[str, dict] = {}
        for records, planner_data in all_records:
            for rec in records:
                if len(rec) == 1:
                    md[rec[0]] = BytesStorageMetadata()
                    continue
                fqn, offsets, sizes, size, dtype = rec
                tmd = md.get(fqn)
                if tmd is None:
                    tmd = md[fqn] = TensorStorageMetadata(
                        TensorProperties(dtype=dtype), torch.Size(size), []
                    )
                tmd.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
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
        return data


@dataclass(eq=False)
class _Staging:
    """A buffer that read items fill; ``on_done`` runs when the last one committed."""

    buffer: torch.Tensor
    pending: int = 0
    on_done: list[Callable[[], None]] = field(default_factory=list)


@dataclass(eq=False)
class _Target:
    """Where the read items of one (key, chunk list index) land."""

    dest: torch.Tensor
    staging: _Staging | None = None


def _contiguous_dest(dest: torch.Tensor, dtype: torch.dtype) -> bool:
    return dest.dtype == dtype and dest.is_contiguous()


def _box_slices(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def _intersect(
    a_off: tuple[int, ...], a_sz: tuple[int, ...], b_off: tuple[int, ...], b_sz: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a_off, a_sz, b_off, b_sz))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _read_items(
    fqn: str, md: TensorStorageMetadata, chunks: list[ChunkStorageMetadata]
) -> list[ReadItem]:
    """Read items that fill ``chunks`` from the stored chunks of ``md``.

    A request that is exactly one stored chunk (same layout at save and load, the
    common case) becomes one read item directly; anything else goes through
    DCP's general overlap computation.
    """
    stored = {(tuple(c.offsets), tuple(c.sizes)): i for i, c in enumerate(md.chunks)}
    exact = [stored.get((tuple(c.offsets), tuple(c.sizes))) for c in chunks]
    if None not in exact:
        return [
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(fqn, c.offsets, i),
                dest_offsets=torch.Size((0,) * len(c.sizes)),
                storage_index=MetadataIndex(fqn, c.offsets, j),
                storage_offsets=torch.Size((0,) * len(c.sizes)),
                lengths=c.sizes,
            )
            for i, (c, j) in enumerate(zip(chunks, exact))
        ]
    return create_read_items_for_chunk_list(fqn, md, chunks)


class MCoreLoadPlanner(DefaultLoadPlanner):
    """Load planner for our sharded state dicts (see the module docstring).

    Args:
        object_loader: ``(bytes, source) -> payload`` for ShardedObjects (the
            safe loader of the strategy; it decides what types are allowed).
    """

    def __init__(self, object_loader: ObjectLoader) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._load_object = object_loader
        self._chunks: dict[str, list[tuple[ChunkStorageMetadata, _Target]]] = {}
        self._block_cache: dict[tuple[str, tuple[int, ...]], _Staging] = {}
        self._objects: dict[str, ShardedObject] = {}
        self._stagings: list[_Staging] = []

    def set_up_planner(
        self, state_dict: ByKey, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.state_dict = state_dict
        self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    # ------------------------------------------------------------------ planning

    def _stored_logical_shape(self, key: str, md: TensorStorageMetadata) -> tuple[int, ...]:
        orig = self._mcore_data().get(key, {}).get(ND_REFORMULATED_SHAPE_KEY)
        return tuple(orig) if orig is not None else tuple(md.size)

    def _mcore_data(self) -> dict[str, dict]:
        return getattr(self.metadata, "mcore_data", None) or {}

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
                stored = self._stored_logical_shape(key, md)
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
        for key, shards in self.state_dict.items():
            for sh in shards:
                if isinstance(sh, ShardedObject):
                    self._objects[key] = sh
                else:
                    assert isinstance(sh, ShardedTensor)
                    self._plan_tensor(key, sh)
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
        for key, chunk_targets in self._chunks.items():
            md = self.metadata.state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata)
            reads = _read_items(key, md, [c for c, _ in chunk_targets])
            self._count_reads(key, reads, chunk_targets)
            items.extend(reads)
        for staging in self._stagings:
            if staging.pending == 0:
                self._finish_staging(staging)
        self.plan = LoadPlan(items)
        return self.plan

    def _count_reads(
        self,
        key: str,
        reads: list[ReadItem],
        chunk_targets: list[tuple[ChunkStorageMetadata, _Target]],
    ) -> None:
        covered = [0] * len(chunk_targets)
        for r in reads:
            idx = r.dest_index.index
            assert idx is not None
            covered[idx] += math.prod(r.lengths)
            staging = chunk_targets[idx][1].staging
            if staging is not None:
                staging.pending += 1
        for (chunk, _), n in zip(chunk_targets, covered):
            if n != math.prod(chunk.sizes) and not self._allows_mismatch(key):
                raise CorruptCheckpointError(
                    f"'{key}': the checkpoint's chunks cover {n} of the {math.prod(chunk.sizes)} "
                    f"requested elements at offsets {tuple(chunk.offsets)}; its metadata is "
                    "inconsistent"
                )

    def _allows_mismatch(self, key: str) -> bool:
        return any(getattr(sh, "allow_shape_mismatch", False) for sh in self.state_dict[key])

    def _add_chunk(
        self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], target: _Target
    ) -> None:
        chunk = ChunkStorageMetadata(offsets=_size(offsets), sizes=_size(sizes))
        self._chunks.setdefault(key, []).append((chunk, target))

    def _new_staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> _Staging:
        staging = _Staging(torch.empty(shape, dtype=dtype))
        self._stagings.append(staging)
        return staging

    def _plan_tensor(self, key: str, sh: ShardedTensor) -> None:
        assert self.metadata is not None and sh.data is not None
        md = self.metadata.state_dict_metadata[key]
        assert isinstance(md, TensorStorageMetadata)
        stored_dtype = md.properties.dtype
        orig = self._mcore_data().get(key, {}).get(ND_REFORMULATED_SHAPE_KEY)
        block = block_shape(sh)
        if orig is None:
            if sh.flattened_range is None:
                self._plan_direct(key, tuple(sh.global_offset), block, sh.data, stored_dtype, sh)
            else:
                self._plan_flat_from_regular(key, sh, stored_dtype)
            return
        same_grid = tuple(md.size) == reformulated_global_shape(tuple(orig), block)
        if sh.flattened_range is not None and same_grid:
            chunk = stored_chunk(sh)
            self._plan_direct(key, chunk.offsets, chunk.sizes, sh.data, stored_dtype, sh)
        else:
            self._plan_from_reformulated(key, sh, tuple(orig), md)

    def _plan_direct(
        self,
        key: str,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        data: torch.Tensor,
        stored_dtype: torch.dtype,
        sh: ShardedTensor,
    ) -> None:
        """Read the stored box straight into ``data`` (or via staging if it cannot)."""
        view = data.view(sizes) if data.is_contiguous() else None
        if view is not None and _contiguous_dest(view, stored_dtype):
            self._add_chunk(key, offsets, sizes, _Target(view))
            return
        staging = self._new_staging(sizes, stored_dtype)

        def copy_back() -> None:
            data.copy_(staging.buffer.reshape(data.shape))

        staging.on_done.append(copy_back)
        self._add_chunk(key, offsets, sizes, _Target(staging.buffer, staging))

    def _plan_flat_from_regular(
        self, key: str, sh: ShardedTensor, stored_dtype: torch.dtype
    ) -> None:
        """A flat request from a tensor stored in its logical shape: read the rows of
        the block that the range touches, then copy the range out."""
        assert sh.flattened_range is not None and sh.data is not None
        block = block_shape(sh)
        first, last = flat_range_rows(block, sh.flattened_range)
        offsets = (sh.global_offset[0] + first,) + tuple(sh.global_offset[1:])
        sizes = (last - first,) + block[1:]
        staging = self._new_staging(sizes, stored_dtype)
        start = sh.flattened_range.start - first * math.prod(block[1:])
        data = sh.data

        def copy_range() -> None:
            data.copy_(staging.buffer.reshape(-1)[start : start + data.numel()])

        staging.on_done.append(copy_range)
        self._add_chunk(key, offsets, sizes, _Target(staging.buffer, staging))

    def _plan_from_reformulated(
        self, key: str, sh: ShardedTensor, orig: tuple[int, ...], md: TensorStorageMetadata
    ) -> None:
        """A request whose layout differs from the stored N-D reformulated blocks:
        assemble the stored blocks it overlaps, then copy the overlap."""
        assert sh.data is not None
        grid = tuple(md.size[:-1])
        stored_block = tuple(o // g if g else 0 for o, g in zip(orig, grid))
        req_block = block_shape(sh)
        req_off = tuple(sh.global_offset)
        finish_request: Callable[[torch.Tensor], None] | None = None
        if sh.flattened_range is None:
            box_off, box_size = req_off, req_block
            data = sh.data
            if data.is_contiguous():
                out = data.view(req_block)
            else:
                out = torch.empty(box_size, dtype=data.dtype)

                def finish_request(box: torch.Tensor) -> None:
                    data.copy_(box.reshape(data.shape))
        else:
            first, last = flat_range_rows(req_block, sh.flattened_range)
            box_off = (req_off[0] + first,) + req_off[1:]
            box_size = (last - first,) + req_block[1:]
            out = torch.empty(box_size, dtype=md.properties.dtype)
            start = sh.flattened_range.start - first * math.prod(req_block[1:])
            flat = sh.data

            def finish_request(box: torch.Tensor) -> None:
                flat.copy_(box.reshape(-1)[start : start + flat.numel()])

        blocks = self._overlapping_blocks(box_off, box_size, stored_block, grid)
        request = _Staging(out, pending=len(blocks))
        for cell in blocks:
            staging = self._stored_block(key, cell, stored_block, md.properties.dtype)
            cell_off = tuple(c * b for c, b in zip(cell, stored_block))

            def copy_overlap(
                staging: _Staging = staging, cell_off: tuple[int, ...] = cell_off
            ) -> None:
                inter = _intersect(cell_off, stored_block, box_off, box_size)
                assert inter is not None
                lo, size = inter
                src = staging.buffer.reshape(stored_block)[
                    _box_slices(tuple(a - b for a, b in zip(lo, cell_off)), size)
                ]
                request.buffer[_box_slices(tuple(a - b for a, b in zip(lo, box_off)), size)].copy_(
                    src
                )
                request.pending -= 1
                if request.pending == 0 and finish_request is not None:
                    finish_request(request.buffer)

            staging.on_done.append(copy_overlap)

    @staticmethod
    def _overlapping_blocks(
        box_off: tuple[int, ...],
        box_size: tuple[int, ...],
        stored_block: tuple[int, ...],
        grid: tuple[int, ...],
    ) -> list[tuple[int, ...]]:
        ranges = []
        for o, s, b, g in zip(box_off, box_size, stored_block, grid):
            if s == 0 or b == 0:
                return []
            ranges.append(range(o // b, min(-(-(o + s) // b), g)))
        cells: list[tuple[int, ...]] = [()]
        for r in ranges:
            cells = [c + (i,) for c in cells for i in r]
        return cells

    def _stored_block(
        self, key: str, cell: tuple[int, ...], stored_block: tuple[int, ...], dtype: torch.dtype
    ) -> _Staging:
        """The staging buffer of one stored block (read once per rank and load)."""
        cached = self._block_cache.get((key, cell))
        if cached is not None:
            return cached
        numel = math.prod(stored_block)
        staging = self._new_staging((1,) * len(cell) + (numel,), dtype)
        self._block_cache[(key, cell)] = staging
        self._add_chunk(
            key, cell + (0,), (1,) * len(cell) + (numel,), _Target(staging.buffer, staging)
        )
        return staging

    # ------------------------------------------------------------------ reading

    def _target(self, read_item: ReadItem) -> _Target:
        idx = read_item.dest_index.index
        assert idx is not None
        return self._chunks[read_item.dest_index.fqn][idx][1]

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self._target(read_item).dest
        return dest[_box_slices(tuple(read_item.dest_offsets), tuple(read_item.lengths))]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        staging = self._target(read_item).staging
        if staging is None:
            return
        staging.pending -= 1
        if staging.pending == 0:
            self._finish_staging(staging)

    @staticmethod
    def _finish_staging(staging: _Staging) -> None:
        for fn in staging.on_done:
            fn()
        staging.on_done.clear()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        payload = self._load_object(value.getvalue(), key)
        # Megatron-Core stores torch.save([payload]); a bare payload is accepted too.
        if isinstance(payload, list) and len(payload) == 1:
            payload = payload[0]
        self._objects[key].data = payload

    def check_complete(self) -> None:
        """Raise if some staging buffer did not receive all its reads."""
        incomplete = [s for s in self._stagings if s.pending or s.on_done]
        if incomplete:
            raise CorruptCheckpointError(
                f"{len(incomplete)} staging buffer(s) were not completely read; "
                "the checkpoint's data files do not match its metadata"
            )
