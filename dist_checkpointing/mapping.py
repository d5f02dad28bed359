"""The sharded state dict: leaves that describe a rank's part of a global tensor or object.

Same classes, parameters and semantics as Megatron-Core's
``dist_checkpointing.mapping``:

- :class:`ShardedTensor`: "this local tensor is the block at ``global_offset``
  of the global tensor ``key`` of shape ``global_shape``", optionally only a
  contiguous flat range of that block (distributed optimizer);
- :class:`ShardedObject`: one shard of a grid of picklable objects;
- :class:`ShardedTensorFactory`: a tensor that is saved as something else
  (built before save, merged back after load);
- :class:`LocalNonpersistentObject`: a value that is not saved and comes back
  from ``load`` as it was passed.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import chain
from operator import attrgetter
from typing import Any, TypeGuard, TypeVar

import numpy as np
import torch

from ._factories import (
    FactoryBuildFn,
    FactoryMergeFn,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from ._shard_geometry import (
    flat_global_coordinates,
    flat_local_coordinates,
    grid_block_shape,
    grid_from_rank_offsets,
    metadata_problem,
    narrowed_flat_range,
    narrowed_grid,
    object_unique_key,
    parse_object_unique_key,
)
from ._sharded_base import (
    CommonStateDict,
    ReplicaId,
    ShardedBase,
    ShardedStateDict,
    StateDict,
    is_main_replica,
)
from .errors import MappingError

logger = logging.getLogger(__name__)

__all__ = [
    "ReplicaId",
    "StateDict",
    "ShardedStateDict",
    "CommonStateDict",
    "ShardedBase",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonpersistentObject",
    "is_main_replica",
    "apply_factories",
    "apply_factory_merges",
    "FactoryBuildFn",
    "FactoryMergeFn",
]


_T = TypeVar("_T")


def _shallow_copy(obj: _T) -> _T:
    """``copy.copy(obj)``; for our own leaf classes (not subclasses, which may customize
    copying) without the generic protocol (``__reduce_ex__``), which costs microseconds
    per leaf on every save and load. Fields are copied by attribute, never through
    ``__dict__``: touching it makes CPython build an instance dict, a second object per
    leaf for the garbage collector (see :meth:`ShardedTensor.from_rank_offsets`)."""
    cls = type(obj)
    if cls is ShardedTensor:
        out: Any = object.__new__(cls)
        (
            out.key,
            out.data,
            out.dtype,
            out.local_shape,
            out.global_shape,
            out.global_offset,
            out.axis_fragmentations,
            out.replica_id,
            out.prepend_axis_num,
            out.allow_shape_mismatch,
            out.flattened_range,
        ) = _tensor_fields(obj)
        return out  # type: ignore[no-any-return]
    if cls is ShardedObject:
        out = object.__new__(cls)
        out.key, out.data, out.global_shape, out.global_offset, out.replica_id = _object_fields(obj)
        return out  # type: ignore[no-any-return]
    return copy.copy(obj)


@dataclass
class ShardedTensor(ShardedBase):
    """A local tensor that is one block of a global tensor.

    Args:
        key: unique name of the global tensor.
        data: the local tensor (``None`` for metadata-only instances).
        dtype: dtype of the global tensor; must equal ``data.dtype``.
        local_shape: shape of the local block (without prepended axes).
        global_shape: shape of the global tensor (with prepended axes).
        global_offset: offset of the block in the global tensor (with prepended axes).
        axis_fragmentations: number of blocks along each global axis.
        replica_id: 0 (or all zeros) for the replica that is saved; others are skipped.
        prepend_axis_num: number of leading global axes the local tensor does not
            have (e.g. the layer axis of per-layer weights).
        allow_shape_mismatch: at load, the local tensor may differ from the stored
            block (e.g. padded vocabularies); only the overlapping part is filled.
        flattened_range: when set, ``data`` is the 1-D slice ``[start, stop)`` of
            the C-order flattening of the ``local_shape`` block.
    """

    key: str
    data: torch.Tensor | None = field(repr=False)
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.local_shape = tuple(self.local_shape)
        self.global_shape = tuple(self.global_shape)
        self.global_offset = tuple(self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = tuple(self.axis_fragmentations)
        self.validate_metadata_integrity()

    def _fail(self, msg: str) -> MappingError:
        return MappingError(f"ShardedTensor '{self.key}': {msg}")

    def validate_metadata_integrity(self) -> None:
        """Check dtype, shapes, offsets, fragmentations and the flattened range agree.

        Raises:
            MappingError: naming the key and the inconsistent fields.
        """
        if not isinstance(self.key, str) or not self.key:
            raise MappingError(f"ShardedTensor key must be a non-empty str, got {self.key!r}")
        problem = metadata_problem(self)
        if problem is not None:
            raise self._fail(problem)

    def global_slice(self) -> tuple[int | slice, ...]:
        """Index of the local block in the global tensor (ints on prepended axes)."""
        p = self.prepend_axis_num
        return tuple(
            chain(
                self.global_offset[:p],
                (slice(off, off + sh) for off, sh in zip(self.global_offset[p:], self.local_shape)),
            )
        )

    def global_coordinates(self) -> tuple[np.ndarray, ...]:
        """Global coordinates of every element of a flat ShardedTensor's data."""
        if self.flattened_range is None:
            raise self._fail("global_coordinates is only defined for flattened ShardedTensors")
        return flat_global_coordinates(
            self.flattened_range, self.local_shape, self.global_offset, self.prepend_axis_num
        )

    def local_coordinates(self) -> tuple[np.ndarray, ...]:
        """Coordinates in the local block of every element of a flat ShardedTensor's data."""
        if self.flattened_range is None:
            raise self._fail("local_coordinates is only defined for flattened ShardedTensors")
        return flat_local_coordinates(self.flattened_range, self.local_shape)

    def local_chunk_offset_in_global(self) -> tuple[int, ...]:
        """Position of the local block in the grid of blocks."""
        p = self.prepend_axis_num
        offsets = list(self.global_offset[:p])
        for off, sh in zip(self.global_offset[p:], self.local_shape):
            offsets.append(off // sh if sh else 0)
        return tuple(offsets)

    def max_allowed_chunks(self) -> tuple[int, ...]:
        """The block size implied by ``axis_fragmentations`` on each axis."""
        if self.axis_fragmentations is None:
            raise self._fail("axis_fragmentations is None")
        chunks = grid_block_shape(
            self.global_shape, self.axis_fragmentations, self.allow_shape_mismatch
        )
        if isinstance(chunks, str):
            raise self._fail(chunks)
        return chunks

    def without_data(self) -> ShardedTensor:
        # A shallow copy: the metadata was validated at construction (replace() would
        # validate again, which dominates planning time for many small tensors).
        out = _shallow_copy(self)
        out.data = None
        return out

    def init_data(
        self, device: str | torch.device, init_fn: Callable[..., torch.Tensor] = torch.empty
    ) -> None:
        """Allocate ``data`` (if not set) with ``init_fn(local_shape, dtype=, device=)``."""
        if self.data is not None:
            return
        data = init_fn(self.local_shape, dtype=self.dtype, device=device)
        if self.flattened_range is not None:
            data = data.flatten()[self.flattened_range.start : self.flattened_range.stop]
        self.data = data

    def narrow(self, dim: int, start: int, length: int) -> list[ShardedTensor]:
        """Like ``torch.narrow`` on every rank's local tensor.

        Each rank keeps ``[start, start + length)`` of its block along local axis
        ``dim``; the global shape and offset shrink accordingly. For a flat
        ShardedTensor (only ``dim=0``), the result is empty if the narrowed block
        does not intersect the flat range.
        """
        grid = narrowed_grid(
            self.global_shape,
            self.global_offset,
            self.local_shape,
            self.prepend_axis_num,
            dim,
            length,
        )
        if isinstance(grid, str):
            raise self._fail(grid)
        global_shape, global_offset, local_shape = grid
        if self.flattened_range is None:
            data = self.data.narrow(dim, start, length) if self.data is not None else None
            return [
                replace(
                    self,
                    data=data,
                    local_shape=local_shape,
                    global_shape=global_shape,
                    global_offset=global_offset,
                )
            ]
        if dim != 0:
            raise self._fail(
                f"narrowing a flat ShardedTensor is only supported on dim 0, got {dim}"
            )
        narrowed = narrowed_flat_range(self.flattened_range, self.local_shape, start, length)
        if narrowed is None:
            return []
        new_range, kept = narrowed
        data = None if self.data is None else self.data[kept]
        return [
            replace(
                self,
                data=data,
                local_shape=local_shape,
                global_shape=global_shape,
                global_offset=global_offset,
                flattened_range=new_range,
            )
        ]

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """A ShardedTensor on a regular grid, from ``(axis, axis_rank_offset, axis_fragmentations)``.

        ``axis`` counts the prepended axes: with ``prepend_axis_num=1``, axis 0 is
        the prepended one (local size 1) and axis 1 is ``data``'s axis 0.

        Example:
            >>> import torch
            >>> t = torch.zeros(4, 6)
            >>> sh = ShardedTensor.from_rank_offsets("w", t, (0, 1, 2))  # rank 1 of 2 on axis 0
            >>> sh.global_shape, sh.global_offset
            ((8, 6), (4, 0))
        """
        if flattened_range is not None:
            raise MappingError(
                f"ShardedTensor '{key}': from_rank_offsets does not take flattened_range; "
                "use ShardedTensor.from_rank_offsets_flat"
            )
        if not isinstance(data, torch.Tensor):
            raise MappingError(
                f"ShardedTensor '{key}': data must be a torch.Tensor, got {type(data).__name__}"
            )
        shape = tuple(data.shape)
        grid = grid_from_rank_offsets(shape, rank_offsets, prepend_axis_num)
        if isinstance(grid, str):
            raise MappingError(f"ShardedTensor '{key}': {grid}")
        global_shape, global_offset, fragmentations = grid
        if cls is ShardedTensor and not init_kwargs and prepend_axis_num >= 0:
            if not isinstance(key, str) or not key:
                raise MappingError(f"ShardedTensor key must be a non-empty str, got {key!r}")
            # The block is consistent by construction (data gives dtype and local shape,
            # the grid was checked above): what __post_init__ would check holds, and
            # models build one of these per parameter on every save.
            # Plain attribute stores, in field order: CPython keeps the values inline
            # (no instance dict), so each leaf is one object for the garbage collector,
            # not two (``__dict__.update`` would make the dict).
            out = object.__new__(cls)
            out.key = key
            out.data = data
            out.dtype = data.dtype
            out.local_shape = shape
            out.global_shape = global_shape
            out.global_offset = global_offset
            out.axis_fragmentations = fragmentations
            out.replica_id = replica_id
            out.prepend_axis_num = prepend_axis_num
            out.allow_shape_mismatch = False
            out.flattened_range = None
            return out
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            global_shape,
            global_offset,
            fragmentations,
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: tuple[int, ...],
        *rank_offsets: tuple[int, int, int],
        flattened_range: slice | None = None,
        **kwargs: Any,
    ) -> ShardedTensor:
        """A flat slice (distributed optimizer) of a block on a regular grid.

        ``data`` is the 1-D range ``flattened_range`` of the C-order flattening of
        a block of shape ``non_flat_local_shape``, positioned by ``rank_offsets``
        as in :meth:`from_rank_offsets`.
        """
        if flattened_range is None:
            raise MappingError(
                f"ShardedTensor '{key}': from_rank_offsets_flat needs flattened_range "
                "(use from_rank_offsets for non-flat tensors)"
            )
        if not isinstance(flattened_range, slice):
            raise MappingError(
                f"ShardedTensor '{key}': flattened_range must be a slice, "
                f"got {type(flattened_range).__name__}"
            )
        meta = torch.empty(tuple(non_flat_local_shape), dtype=data.dtype, device="meta")
        template = cls.from_rank_offsets(key, meta, *rank_offsets, **kwargs)
        return replace(template, data=data, flattened_range=flattened_range)

    def __str__(self) -> str:
        return f"{type(self).__name__}(key='{self.key}')"


