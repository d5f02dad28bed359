"""Saves with an unchanged structure (``cached_metadata=True``) on real gloo ranks: the
coordinator rewrites the cached metadata only when every rank's structure and write
results are unchanged, and that metadata is the one a full assembly writes; each rank
reuses its plan's items and file grouping only while its structure is unchanged; and
Megatron-LM's way of turning the cache on (``use_cached_ckpt_structure = True``) works."""

from __future__ import annotations

import io
import os
from typing import Any

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing.engine.safety.metadata import load_metadata
from dist_checkpointing.engine.storage import metadata_blob
from dist_checkpointing.mapping import ShardedObject, ShardedTensor
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.support.harness import run_distributed, world_sizes

TIMEOUT_S = 120.0


def _state(
    rank: int, world: int, step: int, extra_key: bool = False, blob: int = 8
) -> dict[str, Any]:
    sd: dict[str, Any] = {
        f"w{i}": ShardedTensor.from_rank_offsets(
            f"w{i}", torch.full((2, 3), float(100 * step + 10 * i + rank)), (0, rank, world)
        )
        for i in range(5)
    }
    sd["rng"] = ShardedObject("rng", b"x" * blob * (rank + 1), (world,), (rank,))
    if extra_key:
        sd["late"] = ShardedTensor.from_rank_offsets("late", torch.ones(2))
    return sd


def _saves(tmp: str) -> list[Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    names = ["first", "same", "full", "object", "changed"]
    if rank == 0:
        for n in names:
            os.makedirs(f"{tmp}/{n}")
    dist.barrier()
    cached = TorchDistSaveShardedStrategy(cached_metadata=True)
    rewritten = []

    def save(name: str, step: int, strategy: Any = cached, **kw: Any) -> None:
        dc.save(_state(rank, world, step, **kw), f"{tmp}/{name}", strategy)
        rewritten.append(
            strategy.cached_structure.metadata_rewritten if strategy is cached else None
        )

    save("first", 0)
    # The coordinator pickled the metadata it caches as a template already: the next
    # save splices into it instead of pickling every entry again.
    kept = cached.cached_structure.metadata
    templated = None if rank != 0 else id(kept) in metadata_blob._templates
    save("same", 1)
    save("full", 1, TorchDistSaveShardedStrategy())  # the same save, fully assembled
    save("object", 2, blob=5000)  # same structure, different write results
    save("changed", 3, extra_key=rank == 1)  # one rank changes its structure
    loaded = {}
    for name, step in (("same", 1), ("object", 2), ("changed", 3)):
        got = dc.load(
            _state(rank, world, -1, extra_key=name == "changed" and rank == 1), f"{tmp}/{name}"
        )
        expected = _state(rank, world, step, blob=5000 if step == 2 else 8)
        loaded[name] = all(torch.equal(got[k], expected[k].data) for k in ("w0", "w4")) and (
            got["rng"] == expected["rng"].data
        )
    return [rewritten, loaded, templated]


def _metadata(path: str) -> tuple[bytes, Any]:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        raw = f.read()
    return raw, load_metadata(io.BytesIO(raw))


@world_sizes(2, 4)
def test_unchanged_structure_rewrites_the_metadata_a_full_assembly_writes(
    world_size: int, tmp_path: Any
) -> None:
    results = run_distributed(_saves, world_size, str(tmp_path), timeout=TIMEOUT_S)
    assert [r[2] for r in results] == [True] + [None] * (world_size - 1)
    for rewritten, loaded, _ in results:
        # first: full; same: rewritten; full: another strategy; object: results differ;
        # changed: one rank's structure differs.
        assert rewritten == [False, True, None, False, False]
        assert loaded == {"same": True, "object": True, "changed": True}
    _, same = _metadata(str(tmp_path / "same"))
    _, full = _metadata(str(tmp_path / "full"))
    assert same.storage_meta != full.storage_meta  # its own path and save id
    assert same.storage_meta.checkpoint_id == str(tmp_path / "same")
    same.storage_meta = full.storage_meta
    # The rewrite splices the new path and save id into the template of the same
    # object (engine/storage/metadata_blob): equal objects, frames may split elsewhere.
    assert same == full


def _base(step: int, rank: int) -> float:
    return 1000.0 * step + 100.0 * rank


def _layouts(rank: int, world: int, step: int, dtype: torch.dtype) -> dict[str, Any]:
    """A tensor-parallel weight, a layer-stacked one (a prepended axis), a
    distributed-optimizer slice (half of a block's flat range: two ranks per block)
    and an object, with values of the step and rank."""
    base = _base(step, rank)
    half = slice(3 * (rank % 2), 3 * (rank % 2) + 3)
    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", (torch.arange(6.0) + base).reshape(2, 3).to(dtype), (0, rank, world)
        ),
        "layers": ShardedTensor.from_rank_offsets(
            "layers", torch.full((4,), base), (0, rank, world), prepend_axis_num=1
        ),
        "exp_avg": ShardedTensor.from_rank_offsets_flat(
            "exp_avg",
            torch.arange(6.0)[half] + base,
            (6,),
            (0, rank // 2, world // 2),
            flattened_range=half,
        ),
        "rng": ShardedObject("rng", {"step": step, "rank": rank}, (world,), (rank,)),
    }


