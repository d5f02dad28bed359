"""End-to-end save/load round trips of the torch_dist backend on real gloo ranks.

Every rank saves its shards of deterministic reference tensors, then loads the same
layout into poisoned destinations (every element differs bitwise from the expected
value); the parent process compares each loaded tensor with the reference, byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.support.harness import run_distributed, world_sizes
from tests.support.layouts import (
    Shard,
    expected_local,
    flat_layout,
    grid_layout,
    make_sharded,
    pack,
    poison,
    reference_tensor,
    same_bits,
    unpack,
)

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.float8_e4m3fn,
    torch.bool,
    torch.uint8,
]
SHAPE = (4, 8, 4)  # every axis divisible by the world sizes 1, 2 and 4


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_keys(world_size: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``key -> (dtype, fragmentations)``: every dtype split along each axis in turn."""
    keys = {}
    for dtype in DTYPES:
        for axis in range(len(SHAPE)):
            fragm = tuple(world_size if a == axis else 1 for a in range(len(SHAPE)))
            keys[f"{_dtype_name(dtype)}/ax{axis}"] = (dtype, fragm)
    return keys


# ---------------------------------------------------------------------------- rank functions


def _tensors_roundtrip(ckpt_dir: Path) -> bytes:
    """Save each dtype split along each axis, a 0-d scalar and a 2-D tensor; load them back
    (the 2-D one into a transposed view). Returns what load returned and the view."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    keys = _dtype_keys(world_size)

    def state_dict(fill: bool) -> tuple[dict[str, Any], torch.Tensor]:
        sd: dict[str, Any] = {}
        for key, (dtype, fragm) in keys.items():
            ref = reference_tensor(key, SHAPE, dtype)
            sd[key] = [
                make_sharded(key, ref, s, fill) for s in grid_layout(fragm, world_size)[rank]
            ]
        scalar = reference_tensor("scalar", (), torch.float32)
        sd["scalar"] = ShardedTensor.from_rank_offsets(
            "scalar", scalar if fill else poison(scalar), replica_id=rank
        )
        # A 2-D tensor split on axis 1, loaded into a transposed (non-contiguous) view.
        ref_2d = reference_tensor("transposed", (6, 2 * world_size), torch.bfloat16)
        local = ref_2d[:, 2 * rank : 2 * rank + 2]
        dest = local.clone() if fill else poison(local).t().contiguous().t()
        sd["transposed"] = ShardedTensor.from_rank_offsets(
            "transposed", dest, (1, rank, world_size)
        )
        return sd, dest

    save_sd, _ = state_dict(fill=True)
    dcp.save(save_sd, ckpt_dir)
    load_sd, view = state_dict(fill=False)
    assert not view.is_contiguous()
    loaded = dcp.load(load_sd, ckpt_dir)
    return pack({"loaded": loaded, "view": view})


def _objects_and_common(ckpt_dir: Path) -> bytes:
    """ShardedObjects (one per rank and one replicated), the common part and a
    LocalNonpersistentObject; returns what load and the metadata readers return."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sd = _objects_state_dict(rank, world_size, fill=True)
    sd["nonpersistent"] = LocalNonpersistentObject({"saved": rank})
    dcp.save(sd, ckpt_dir)

    request = _objects_state_dict(rank, world_size, fill=False)
    # The common values are not requested: they come back from common.pt anyway.
    del request["common"]
    request["nonpersistent"] = LocalNonpersistentObject(["at load", rank])
    return pack(
        {
            "loaded": dcp.load(request, ckpt_dir),
            "common": dcp.load_common_state_dict(ckpt_dir),
            "sharded_keys": sorted(dcp.load_sharded_metadata(ckpt_dir)),
        }
    )


def _common_part() -> dict[str, Any]:
    return {
        "int": 7,
        "float": -2.5e-3,
        "text": "żółć — 勾配 ✓",
        "none": None,
        "nested": {"list": [1, 2.0, "three", {"four": 4}], "empty": {}},
        "tensor": torch.arange(6, dtype=torch.float16).reshape(2, 3),
    }


def _object_payload(rank: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "steps": [rank, [rank + 1, {"deep": torch.full((2,), float(rank))}]],
        "state": torch.arange(3, dtype=torch.int64) * (rank + 1),
    }


