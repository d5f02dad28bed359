"""RankGroup's gather (engine/collectives): every rank's object reaches the coordinator in
group-rank order, the coordinator's own entry is its object itself (no pickled copy)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from dist_checkpointing.engine.collectives import RankGroup
from tests.support.harness import run_distributed


def _gather(coordinator: int) -> tuple[bool, Any]:
    rank = dist.get_rank()
    mine = {"rank": rank, "items": [(f"t{rank}.{i}", (i,)) for i in range(3)]}
    got = RankGroup(coordinator=coordinator).gather(mine)
    if got is None:
        return False, None
    assert got[rank] is mine  # not a copy
    return True, got


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_returns_the_coordinators_object_and_copies_of_the_others(
    world_size: int,
) -> None:
    coordinator = world_size - 1
    results = run_distributed(_gather, world_size, coordinator)
    for rank, (is_coordinator, got) in enumerate(results):
        assert is_coordinator == (rank == coordinator)
        if rank != coordinator:
            assert got is None
    expected = [
        {"rank": r, "items": [(f"t{r}.{i}", (i,)) for i in range(3)]} for r in range(world_size)
    ]
    assert results[coordinator][1] == expected