@dataclass
class ShardedObject(ShardedBase):
    """One shard of a grid of picklable objects (e.g. per-rank RNG state).

    Args:
        key: name of the object grid.
        data: the object (``None`` when describing what to load).
        global_shape: shape of the grid of shards.
        global_offset: position of this shard in the grid.
        replica_id: 0 (or all zeros) for the copy that is saved.
    """

    key: str
    data: object
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(self.global_shape)
        self.global_offset = tuple(self.global_offset)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise MappingError(f"ShardedObject key must be a non-empty str, got {self.key!r}")
        if len(self.global_shape) != len(self.global_offset):
            raise MappingError(
                f"ShardedObject '{self.key}': global_offset {self.global_offset} and "
                f"global_shape {self.global_shape} have different lengths"
            )
        for axis, (off, size) in enumerate(zip(self.global_offset, self.global_shape)):
            if not 0 <= off < size:
                raise MappingError(
                    f"ShardedObject '{self.key}': offset {off} on axis {axis} is outside the "
                    f"grid size {size}"
                )

    def without_data(self) -> ShardedObject:
        out = _shallow_copy(self)
        out.data = None
        return out

    @property
    def unique_key(self) -> str:
        """``<key>/shard_<offsets joined by '.'>_<global shape joined by '.'>`` (the stored key)."""
        return object_unique_key(self.key, self.global_offset, self.global_shape)

    def __str__(self) -> str:
        return f"{type(self).__name__}(key='{self.key}')"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """The (data-less) ShardedObject that :attr:`unique_key` describes."""
        parsed = parse_object_unique_key(unique_key)
        if isinstance(parsed, str):
            raise MappingError(parsed)
        key, offset, shape = parsed
        return cls(key, None, shape, offset, replica_id)


