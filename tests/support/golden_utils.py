"""Helpers for the golden Megatron-Core checkpoints under ``tests/data/golden/``.

Each case directory holds ``manifest.json`` (what the checkpoint contains and how
it was written, see ``tests/data/golden/README.md``) and ``checkpoint/`` (the files
exactly as Megatron-Core 0.13.1 or 0.19.2 wrote them). This module:

- reads the manifests (:class:`GoldenCase`, :func:`golden_cases`);
- rebuilds every global tensor from the manifest's value formula;
- decodes the JSON payloads (objects, common state) and compares loaded values
  with them, types included (:func:`assert_same_value`);
- describes load requests as picklable values (:class:`TensorRequest`,
  :class:`ObjectRequest`, :class:`RankRequest`, :class:`Layout`) that a rank turns
  into a sharded state dict (:func:`build_state_dict`) and the test process turns
  into expected values, and builds the layouts the golden tests load under.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import pickle
import pickletools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dist_checkpointing import LocalNonpersistentObject, ShardedObject, ShardedTensor

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "data" / "golden"
LEGACY_VERSION = "0.13.1"  # writes common.pt and supports flattened ranges

Path_ = tuple[str, ...]

# --------------------------------------------------------------------------------------------
# Manifests
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GoldenCase:
    """One golden checkpoint and its manifest."""

    case_dir: Path
    manifest: dict[str, Any] = field(compare=False, repr=False)

    @property
    def version(self) -> str:
        return str(self.manifest["megatron_core_version"])

    @property
    def name(self) -> str:
        return str(self.manifest["case"])

    @property
    def id(self) -> str:
        return f"{self.version}-{self.name}"

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def ckpt_dir(self) -> Path:
        return self.case_dir / self.manifest["checkpoint_dir"]

    @property
    def is_legacy(self) -> bool:
        """Written by Megatron-Core 0.13.1 (``common.pt``, flattened ranges, MCoreSavePlan)."""
        return self.version == LEGACY_VERSION

    @property
    def tensors(self) -> dict[str, dict[str, Any]]:
        return self.manifest["tensors"]

    @property
    def objects(self) -> dict[str, dict[str, Any]]:
        return self.manifest["sharded_objects"]

    @property
    def flat_keys(self) -> list[str]:
        """Keys saved with ``from_rank_offsets_flat`` (stored N-D reformulated)."""
        return [
            key
            for key, info in self.tensors.items()
            if any(s["flattened_range"] is not None for s in info["shards"])
        ]

    @property
    def prepended_keys(self) -> list[str]:
        return [
            key
            for key, info in self.tensors.items()
            if any(s["prepend_axis_num"] > 0 for s in info["shards"])
        ]

    def dtype(self, key: str) -> torch.dtype:
        return dtype_from_name(self.tensors[key]["dtype"])

    def global_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key]["global_shape"])

    def global_tensor(self, key: str) -> torch.Tensor:
        """The full logical tensor ``key`` as the value formula defines it."""
        info = self.tensors[key]
        values = golden_values_fn(self.manifest)(
            info["key_index"], tuple(info["global_shape"]), self.dtype(key)
        )
        if values.dtype != self.dtype(key) or tuple(values.shape) != self.global_shape(key):
            raise AssertionError(f"{self.id}: value formula gave a wrong tensor for {key}")
        return values

    def main_payloads(self) -> dict[str, Any]:
        """Decoded payload of every ShardedObject's main replica, by unique key."""
        out: dict[str, Any] = {}
        for info in self.objects.values():
            for shard in info["shards"]:
                if shard["is_main_replica"]:
                    out[shard["unique_key"]] = decode_payload(shard["payload"])
        return out

    def common_state(self) -> dict[str, Any]:
        return decode_payload(self.manifest["common_state"])


def load_case(case_dir: Path) -> GoldenCase:
    with open(case_dir / "manifest.json", encoding="utf-8") as f:
        return GoldenCase(case_dir, json.load(f))


def golden_cases() -> list[GoldenCase]:
    """Every golden case, sorted by version then case name."""
    return [load_case(p.parent) for p in sorted(GOLDEN_DIR.glob("*/*/manifest.json"))]


