"""Conformance cases every registered sharded layout must pass, parametrized by backend.

Each case saves with ``get_default_save_sharded_strategy(backend, 1)`` and loads
through ``dist_checkpointing.load`` (which dispatches on ``metadata.json``):

- round trip, byte-exact, over dtypes (FP8 and bool included), grid and flat layouts,
  ShardedObjects, common state;
- resharding 2 -> 4 -> 1 ranks (grid blocks on other axes, distributed-optimizer flat
  ranges with other cuts), compared with the full tensor built independently;
- strict key handling (a requested key the checkpoint lacks is reported by name);
- an async save through :class:`AsyncCallsQueue` (temporal and persistent callers).

Another layout joins by adding its backend name to ``BACKENDS``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject
from dist_checkpointing.dict_utils import nested_values
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from tests.support.harness import run_distributed
from tests.support.layouts import (
    TensorSpec,
    even_cuts,
    flat_layout,
    grid_layout,
    loaded_mismatches,
    pack,
    replicated_layout,
    sharded_state_dict,
    unpack,
)

pytestmark = pytest.mark.timeout(180)

BACKENDS = ("torch_dist", "raw_bytes")
BY_BACKEND = pytest.mark.parametrize("backend", BACKENDS)
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.float8_e4m3fn,
    torch.bool,
    torch.uint8,
)
SHAPE = (8, 4, 8)  # every axis divisible by 1, 2 and 4


def _specs(world: int, variant: int) -> list[TensorSpec]:
    """Tensors in layouts for ``world`` ranks; ``variant`` changes the grid axis and the
    flat cuts (so that two variants reshard into each other)."""
    specs = []
    for i, dtype in enumerate(DTYPES):
        axis = (i + variant) % len(SHAPE)
        fragm = tuple(world if a == axis else 1 for a in range(len(SHAPE)))
        key = f"t{i}"
        specs.append(TensorSpec(key, SHAPE, dtype, grid_layout(fragm, world)))
    numel = SHAPE[0] * SHAPE[1] * SHAPE[2]
    tp = 2 if world % 2 == 0 else 1
    dp = world // tp
    fragm = (tp, 1, 1)
    block = numel // tp
    cuts = [even_cuts(block, dp) if variant == 0 else sorted({3, block - 5}) for _ in range(tp)]
    if variant != 0:
        cuts = [sorted(set(c) | set(even_cuts(block, dp))) for c in cuts]
    specs.append(TensorSpec("flat", SHAPE, torch.float32, flat_layout(SHAPE, fragm, cuts, world)))
    specs.append(TensorSpec("repl", (5,), torch.float32, replicated_layout(1, world)))
    return specs


def _objects(rank: int, world: int) -> dict[str, Any]:
    return {
        "obj": ShardedObject("obj", {"rank": rank, "v": [1, 2.5]}, (world,), (rank,)),
        "common": {"step": 7},
    }


def _save(ckpt: Path, backend: str, specs: list[TensorSpec], objects: bool = True) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd: dict[str, Any] = dict(sharded_state_dict(specs, rank))
    if objects:
        sd.update(_objects(rank, world))
    dc.save(sd, ckpt, get_default_save_sharded_strategy(backend, 1))


def _load(ckpt: Path, specs: list[TensorSpec], saved_world: int) -> bytes:
    rank = dist.get_rank()
    request: dict[str, Any] = dict(sharded_state_dict(specs, rank, fill=False))
    if saved_world:
        request["obj"] = [
            ShardedObject("obj", None, (saved_world,), (r,), replica_id=int(r != rank))
            for r in range(saved_world)
        ]
    return pack(dc.load(request, ckpt))


def _roundtrip(ckpt: Path, backend: str) -> bytes:
    specs = _specs(dist.get_world_size(), 0)
    _save(ckpt, backend, specs)
    return _load(ckpt, specs, dist.get_world_size())


@BY_BACKEND
@pytest.mark.parametrize("world_size", [1, 2])
def test_roundtrip_is_byte_exact(tmp_path: Path, backend: str, world_size: int) -> None:
    results = run_distributed(_roundtrip, world_size, tmp_path, backend)
    assert loaded_mismatches(results, _specs(world_size, 0)) == []
    for rank, packed in enumerate(results):
        loaded = unpack(packed)
        assert [o["rank"] for o in loaded["obj"]] == list(range(world_size))
        assert loaded["obj"][0]["v"] == [1, 2.5]
        assert loaded["common"] == {"step": 7}, rank


def _save_only(ckpt: Path, backend: str, variant: int) -> None:
    _save(ckpt, backend, _specs(dist.get_world_size(), variant), objects=False)


def _load_only(ckpt: Path, world: int, variant: int) -> bytes:
    return _load(ckpt, _specs(world, variant), 0)


def _load_and_resave(src: Path, dst: Path, backend: str, variant: int) -> bytes:
    """Load the 2-rank checkpoint in this world's layout, then save that layout."""
    world = dist.get_world_size()
    specs = _specs(world, variant)
    packed = _load(src, specs, 0)
    loaded = unpack(packed)
    sd = dict(sharded_state_dict(specs, dist.get_rank()))
    for key, shards in sd.items():  # save exactly what was loaded
        for sh, t in zip(shards, loaded[key]):
            sh.data = t
    dc.save(sd, dst, get_default_save_sharded_strategy(backend, 1))
    return packed