# The fields of each leaf class in order, read at once by _shallow_copy (a test checks
# them against dataclasses.fields).
_tensor_fields = attrgetter(
    "key",
    "data",
    "dtype",
    "local_shape",
    "global_shape",
    "global_offset",
    "axis_fragmentations",
    "replica_id",
    "prepend_axis_num",
    "allow_shape_mismatch",
    "flattened_range",
)
_object_fields = attrgetter("key", "data", "global_shape", "global_offset", "replica_id")

# The fields of a ShardedTensor that where and how a layout stores it depend on (its data
# and replica aside): leaves with equal values are planned alike, so a save strategy's
# cached plan compares them (torch_dist's planner, raw_bytes' plan_reuse).
tensor_structure = attrgetter(
    "key",
    "dtype",
    "global_shape",
    "global_offset",
    "local_shape",
    "prepend_axis_num",
    "flattened_range",
)


def is_sharded_base(x: object) -> TypeGuard[ShardedBase]:
    """``isinstance(x, ShardedBase)``, fast for our two leaf classes: an ``isinstance``
    against an ABC base class goes through ``ABCMeta.__instancecheck__`` (about 0.4 us,
    paid for every leaf on every save and load), a type comparison does not."""
    t = type(x)
    return t is ShardedTensor or t is ShardedObject or isinstance(x, ShardedBase)


class LocalNonpersistentObject:
    """A value that is not saved; ``load`` returns it (unwrapped) where it was passed."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        """The wrapped value."""
        return self.obj

    def __repr__(self) -> str:
        return f"LocalNonpersistentObject({self.obj!r})"