def golden_values_fn(manifest: dict[str, Any]) -> Callable[..., torch.Tensor]:
    """``golden_values(key_index, global_shape, dtype)`` from the manifest's Python source.

    The source is our own test fixture (checked in beside the checkpoints), so it is
    exec()'d into a private namespace, as the generator's own verification did.
    """
    namespace: dict[str, Any] = {"__name__": "golden_value_formula"}
    source = manifest["value_formula"]["python"]
    exec(compile(source, f"<value_formula of {manifest['case']}>", "exec"), namespace)
    return namespace["golden_values"]


def golden_values(key_index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The golden value formula (from the first manifest) for tensors of our own tests."""
    return golden_values_fn(golden_cases()[0].manifest)(key_index, shape, dtype)


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype name: {name!r}")
    return dtype


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------
# Pickles
# --------------------------------------------------------------------------------------------

_STRING_OPS = {
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "SHORT_BINSTRING",
    "BINSTRING",
    "STRING",
}
_GET_OPS = {"GET", "BINGET", "LONG_BINGET"}
_PUT_OPS = {"PUT", "BINPUT", "LONG_BINPUT"}


def pickle_globals(data: bytes) -> set[str]:
    """Every ``module.name`` a pickle references (GLOBAL, INST and STACK_GLOBAL), read with
    :mod:`pickletools` without unpickling anything."""
    found: set[str] = set()
    memo: dict[int, Any] = {}
    pushed: list[Any] = []  # strings pushed directly or from the memo (None: other values)
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("GLOBAL", "INST"):
            found.add(".".join(str(arg).split(" ", 1)))
            pushed.append(None)
        elif name == "STACK_GLOBAL":
            module, qualname = pushed[-2], pushed[-1]
            if not (isinstance(module, str) and isinstance(qualname, str)):
                raise ValueError("STACK_GLOBAL whose module/name could not be resolved")
            found.add(f"{module}.{qualname}")
            pushed.append(None)
        elif name in _STRING_OPS:
            pushed.append(arg)
        elif name in _GET_OPS:
            assert isinstance(arg, int)
            pushed.append(memo.get(arg))
        elif name in _PUT_OPS:
            assert isinstance(arg, int)
            memo[arg] = pushed[-1] if pushed else None
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        else:
            pushed.append(None)
    return found


class StubMegatronUnpickler(pickle.Unpickler):
    """Unpickles Megatron-Core 0.13's ``.metadata`` without Megatron: its classes become
    empty stand-ins (pickle restores the instance ``__dict__``). Touches no sys.modules."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "megatron" or module.startswith("megatron."):
            return type(name, (), {"__module__": module})
        return super().find_class(module, name)


def load_metadata_with_stubs(path: Path) -> Any:
    return StubMegatronUnpickler(io.BytesIO(path.read_bytes())).load()


# --------------------------------------------------------------------------------------------
# Payloads and value comparison
# --------------------------------------------------------------------------------------------


def decode_payload(value: Any) -> Any:
    """A manifest JSON value as the Python object that was saved (tensors rebuilt)."""
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            spec = value["__tensor__"]
            dtype = dtype_from_name(spec["dtype"])
            return torch.tensor(spec["values"], dtype=dtype).reshape(tuple(spec["shape"]))
        return {k: decode_payload(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_payload(v) for v in value]
    return value


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as integers of the same width (bitwise comparison)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(by_size[t.element_size()])


def assert_tensor_bitwise(actual: Any, expected: torch.Tensor, where: str) -> None:
    """Same type, dtype, shape, device type and bits."""
    assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual)}"
    assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert actual.device.type == "cpu", f"{where}: loaded onto {actual.device}"
    diff = bits(actual) != bits(expected)
    if bool(diff.any()):
        first = tuple(int(i) for i in diff.nonzero()[0])
        raise AssertionError(
            f"{where}: {int(diff.sum())} of {expected.numel()} elements differ; first at "
            f"{first}: got {actual[first].item()!r}, expected {expected[first].item()!r}"
        )


