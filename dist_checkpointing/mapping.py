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
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

import numpy as np
import torch

from .dict_utils import dict_list_map_inplace
from .errors import MappingError

logger = logging.getLogger(__name__)

ReplicaId = int | tuple[int, ...]
StateDict = dict[str, Any]
ShardedStateDict = dict[str, Any]
CommonStateDict = dict[str, Any]

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
]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the replica that is written (``replica_id`` 0 or all zeros)."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase(ABC):
    """A leaf of a sharded state dict: a key, the local data and a replica id."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise :class:`MappingError` if the metadata is inconsistent."""

    @abstractmethod
    def without_data(self) -> ShardedBase:
        """A copy of this object with ``data=None`` (metadata only)."""


def _tuple_with(values: tuple[int, ...], index: int, value: int) -> tuple[int, ...]:
    out = list(values)
    out[index] = value
    return tuple(out)


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
        if not isinstance(self.dtype, torch.dtype):
            raise self._fail(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.prepend_axis_num < 0:
            raise self._fail(f"prepend_axis_num must be >= 0, got {self.prepend_axis_num}")
        ndim = len(self.global_shape)
        if len(self.global_offset) != ndim:
            raise self._fail(
                f"global_offset {self.global_offset} and global_shape {self.global_shape} "
                "have different lengths"
            )
        if len(self.local_shape) + self.prepend_axis_num != ndim:
            raise self._fail(
                f"local_shape {self.local_shape} plus prepend_axis_num={self.prepend_axis_num} "
                f"does not match the {ndim} axes of global_shape {self.global_shape}"
            )
        if self.axis_fragmentations is not None and len(self.axis_fragmentations) != ndim:
            raise self._fail(
                f"axis_fragmentations {self.axis_fragmentations} must have one entry per "
                f"global axis ({ndim})"
            )
        if any(s < 0 for s in self.global_shape) or any(o < 0 for o in self.global_offset):
            raise self._fail(
                f"negative global_shape {self.global_shape} or global_offset {self.global_offset}"
            )
        self._validate_block_position()
        self._validate_flattened_range()
        self._validate_data()

    def _validate_block_position(self) -> None:
        p = self.prepend_axis_num
        for axis in range(p):
            if self.global_offset[axis] >= max(self.global_shape[axis], 1):
                raise self._fail(
                    f"prepended axis {axis}: offset {self.global_offset[axis]} is outside "
                    f"global size {self.global_shape[axis]}"
                )
        for axis, (off, sh) in enumerate(zip(self.global_offset[p:], self.local_shape), start=p):
            if sh != 0 and off % sh != 0:
                raise self._fail(
                    f"global offset {off} on axis {axis} is not divisible by the local size {sh} "
                    "(blocks must lie on a regular grid)"
                )
            if not self.allow_shape_mismatch and off + sh > self.global_shape[axis]:
                raise self._fail(
                    f"block [{off}, {off + sh}) on axis {axis} exceeds the global size "
                    f"{self.global_shape[axis]}"
                )

    def _validate_flattened_range(self) -> None:
        fr = self.flattened_range
        if fr is None:
            return
        if not isinstance(fr, slice):
            raise self._fail(f"flattened_range must be a slice, got {type(fr).__name__}")
        if fr.step not in (None, 1):
            raise self._fail(f"flattened_range {fr} must not have a step")
        numel = math.prod(self.local_shape)
        if fr.start is None or fr.stop is None or not 0 <= fr.start <= fr.stop <= numel:
            raise self._fail(
                f"flattened_range [{fr.start}, {fr.stop}) is outside the {numel} elements of "
                f"local_shape {self.local_shape}"
            )

    def _validate_data(self) -> None:
        data = self.data
        if data is None:
            return
        if not isinstance(data, torch.Tensor):
            raise self._fail(f"data must be a torch.Tensor, got {type(data).__name__}")
        if data.dtype != self.dtype:
            raise self._fail(
                f"data dtype {data.dtype} differs from the declared dtype {self.dtype}"
            )
        if self.flattened_range is None:
            if tuple(data.shape) != self.local_shape:
                raise self._fail(
                    f"data shape {tuple(data.shape)} differs from local_shape {self.local_shape}"
                )
        else:
            expected = self.flattened_range.stop - self.flattened_range.start
            if data.ndim != 1 or data.numel() != expected:
                raise self._fail(
                    f"flat data must be 1-D with {expected} elements "
                    f"(flattened_range {self.flattened_range}), got shape {tuple(data.shape)}"
                )

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
        local = self.local_coordinates()
        p = self.prepend_axis_num
        prepended = tuple(
            np.full_like(local[0], off) if local else np.zeros(0, dtype=np.int64)
            for off in self.global_offset[:p]
        )
        return prepended + tuple(c + off for c, off in zip(local, self.global_offset[p:]))

    def local_coordinates(self) -> tuple[np.ndarray, ...]:
        """Coordinates in the local block of every element of a flat ShardedTensor's data."""
        if self.flattened_range is None:
            raise self._fail("local_coordinates is only defined for flattened ShardedTensors")
        flat = np.arange(self.flattened_range.start, self.flattened_range.stop)
        return tuple(np.unravel_index(flat, self.local_shape))

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
        chunks = []
        for axis, (size, frag) in enumerate(zip(self.global_shape, self.axis_fragmentations)):
            if not self.allow_shape_mismatch and size % frag != 0:
                raise self._fail(
                    f"global size {size} on axis {axis} is not divisible by its fragmentation {frag}"
                )
            chunks.append(size // frag)
        return tuple(chunks)

    def without_data(self) -> ShardedTensor:
        # A shallow copy: the metadata was validated at construction (replace() would
        # validate again, which dominates planning time for many small tensors).
        out = copy.copy(self)
        out.data = None
        return out

    def init_data(self, device: str | torch.device, init_fn: Callable = torch.empty) -> None:
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
        gdim = dim + self.prepend_axis_num
        local_len = self.local_shape[dim]
        if (
            local_len == 0
            or self.global_shape[gdim] % local_len
            or self.global_offset[gdim] % local_len
        ):
            raise self._fail(
                f"narrow needs a regular grid on axis {gdim}: global size {self.global_shape[gdim]}, "
                f"offset {self.global_offset[gdim]}, local size {local_len}"
            )
        global_shape = _tuple_with(
            self.global_shape, gdim, self.global_shape[gdim] // local_len * length
        )
        global_offset = _tuple_with(
            self.global_offset, gdim, self.global_offset[gdim] // local_len * length
        )
        local_shape = _tuple_with(self.local_shape, dim, length)
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
        row = math.prod(self.local_shape[1:])
        # The flat range, expressed relative to the narrowed block.
        lo = self.flattened_range.start - row * start
        hi = self.flattened_range.stop - row * start
        new_lo, new_hi = max(lo, 0), min(hi, row * length)
        if new_lo >= new_hi:
            return []
        data = None
        if self.data is not None:
            data = self.data[new_lo - lo : new_hi - lo]
        return [
            replace(
                self,
                data=data,
                local_shape=local_shape,
                global_shape=global_shape,
                global_offset=global_offset,
                flattened_range=slice(new_lo, new_hi),
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
        ndim = data.ndim + prepend_axis_num
        global_shape = [1] * prepend_axis_num + list(data.shape)
        global_offset = [0] * ndim
        fragmentations = [1] * ndim
        seen: set[int] = set()
        for entry in rank_offsets:
            if len(entry) != 3:
                raise MappingError(
                    f"ShardedTensor '{key}': each rank offset must be "
                    f"(axis, axis_rank_offset, axis_fragmentations), got {entry}"
                )
            axis, rank_off, frag = entry
            if not (0 <= axis < ndim) or frag < 1 or not (0 <= rank_off < frag) or axis in seen:
                raise MappingError(
                    f"ShardedTensor '{key}': invalid rank offsets {rank_offsets} for a tensor "
                    f"with {ndim} global axes (axis in [0, {ndim}), 0 <= offset < fragmentations, "
                    "each axis once)"
                )
            seen.add(axis)
            local_size = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = frag * local_size
            global_offset[axis] = rank_off * local_size
            fragmentations[axis] = frag
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(fragmentations),
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
        out = copy.copy(self)
        out.data = None
        return out

    @property
    def unique_key(self) -> str:
        """``<key>/shard_<offsets joined by '.'>_<global shape joined by '.'>`` (the stored key)."""
        offsets = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offsets}_{shape}"

    def __str__(self) -> str:
        return f"{type(self).__name__}(key='{self.key}')"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """The (data-less) ShardedObject that :attr:`unique_key` describes."""
        key, sep, shard = unique_key.rpartition("/")
        parts = shard.split("_")
        if not sep or len(parts) != 3 or parts[0] != "shard":
            raise MappingError(
                f"'{unique_key}' is not a ShardedObject unique key "
                "(expected '<key>/shard_<offsets>_<shape>')"
            )
        try:
            # An empty field is the empty tuple (a 0-d object grid).
            offset = tuple(int(x) for x in parts[1].split(".")) if parts[1] else ()
            shape = tuple(int(x) for x in parts[2].split(".")) if parts[2] else ()
        except ValueError as e:
            raise MappingError(f"'{unique_key}' has non-integer offsets or shape") from e
        return cls(key, None, shape, offset, replica_id)


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, slice | None], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor saved in another form: ``build_fn`` makes the sharded state dict to
    save, ``merge_fn`` turns the loaded form back into the tensor.

    Args:
        key: a name used for logging and errors.
        data: the tensor to transform.
        build_fn: ``(key, data, replica_id, flattened_range) -> ShardedStateDict``.
        merge_fn: ``(loaded state dict of what build_fn made) -> torch.Tensor``.
        replica_id: passed to ``build_fn``.
        flattened_range: passed to ``build_fn``.
    """

    key: str
    data: torch.Tensor | None
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> ShardedStateDict:
        """The sharded state dict that represents ``data`` in the checkpoint."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)  # type: ignore[arg-type]

    def validate_metadata_integrity(self) -> None:
        if not callable(self.build_fn) or not callable(self.merge_fn):
            raise MappingError(
                f"ShardedTensorFactory '{self.key}': build_fn and merge_fn must be callable"
            )

    def without_data(self) -> ShardedTensorFactory:
        return replace(self, data=None)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every :class:`ShardedTensorFactory` by what it builds, in place."""

    def _build(x: Any) -> Any:
        if isinstance(x, ShardedTensorFactory):
            x = x.build()
            # A factory may build containers holding further factories.
            x = dict_list_map_inplace(_build, x)
        return x

    dict_list_map_inplace(_build, sharded_state_dict)


def apply_factory_merges(x1: Any, x2: Any, key: tuple = ()) -> Any:
    """Merge loaded factory products ``x1`` back with the factories in ``x2``.

    ``x2`` is the part of the original sharded state dict that holds the
    factories (dicts, lists, or dicts keyed by list index); ``x1`` is the loaded
    state dict. Each factory's ``merge_fn`` receives what its ``build_fn`` made,
    loaded. Returns ``x1`` with the merged tensors in place.
    """
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise MappingError(
                    f"apply_factory_merges: key {key + (k,)} of a factory is missing from the "
                    f"loaded state dict (loaded keys: {sorted(map(str, x1))})"
                )
            x1[k] = apply_factory_merges(x1[k], v2, key=key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise MappingError(
                f"apply_factory_merges: lists of different lengths at {key}: {len(x1)} vs {len(x2)}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key=key + (i,))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if not isinstance(k, int) or not 0 <= k < len(x1):
                raise MappingError(
                    f"apply_factory_merges: index {k!r} at {key} is not valid for a list of "
                    f"length {len(x1)}"
                )
            x1[k] = apply_factory_merges(x1[k], v2, key=key + (k,))
    else:
        raise MappingError(
            f"apply_factory_merges: cannot merge {type(x1).__name__} with "
            f"{type(x2).__name__} at {key}"
        )
    return x1


class LocalNonpersistentObject:
    """A value that is not saved; ``load`` returns it (unwrapped) where it was passed."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        """The wrapped value."""
        return self.obj

    def __repr__(self) -> str:
        return f"LocalNonpersistentObject({self.obj!r})"