@BY_BACKEND
@pytest.mark.slow
def test_resharding_2_to_4_to_1(tmp_path: Path, backend: str) -> None:
    first, second = tmp_path / "two", tmp_path / "four"
    first.mkdir()
    second.mkdir()
    run_distributed(_save_only, 2, first, backend, 0)
    results = run_distributed(_load_and_resave, 4, first, second, backend, 1)
    assert loaded_mismatches(results, _specs(4, 1)) == []
    results = run_distributed(_load_only, 1, second, 1, 0)
    assert loaded_mismatches(results, _specs(1, 0)) == []


def _strict(ckpt: Path, backend: str) -> tuple[list[str], list[str]]:
    specs = _specs(1, 0)
    _save(ckpt, backend, specs[:2], objects=False)
    request = sharded_state_dict(specs[:3], 0, fill=False)
    _, missing, unexpected = dc.load(request, ckpt, strict="return_all")
    try:
        dc.load(sharded_state_dict(specs[:3], 0, fill=False), ckpt, strict="raise_all")
    except Exception as exc:  # noqa: BLE001 - returned for the assertion
        return sorted(unexpected), [type(exc).__name__, str(exc)]
    return sorted(unexpected), []


@BY_BACKEND
def test_strict_handling_names_unexpected_keys(tmp_path: Path, backend: str) -> None:
    """A requested key the checkpoint lacks is "unexpected" (Megatron-Core's naming)."""
    [(unexpected, error)] = run_distributed(_strict, 1, tmp_path, backend)
    assert unexpected == ["t2"]
    assert error and "t2" in error[1], error


def _async(ckpt: Path, backend: str, persistent: bool) -> bytes:
    specs = _specs(dist.get_world_size(), 0)
    rank, world = dist.get_rank(), dist.get_world_size()
    queue = AsyncCallsQueue(persistent=persistent)
    sd: dict[str, Any] = dict(sharded_state_dict(specs, rank))
    sd.update(_objects(rank, world))
    strategy = get_default_save_sharded_strategy(backend, 1)
    request = dc.save(sd, ckpt, strategy, async_sharded_save=True)
    queue.schedule_async_request(request)
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    queue.close()
    return _load(ckpt, specs, world)


@BY_BACKEND
@pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
def test_async_save_roundtrip(tmp_path: Path, backend: str, persistent: bool) -> None:
    results = run_distributed(_async, 2, tmp_path, backend, persistent, timeout=150.0)
    assert loaded_mismatches(results, _specs(2, 0)) == []


def _cached_async(root: Path, backend: str, persistent: bool) -> tuple[bytes, list[str], int]:
    """Two async saves of one structure by a strategy that caches it (the second with new
    tensors, all zero): the first checkpoint loads the reference values, the second
    zeros; returns how many saves reused the cached plan or layout."""
    specs = _specs(dist.get_world_size(), 0)
    rank, world = dist.get_rank(), dist.get_world_size()
    queue = AsyncCallsQueue(persistent=persistent)
    strategy = get_default_save_sharded_strategy(backend, 1)
    strategy = type(strategy)(backend, 1)
    strategy.use_cached_ckpt_structure = True
    for i, (name, zero) in enumerate((("a", False), ("b", True))):
        sd: dict[str, Any] = dict(sharded_state_dict(specs, rank))
        if zero:
            for sh in nested_values(sd):
                sh.data.zero_()
        sd.update(_objects(rank, world))
        request = dc.save(sd, root / name, strategy, async_sharded_save=True)
        queue.schedule_async_request(request)
        assert queue.maybe_finalize_async_calls(blocking=True) == [i]
    queue.close()
    first = _load(root / "a", specs, world)
    request = dict(sharded_state_dict(specs, rank, fill=False))
    loaded = dc.load(request, root / "b")
    nonzero = [
        k
        for k in request
        for t in (loaded[k] if isinstance(loaded[k], list) else [loaded[k]])
        if bool(t.view(torch.uint8).any())
    ]
    reused = strategy.layout_cache.reused if backend == "raw_bytes" else -1
    return first, nonzero, reused


@BY_BACKEND
@pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
def test_cached_structure_async_saves_write_their_own_data(
    tmp_path: Path, backend: str, persistent: bool
) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    results = run_distributed(_cached_async, 2, tmp_path, backend, persistent, timeout=150.0)
    assert loaded_mismatches([r[0] for r in results], _specs(2, 0)) == []
    assert [r[1] for r in results] == [[], []]
    if backend == "raw_bytes":
        assert [r[2] for r in results] == [1, 1]