def assert_same_value(actual: Any, expected: Any, where: str = "value") -> None:
    """Deep equality with exact types (bool is not int, tensors compared bitwise)."""
    if isinstance(expected, torch.Tensor):
        assert_tensor_bitwise(actual, expected, where)
        return
    assert type(actual) is type(expected), (
        f"{where}: type {type(actual).__name__} != {type(expected).__name__} "
        f"({actual!r} vs {expected!r})"
    )
    if isinstance(expected, dict):
        assert set(actual) == set(expected), (
            f"{where}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"
        )
        for k, v in expected.items():
            assert_same_value(actual[k], v, f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_value(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# --------------------------------------------------------------------------------------------
# Nested dict paths
# --------------------------------------------------------------------------------------------


def get_path(d: Any, path: Path_, where: str = "state dict") -> Any:
    """The value at ``path``; an AssertionError naming the path if there is none."""
    for depth, part in enumerate(path):
        if not isinstance(d, dict) or part not in d:
            keys = sorted(map(str, d)) if isinstance(d, dict) else type(d).__name__
            raise AssertionError(f"{where}: no entry {path} (at {path[:depth]}: {keys})")
        d = d[part]
    return d


def set_path(d: dict[str, Any], path: Path_, value: Any) -> None:
    for part in path[:-1]:
        d = d.setdefault(part, {})
    d[path[-1]] = value


def leaf_paths(d: Any, stop: frozenset[Path_] = frozenset(), prefix: Path_ = ()) -> Iterator[Path_]:
    """Paths of every leaf: lists, empty dicts and the paths in ``stop`` are leaves,
    other dicts are walked."""
    if isinstance(d, dict) and d and prefix not in stop:
        for k, v in d.items():
            yield from leaf_paths(v, stop, prefix + (k,))
    else:
        yield prefix


# --------------------------------------------------------------------------------------------
# N-D reformulation (Megatron-Core 0.13's storage of flattened ranges)
# --------------------------------------------------------------------------------------------


def reformulate(global_t: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """``global_t`` of shape ``[X, Y, ..]`` with blocks ``[x, y, ..]`` as the stored tensor
    ``[X//x, Y//y, .., x*y*..]``: element ``[c0, c1, .., j]`` is element ``j`` of the C-order
    flattening of block ``(c0, c1, ..)``."""
    grid = tuple(g // b for g, b in zip(global_t.shape, block))
    out = torch.empty(grid + (math.prod(block),), dtype=global_t.dtype)
    for coords in _grid_coords(grid):
        slices = tuple(slice(c * b, (c + 1) * b) for c, b in zip(coords, block))
        out[coords] = global_t[slices].reshape(-1)
    return out


def _grid_coords(grid: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    for flat in range(math.prod(grid)):
        coords = []
        for size in reversed(grid):
            coords.append(flat % size)
            flat //= size
        yield tuple(reversed(coords))


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


def _sentinel(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor no golden value matches, so a block that is never filled is noticed."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype)


@dataclass(frozen=True)
class TensorRequest:
    """One ShardedTensor of a load request.

    ``rank_offsets`` are ``(axis, axis_rank_offset, axis_fragmentations)`` triples whose
    axes count the prepended axes; ``local_shape`` is the (non-flat) local block without
    prepended axes; ``flattened_range`` makes it a flat range of that block.
    """

    key: str
    path: Path_
    dtype: str
    rank_offsets: tuple[tuple[int, int, int], ...]
    local_shape: tuple[int, ...]
    replica_id: int = 0
    prepend_axis_num: int = 0
    flattened_range: tuple[int, int] | None = None

    def block_slices(self) -> tuple[slice, ...]:
        """The block in global coordinates."""
        sizes = (1,) * self.prepend_axis_num + self.local_shape
        starts = [0] * len(sizes)
        for axis, offset, _ in self.rank_offsets:
            starts[axis] = offset * sizes[axis]
        return tuple(slice(s, s + n) for s, n in zip(starts, sizes))

    def expected(self, global_t: torch.Tensor) -> torch.Tensor:
        block = global_t[self.block_slices()].reshape(self.local_shape)
        if self.flattened_range is None:
            return block.clone()
        start, stop = self.flattened_range
        return block.reshape(-1)[start:stop].clone()

    def sharded_tensor(self) -> ShardedTensor:
        dtype = dtype_from_name(self.dtype)
        if self.flattened_range is None:
            return ShardedTensor.from_rank_offsets(
                self.key,
                _sentinel(self.local_shape, dtype),
                *self.rank_offsets,
                replica_id=self.replica_id,
                prepend_axis_num=self.prepend_axis_num,
            )
        start, stop = self.flattened_range
        return ShardedTensor.from_rank_offsets_flat(
            self.key,
            _sentinel((stop - start,), dtype),
            self.local_shape,
            *self.rank_offsets,
            flattened_range=slice(start, stop),
            replica_id=self.replica_id,
            prepend_axis_num=self.prepend_axis_num,
        )


@dataclass(frozen=True)
class ObjectRequest:
    """One ShardedObject (data None) of a load request."""

    key: str
    path: Path_
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: int = 0

    @property
    def unique_key(self) -> str:
        return (
            f"{self.key}/shard_{'.'.join(map(str, self.global_offset))}_"
            f"{'.'.join(map(str, self.global_shape))}"
        )

    def sharded_object(self) -> ShardedObject:
        return ShardedObject(
            self.key, None, self.global_shape, self.global_offset, replica_id=self.replica_id
        )


@dataclass(frozen=True)
class RankRequest:
    """What one rank asks for: tensors, objects and non-persistent values."""

    tensors: tuple[TensorRequest, ...] = ()
    objects: tuple[ObjectRequest, ...] = ()
    nonpersistent: tuple[tuple[Path_, Any], ...] = ()

    def paths(self) -> set[Path_]:
        return (
            {t.path for t in self.tensors}
            | {o.path for o in self.objects}
            | {p for p, _ in self.nonpersistent}
        )


@dataclass(frozen=True)
class Layout:
    """A named load layout: one :class:`RankRequest` per rank.

    ``path_mode`` says how the rank names the checkpoint directory: ``"absolute"``,
    ``"relative"`` (working directory = the case directory, path ``checkpoint``, as at
    save time) or ``"relative_elsewhere"`` (working directory = the golden root).
    """

    name: str
    ranks: tuple[RankRequest, ...]
    path_mode: str = "absolute"

    @property
    def world_size(self) -> int:
        return len(self.ranks)


def build_state_dict(request: RankRequest) -> dict[str, Any]:
    """The sharded state dict a rank passes to ``load`` for ``request``."""
    sd: dict[str, Any] = {}
    for t in request.tensors:
        set_path(sd, t.path, t.sharded_tensor())
    for o in request.objects:
        set_path(sd, o.path, o.sharded_object())
    for path, value in request.nonpersistent:
        set_path(sd, path, LocalNonpersistentObject(value))
    return sd


def checkpoint_path(case_dir: Path, path_mode: str) -> tuple[Path, str]:
    """``(working directory, checkpoint path)`` for a :class:`Layout` path mode."""
    if path_mode == "absolute":
        return case_dir, str(case_dir / "checkpoint")
    if path_mode == "relative":
        return case_dir, "checkpoint"
    if path_mode == "relative_elsewhere":
        return GOLDEN_DIR, str((case_dir / "checkpoint").relative_to(GOLDEN_DIR))
    raise ValueError(f"unknown path mode {path_mode!r}")


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------


def _tpath(key: str, *variant: object) -> Path_:
    return ("tensors", key) + tuple(str(v) for v in variant)


def _whole(case: GoldenCase, key: str, path: Path_, replica_id: int = 0) -> TensorRequest:
    return TensorRequest(
        key, path, case.tensors[key]["dtype"], (), case.global_shape(key), replica_id
    )


def _split(
    case: GoldenCase, key: str, axis: int, parts: int, index: int, path: Path_
) -> TensorRequest:
    shape = list(case.global_shape(key))
    shape[axis] //= parts
    return TensorRequest(
        key, path, case.tensors[key]["dtype"], ((axis, index, parts),), tuple(shape)
    )


def _flat(
    case: GoldenCase,
    key: str,
    path: Path_,
    rank_offsets: tuple[tuple[int, int, int], ...],
    block: tuple[int, ...],
    start: int,
    stop: int,
    replica_id: int = 0,
) -> TensorRequest:
    return TensorRequest(
        key,
        path,
        case.tensors[key]["dtype"],
        rank_offsets,
        block,
        replica_id,
        flattened_range=(start, stop),
    )


def rank_offsets_of(shard: dict[str, Any]) -> tuple[tuple[int, int, int], ...]:
    """A manifest shard's ``rank_offsets`` as ``(axis, axis_rank_offset, fragments)``."""
    return tuple((int(a), int(o), int(f)) for a, o, f in shard["rank_offsets"])


def saved_split_axes(case: GoldenCase, key: str) -> set[int]:
    """Global axes that the save split into more than one block."""
    return {
        axis
        for shard in case.tensors[key]["shards"]
        for axis, frag in enumerate(shard["axis_fragmentations"])
        if frag > 1
    }


def other_split_axis(case: GoldenCase, key: str, parts: int) -> int | None:
    """An axis divisible by ``parts``, preferring one that the save did not split
    (else the last divisible one, so a 2x2 grid becomes 1x2); None if there is none."""
    shape = case.global_shape(key)
    divisible = [a for a, n in enumerate(shape) if n % parts == 0 and n >= parts]
    fresh = [a for a in divisible if a not in saved_split_axes(case, key)]
    if fresh:
        return fresh[0]
    return divisible[-1] if divisible else None


def _objects_everywhere(case: GoldenCase, replica_id: int) -> tuple[ObjectRequest, ...]:
    """Every stored object shard, each at its own path."""
    out = {}
    for key, info in case.objects.items():
        for shard in info["shards"]:
            path = ("objects", shard["unique_key"])
            shape, offset = tuple(info["global_shape"]), tuple(shard["global_offset"])
            out[path] = ObjectRequest(key, path, shape, offset, replica_id)
    return tuple(out.values())


def saved_layout(case: GoldenCase, path_mode: str = "relative") -> Layout:
    """The save-time state dicts: same world size, shards, sd_paths, objects and
    non-persistent values as the manifest records."""
    ranks = []
    for rank in range(case.world_size):
        tensors = []
        for key, info in case.tensors.items():
            for shard in info["shards"]:
                if shard["rank"] != rank:
                    continue
                flat = shard["flattened_range"]
                local = shard["non_flat_local_shape"] if flat is not None else shard["data_shape"]
                tensors.append(
                    TensorRequest(
                        key,
                        tuple(shard["sd_path"]),
                        info["dtype"],
                        rank_offsets_of(shard),
                        tuple(local),
                        shard["replica_id"],
                        shard["prepend_axis_num"],
                        (flat[0], flat[1]) if flat is not None else None,
                    )
                )
        objects = [
            ObjectRequest(
                key,
                tuple(shard["sd_path"]),
                tuple(info["global_shape"]),
                tuple(shard["global_offset"]),
                shard["replica_id"],
            )
            for key, info in case.objects.items()
            for shard in info["shards"]
            if shard["rank"] == rank
        ]
        nonpersistent = [
            (tuple(e["sd_path"]), e["value"])
            for e in case.manifest["nonpersistent"]
            if e["rank"] == rank
        ]
        ranks.append(RankRequest(tuple(tensors), tuple(objects), tuple(nonpersistent)))
    return Layout("saved", tuple(ranks), path_mode)


def whole_layout(
    case: GoldenCase, world_size: int, *, flat_keys_flat: bool, path_mode: str = "absolute"
) -> Layout:
    """Every tensor whole and every object on every rank (``replica_id=rank``).

    ``flat_keys_flat`` requests the flat keys as one TP=1 flat range (what Megatron-Core
    0.13 needs), otherwise as regular tensors."""
    ranks = []
    for rank in range(world_size):
        tensors = []
        for key in case.tensors:
            if flat_keys_flat and key in case.flat_keys:
                n = math.prod(case.global_shape(key))
                tensors.append(
                    _flat(case, key, _tpath(key), (), case.global_shape(key), 0, n, rank)
                )
            else:
                tensors.append(_whole(case, key, _tpath(key), rank))
        ranks.append(RankRequest(tuple(tensors), _objects_everywhere(case, rank)))
    name = f"whole_ws{world_size}" + ("_flat" if flat_keys_flat and case.flat_keys else "")
    return Layout(name, tuple(ranks), path_mode)


def one_rank_loads_all_layout(case: GoldenCase) -> Layout:
    """2 ranks: rank 0 loads every tensor and object whole, rank 1 requests nothing
    (it still takes part in the collective load and gets the common state)."""
    whole = whole_layout(case, 1, flat_keys_flat=True)
    return Layout("rank0_only_ws2", (whole.ranks[0], RankRequest()))


def other_axis_layout(case: GoldenCase, world_size: int) -> Layout:
    """Each tensor split along another axis than at save (regular requests, also for
    flat and prepended keys); tensors with no divisible axis are loaded whole."""
    per_rank: list[list[TensorRequest]] = [[] for _ in range(world_size)]
    for key in case.tensors:
        axis = other_split_axis(case, key, world_size)
        for rank in range(world_size):
            if axis is None:
                per_rank[rank].append(_whole(case, key, _tpath(key), rank))
            else:
                per_rank[rank].append(_split(case, key, axis, world_size, rank, _tpath(key)))
    return Layout(f"other_axis_ws{world_size}", tuple(RankRequest(tuple(t)) for t in per_rank))


def per_layer_layout(case: GoldenCase, world_size: int) -> Layout:
    """Prepended keys as per-layer requests (``prepend_axis_num=1``), layer l on rank
    ``l % world_size`` (several shards of one key per rank)."""
    per_rank: list[list[TensorRequest]] = [[] for _ in range(world_size)]
    for key in case.prepended_keys:
        shape = case.global_shape(key)
        for layer in range(shape[0]):
            per_rank[layer % world_size].append(
                TensorRequest(
                    key,
                    _tpath(key, f"layer{layer}"),
                    case.tensors[key]["dtype"],
                    ((0, layer, shape[0]),),
                    shape[1:],
                    prepend_axis_num=1,
                )
            )
    return Layout(f"per_layer_ws{world_size}", tuple(RankRequest(tuple(t)) for t in per_rank))


def _saved_blocks(case: GoldenCase, key: str) -> list[dict[str, Any]]:
    """One shard entry per distinct saved (TP) block of a flat key."""
    blocks: dict[tuple, dict[str, Any]] = {}
    for shard in case.tensors[key]["shards"]:
        blocks.setdefault(rank_offsets_of(shard), shard)
    return list(blocks.values())


def _uneven_bounds(n: int, parts: int) -> list[int]:
    """Strictly increasing uneven boundaries ``0 = b0 < .. < b_parts = n``."""
    if parts == 2:
        inner = [max(1, n * 3 // 7)]  # 41 of 96, like Megatron's own check
    else:
        inner = sorted({max(1, n // 5), n // 2 + 1, n - 1})[: parts - 1]
    bounds = [0, *inner, n]
    if len(set(bounds)) != parts + 1 or bounds != sorted(bounds):
        raise ValueError(f"cannot split {n} elements into {parts} uneven ranges")
    return bounds


def flat_tp_blocks_layout(case: GoldenCase) -> Layout:
    """1 rank: each saved TP block of every flat key as one whole flat range."""
    tensors = []
    for key in case.flat_keys:
        for i, shard in enumerate(_saved_blocks(case, key)):
            block = tuple(shard["non_flat_local_shape"])
            path = _tpath(key, f"block{i}")
            tensors.append(
                _flat(case, key, path, rank_offsets_of(shard), block, 0, math.prod(block))
            )
    return Layout("flat_tp_blocks_ws1", (RankRequest(tuple(tensors)),))


def flat_dp_layout(case: GoldenCase, world_size: int) -> Layout:
    """TP=1 x DP=world_size: uneven flat ranges over each whole flat key."""
    per_rank: list[list[TensorRequest]] = [[] for _ in range(world_size)]
    for key in case.flat_keys:
        shape = case.global_shape(key)
        bounds = _uneven_bounds(math.prod(shape), world_size)
        for rank in range(world_size):
            per_rank[rank].append(
                _flat(case, key, _tpath(key), (), shape, bounds[rank], bounds[rank + 1])
            )
    return Layout(f"flat_dp_ws{world_size}", tuple(RankRequest(tuple(t)) for t in per_rank))


def flat_other_dp_layout(case: GoldenCase) -> Layout:
    """2 ranks: inside each saved TP block, a DP split other than the saved one."""
    per_rank: list[list[TensorRequest]] = [[], []]
    for key in case.flat_keys:
        for i, shard in enumerate(_saved_blocks(case, key)):
            block = tuple(shard["non_flat_local_shape"])
            m = math.prod(block)
            saved_points = {
                p for s in case.tensors[key]["shards"] for p in s["flattened_range"]
            } - {0, m}
            split = next(
                p for p in (m // 2, m // 3, 2 * m // 3, 1) if 0 < p < m and p not in saved_points
            )
            offsets = rank_offsets_of(shard)
            path = _tpath(key, f"block{i}")
            per_rank[0].append(_flat(case, key, path, offsets, block, 0, split))
            per_rank[1].append(_flat(case, key, path, offsets, block, split, m))
    return Layout("flat_other_dp_ws2", tuple(RankRequest(tuple(t)) for t in per_rank))


def flat_other_tp_layout(case: GoldenCase) -> Layout:
    """2 ranks: flat ranges on a TP grid other than the saved one; each rank holds the
    first part of one block and the rest of the other block."""
    per_rank: list[list[TensorRequest]] = [[], []]
    for key in case.flat_keys:
        axis = other_split_axis(case, key, 2)
        if axis is None:
            continue
        shape = list(case.global_shape(key))
        shape[axis] //= 2
        block = tuple(shape)
        m = math.prod(block)
        split = max(1, m * 2 // 5)
        for b in range(2):
            path = _tpath(key, f"block{b}")
            offsets = ((axis, b, 2),)
            per_rank[b].append(_flat(case, key, path, offsets, block, 0, split))
            per_rank[1 - b].append(_flat(case, key, path, offsets, block, split, m))
    return Layout("flat_other_tp_ws2", tuple(RankRequest(tuple(t)) for t in per_rank))


def grid_layouts_ws4(case: GoldenCase) -> list[Layout]:
    """4 ranks for the 2-D key of ``grid2x2``: a 4x1 grid, and the 2x2 grid transposed
    over the ranks (rank r holds block (r % 2, r // 2))."""
    four_by_one: list[list[TensorRequest]] = [[] for _ in range(4)]
    transposed: list[list[TensorRequest]] = [[] for _ in range(4)]
    for key in case.tensors:
        shape = case.global_shape(key)
        dtype = case.tensors[key]["dtype"]
        for rank in range(4):
            four_by_one[rank].append(_split(case, key, 0, 4, rank, _tpath(key)))
            transposed[rank].append(
                TensorRequest(
                    key,
                    _tpath(key),
                    dtype,
                    ((0, rank % 2, 2), (1, rank // 2, 2)),
                    (shape[0] // 2, shape[1] // 2),
                )
            )
    return [
        Layout("grid4x1_ws4", tuple(RankRequest(tuple(t)) for t in four_by_one)),
        Layout("grid2x2_transposed_ws4", tuple(RankRequest(tuple(t)) for t in transposed)),
    ]


def flat_layout_ws4(case: GoldenCase) -> Layout:
    """4 ranks: TP=1 x DP=4 uneven flat ranges of the flat keys; the other keys split
    in four along their last divisible axis."""
    base = flat_dp_layout(case, 4)
    per_rank = [list(r.tensors) for r in base.ranks]
    for key in case.tensors:
        if key in case.flat_keys:
            continue
        shape = case.global_shape(key)
        axis = max(a for a, n in enumerate(shape) if n % 4 == 0)
        for rank in range(4):
            per_rank[rank].append(_split(case, key, axis, 4, rank, _tpath(key)))
    return Layout("flat_dp_ws4", tuple(RankRequest(tuple(t)) for t in per_rank))


def layouts_for(case: GoldenCase) -> list[Layout]:
    """Every layout the golden tests load ``case`` under."""
    layouts = [
        saved_layout(case, "relative"),
        whole_layout(case, 1, flat_keys_flat=False),
        whole_layout(case, 2, flat_keys_flat=True, path_mode="relative_elsewhere"),
        other_axis_layout(case, 2),
        one_rank_loads_all_layout(case),
    ]
    if case.flat_keys:
        layouts += [
            whole_layout(case, 1, flat_keys_flat=True),
            flat_tp_blocks_layout(case),
            flat_dp_layout(case, 2),
            flat_other_dp_layout(case),
            flat_other_tp_layout(case),
            flat_layout_ws4(case),
        ]
    if case.prepended_keys:
        layouts += [per_layer_layout(case, 1), per_layer_layout(case, 2)]
    if case.name == "grid2x2":
        layouts += grid_layouts_ws4(case)
    return layouts
