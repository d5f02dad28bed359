"""Saves with an unchanged structure (``cached_metadata=True``) on real gloo ranks: the
coordinator rewrites the cached metadata only when every rank's structure and write
results are unchanged, and that metadata is the one a full assembly writes."""

from __future__ import annotations

import io
import os
from typing import Any

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing.engine.safety.metadata import load_metadata
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
    return [rewritten, loaded]


def _metadata(path: str) -> tuple[bytes, Any]:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        raw = f.read()
    return raw, load_metadata(io.BytesIO(raw))


@world_sizes(2, 4)
def test_unchanged_structure_rewrites_the_metadata_a_full_assembly_writes(
    world_size: int, tmp_path: Any
) -> None:
    results = run_distributed(_saves, world_size, str(tmp_path), timeout=TIMEOUT_S)
    for rewritten, loaded in results:
        # first: full; same: rewritten; full: another strategy; object: results differ;
        # changed: one rank's structure differs.
        assert rewritten == [False, True, None, False, False]
        assert loaded == {"same": True, "object": True, "changed": True}
    _, same = _metadata(str(tmp_path / "same"))
    _, full = _metadata(str(tmp_path / "full"))
    assert same.storage_meta != full.storage_meta  # its own path and save id
    assert same.storage_meta.checkpoint_id == str(tmp_path / "same")
    same.storage_meta = full.storage_meta
    # The rewrite splices the new path and save id into the first pickle of the same
    # object (engine/storage/metadata_blob): equal objects, frames may split elsewhere.
    assert same == full