def _objects_state_dict(rank: int, world_size: int, fill: bool) -> dict[str, Any]:
    def payload(value: Any) -> Any:
        return value if fill else None

    return {
        "common": _common_part(),
        "per_rank": ShardedObject(
            "rng_state", payload(_object_payload(rank)), (world_size,), (rank,)
        ),
        "shared": ShardedObject(
            "shared_obj", payload({"lr": [0.1, 0.01]}), (1,), (0,), replica_id=rank
        ),
    }


def _split_build(
    key: str, data: torch.Tensor, replica_id: Any, flattened_range: slice | None
) -> dict[str, ShardedTensor]:
    """Factory build: the two halves of axis 0, each sharded over the ranks on axis 1."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    top, bottom = data.chunk(2, dim=0)
    return {
        name: ShardedTensor.from_rank_offsets(
            f"{key}.{name}", half, (1, rank, world_size), replica_id=replica_id
        )
        for name, half in (("top", top), ("bottom", bottom))
    }


def _concat_merge(loaded: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([loaded["top"], loaded["bottom"]], dim=0)


def _factory_roundtrip(ckpt_dir: Path) -> bytes:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ref = reference_tensor("factory", (4, 3 * world_size), torch.float32)
    local = ref[:, 3 * rank : 3 * rank + 3].clone()

    def sd(data: torch.Tensor) -> dict[str, Any]:
        return {"w": ShardedTensorFactory("factory", data, _split_build, _concat_merge)}

    dcp.save(sd(local), ckpt_dir)
    loaded = dcp.load(sd(poison(local)), ckpt_dir)
    stored = {k: tuple(v.global_shape) for k, v in dcp.load_tensors_metadata(ckpt_dir).items()}
    return pack({"loaded": loaded, "stored": stored})


def _allocated_by_loader(ckpt_dir: Path, layout_cuts: list[list[int]]) -> bytes:
    """Load regular and flat requests that carry no data (the loader allocates)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ref = reference_tensor("alloc", (4, 6), torch.bfloat16)
    grid = grid_layout((world_size, 1), world_size)[rank]
    flat = flat_layout((4, 6), (1, 2), layout_cuts, world_size)[rank]

    def sd(fill: bool) -> dict[str, Any]:
        return {
            "grid": [make_sharded("alloc", ref, s, fill) for s in grid],
            "flat": [make_sharded("alloc_flat", ref, s, fill) for s in flat],
        }

    dcp.save(sd(True), ckpt_dir)
    request = sd(False)
    for shards in request.values():
        for i, sh in enumerate(shards):
            shards[i] = sh.without_data()
            assert shards[i].data is None
    return pack(dcp.load(request, ckpt_dir))


def _save_with_threads(ckpt_dir: Path, thread_count: int) -> bytes:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    refs = {
        f"t{i}": reference_tensor(f"t{i}", (2 * world_size, 5), torch.float32) for i in range(5)
    }

    def sd(fill: bool) -> dict[str, Any]:
        return {
            key: make_sharded(key, ref, Shard((rank, 0), (world_size, 1)), fill)
            for key, ref in refs.items()
        }

    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=thread_count)
    dcp.save(sd(True), ckpt_dir, sharded_strategy=strategy)
    dist.barrier()
    files = sorted(p.name for p in Path(ckpt_dir).glob(f"__{rank}_*.distcp"))
    return pack({"loaded": dcp.load(sd(False), ckpt_dir), "files": files})


# ---------------------------------------------------------------------------- tests


def _run(fn: Callable[..., bytes], world_size: int, *args: Any) -> list[Any]:
    return [unpack(r) for r in run_distributed(fn, world_size, *args)]


