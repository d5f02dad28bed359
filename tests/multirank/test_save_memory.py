"""What a ``torch_dist`` save still holds while the coordinator builds and pickles
``.metadata`` (the peak of a save of many tensors): not the plan's write items nor the
data they resolved, unless ``cached_metadata`` keeps the plan for the next save, and
never the writer's write results."""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

import dist_checkpointing as dc
from dist_checkpointing.mapping import ShardedTensor
from dist_checkpointing.strategies import filesystem_async
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.support.harness import run_distributed, world_sizes

TIMEOUT_S = 120.0
PREFIX = "memtest."
TENSORS = 40


def _live_items() -> tuple[int, int]:
    """The write items and write results of this test's tensors alive now."""
    alive = [o for o in gc.get_objects() if type(o) in (WriteItem, WriteResult)]
    ours = [o for o in alive if o.index.fqn.startswith(PREFIX)]
    return (
        sum(type(o) is WriteItem for o in ours),  # noqa: E721
        sum(type(o) is WriteResult for o in ours),  # noqa: E721
    )


def _alive_at_metadata(tmp: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    seen: list[tuple[int, int]] = []
    original = filesystem_async.metadata_bytes

    def counting(metadata: Any) -> bytes:
        seen.append(_live_items())
        return original(metadata)

    filesystem_async.metadata_bytes = counting  # type: ignore[assignment]
    out: dict[str, Any] = {}
    try:
        for name, cached in (("plain", False), ("cached", True)):
            path = f"{tmp}/{name}"
            if rank == 0:
                os.makedirs(path)
            dist.barrier()
            state = {
                f"t{i}": ShardedTensor.from_rank_offsets(
                    f"{PREFIX}t{i}", torch.full((3,), float(10 * i + rank)), (0, rank, world)
                )
                for i in range(TENSORS)
            }
            strategy = TorchDistSaveShardedStrategy(cached_metadata=cached)
            seen.clear()
            dc.save(state, path, strategy)
            out[name] = list(seen)  # the coordinator pickles .metadata, the others do not
            request = {
                k: ShardedTensor.from_rank_offsets(v.key, torch.zeros(3 * world), replica_id=rank)
                for k, v in state.items()
            }
            loaded = dc.load(request, path)
            out[f"{name}_exact"] = all(
                torch.equal(
                    loaded[f"t{i}"],
                    torch.tensor([float(10 * i + r) for r in range(world) for _ in range(3)]),
                )
                for i in range(TENSORS)
            )
            del strategy
    finally:
        filesystem_async.metadata_bytes = original  # type: ignore[assignment]
    return out


@world_sizes(2)
def test_the_metadata_is_built_without_the_plan_unless_the_plan_is_cached(
    world_size: int, tmp_path: Any
) -> None:
    results = run_distributed(_alive_at_metadata, world_size, str(tmp_path), timeout=TIMEOUT_S)
    coordinator = results[0]
    # Every write item was let go before the pickle; with the cache, this rank's are kept
    # for the next save. The write results were let go in both (their compact form is
    # what the metadata is built from).
    assert coordinator["plain"] == [(0, 0)]
    assert coordinator["cached"] == [(TENSORS, 0)]
    for rank in results:
        assert rank["plain_exact"] and rank["cached_exact"]