def _expected(world: int, step: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The global tensors of :func:`_layouts`, built element by element."""
    w = torch.zeros(2 * world, 3)
    layers = torch.zeros(world, 4)
    exp_avg = torch.zeros(world // 2 * 6)
    for r in range(world):
        for i in range(6):
            w[2 * r + i // 3, i % 3] = i + _base(step, r)
        layers[r] = _base(step, r)
    for j in range(exp_avg.numel()):
        owner = 2 * (j // 6) + (j % 6) // 3
        exp_avg[j] = j % 6 + _base(step, owner)
    return {"w": w.to(dtype), "layers": layers, "exp_avg": exp_avg}


# Step 3 saves 'w' in bf16: the structure changes (only the dtype).
STEPS = [(0, torch.float32), (1, torch.float32), (2, torch.float32), (3, torch.bfloat16)]


def _reused_plans(tmp: str) -> list[Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
    seen: list[dict[str, bool]] = []
    loaded: list[dict[str, Any]] = []
    previous = None
    for step, dtype in STEPS:
        path = f"{tmp}/s{step}"
        if rank == 0:
            os.makedirs(path)
        dist.barrier()
        dc.save(_layouts(rank, world, step, dtype), path, strategy)
        now = strategy.cached_structure
        assert now is not None
        seen.append(
            {
                "reused": now.reused,
                "same_items": previous is not None
                and now.local_plan.items is previous.local_plan.items,
                "same_buckets": previous is not None
                and now.bucket_layout is previous.bucket_layout,
            }
        )
        previous = now
        request = _layouts(rank, world, -1, dtype)
        request["w"] = ShardedTensor.from_rank_offsets(
            "w", torch.zeros(2 * world, 3, dtype=dtype), replica_id=rank
        )
        request["layers"] = ShardedTensor.from_rank_offsets(
            "layers", torch.zeros(world, 4), replica_id=rank
        )
        got = dc.load(request, path)
        loaded.append({k: got[k] for k in ("w", "layers", "exp_avg", "rng")})
    return [seen, loaded]


@world_sizes(2, 4)
def test_an_unchanged_structure_reuses_the_plan_items_and_the_file_grouping(
    world_size: int, tmp_path: Any
) -> None:
    results = run_distributed(_reused_plans, world_size, str(tmp_path), timeout=TIMEOUT_S)
    for rank, (seen, loaded) in enumerate(results):
        assert [s["reused"] for s in seen] == [False, True, True, False]
        assert [s["same_items"] for s in seen] == [False, True, True, False]
        assert [s["same_buckets"] for s in seen] == [False, True, True, False]
        for (step, dtype), got in zip(STEPS, loaded):
            want = _expected(world_size, step, dtype)
            assert got["w"].dtype == want["w"].dtype
            assert torch.equal(got["w"], want["w"]), (rank, step)
            assert torch.equal(got["layers"], want["layers"]), (rank, step)
            half = slice(6 * (rank // 2) + 3 * (rank % 2), 6 * (rank // 2) + 3 * (rank % 2) + 3)
            assert torch.equal(got["exp_avg"], want["exp_avg"][half]), (rank, step)
            assert got["rng"] == {"step": step, "rank": rank}


def _megatron_lm_style(tmp: str) -> list[bool]:
    """As Megatron-LM turns caching on: the attribute, set after the strategy is built."""
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = TorchDistSaveShardedStrategy()
    assert strategy.use_cached_ckpt_structure is False
    strategy.use_cached_ckpt_structure = True
    assert strategy.cached_metadata is True
    reused = []
    for step in range(3):
        path = f"{tmp}/m{step}"
        if rank == 0:
            os.makedirs(path)
        dist.barrier()
        dc.save(_state(rank, world, step), path, strategy)
        assert strategy.cached_structure is not None
        reused.append(strategy.cached_structure.reused)
        got = dc.load(_state(rank, world, -1), path)
        assert torch.equal(got["w3"], _state(rank, world, step)["w3"].data)
    return reused


@world_sizes(2)
def test_megatron_lm_turns_caching_on_with_use_cached_ckpt_structure(
    world_size: int, tmp_path: Any
) -> None:
    for reused in run_distributed(_megatron_lm_style, world_size, str(tmp_path), timeout=TIMEOUT_S):
        assert reused == [False, True, True]