@world_sizes(1, 2, 4)
def test_tensor_dtypes_scalar_and_noncontiguous_destination(
    tmp_path: Path, world_size: int
) -> None:
    results = _run(_tensors_roundtrip, world_size, tmp_path)
    keys = _dtype_keys(world_size)
    for rank, result in enumerate(results):
        loaded = result["loaded"]
        assert set(loaded) == set(keys) | {"scalar", "transposed"}
        for key, (dtype, fragm) in keys.items():
            ref = reference_tensor(key, SHAPE, dtype)
            shards = grid_layout(fragm, world_size)[rank]
            assert len(loaded[key]) == len(shards)
            for got, shard in zip(loaded[key], shards):
                assert same_bits(got, expected_local(ref, shard)), (rank, key, shard)
        scalar = reference_tensor("scalar", (), torch.float32)
        assert loaded["scalar"].shape == () and same_bits(loaded["scalar"], scalar)
        ref_2d = reference_tensor("transposed", (6, 2 * world_size), torch.bfloat16)
        expected = ref_2d[:, 2 * rank : 2 * rank + 2]
        # The caller's view itself is filled, not a contiguous copy of it.
        assert not result["view"].is_contiguous()
        assert same_bits(result["view"], expected), rank
        assert same_bits(loaded["transposed"], expected), rank


@world_sizes(1, 2, 4)
def test_objects_common_state_and_nonpersistent(tmp_path: Path, world_size: int) -> None:
    results = _run(_objects_and_common, world_size, tmp_path)
    expected_common = _common_part()
    for rank, result in enumerate(results):
        loaded = result["loaded"]
        for common in (loaded["common"], result["common"]["common"]):
            assert same_bits(common.pop("tensor"), expected_common["tensor"])
            assert common == {k: v for k, v in expected_common.items() if k != "tensor"}
        # The non-persistent value is what was passed at load, unwrapped, and never stored.
        assert loaded["nonpersistent"] == ["at load", rank]
        assert "nonpersistent" not in result["common"]
        assert set(result["common"]) == {"common"}
        payload = loaded["per_rank"]
        expected = _object_payload(rank)
        assert payload["rank"] == rank and payload["steps"][:1] == [rank]
        assert payload["steps"][1][0] == rank + 1
        assert torch.equal(payload["steps"][1][1]["deep"], expected["steps"][1][1]["deep"])
        assert torch.equal(payload["state"], expected["state"])
        assert loaded["shared"] == {"lr": [0.1, 0.01]}
        stored_objects = [f"rng_state/shard_{r}_{world_size}" for r in range(world_size)]
        assert result["sharded_keys"] == sorted([*stored_objects, "shared_obj/shard_0_1"])


@world_sizes(1, 2)
def test_factory_roundtrip(tmp_path: Path, world_size: int) -> None:
    results = _run(_factory_roundtrip, world_size, tmp_path)
    ref = reference_tensor("factory", (4, 3 * world_size), torch.float32)
    for rank, result in enumerate(results):
        # The factory was built at save (two stored tensors) and merged back at load.
        assert result["stored"] == {
            "factory.top": (2, 3 * world_size),
            "factory.bottom": (2, 3 * world_size),
        }
        assert same_bits(result["loaded"]["w"], ref[:, 3 * rank : 3 * rank + 3])


@world_sizes(1, 2, 4)
def test_load_allocates_requests_without_data(tmp_path: Path, world_size: int) -> None:
    cuts = [[5], [1, 1, 11]]  # uneven flat ranges, one of them empty
    results = _run(_allocated_by_loader, world_size, tmp_path, cuts)
    ref = reference_tensor("alloc", (4, 6), torch.bfloat16)
    for rank, loaded in enumerate(results):
        for name, layout in (
            ("grid", grid_layout((world_size, 1), world_size)),
            ("flat", flat_layout((4, 6), (1, 2), cuts, world_size)),
        ):
            assert len(loaded[name]) == len(layout[rank])
            for got, shard in zip(loaded[name], layout[rank]):
                assert same_bits(got, expected_local(ref, shard)), (rank, name, shard)


@pytest.mark.parametrize("thread_count", [1, 3])
def test_sync_save_thread_count(tmp_path: Path, thread_count: int) -> None:
    world_size = 2
    results = _run(_save_with_threads, world_size, tmp_path, thread_count)
    for rank, result in enumerate(results):
        # Five items per rank: one data file per writer thread.
        assert result["files"] == [f"__{rank}_{n}.distcp" for n in range(thread_count)]
        for key, got in result["loaded"].items():
            ref = reference_tensor(key, (2 * world_size, 5), torch.float32)
            assert same_bits(got, ref[2 * rank : 2 * rank + 2]), (rank, key)
