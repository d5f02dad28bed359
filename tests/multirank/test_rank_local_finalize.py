"""Finalize functions that only some ranks add, as Megatron-LM's ``save_checkpoint``
does (the tracker file on rank 0, its loggers on the last rank): every rank still
finalizes the call in step, the functions run where they were added, after the
library's own (the checkpoint is committed when they run), and one raising on its rank
alone fails the call on every rank.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import CheckpointWriteError
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from tests.support.harness import run_distributed


def _state(rank: int, world: int, step: int) -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", torch.full((4, 3), float(step * 10 + rank)), (0, rank, world)
        )
    }


def _tracker(log: list[str], ckpt: Path, step: int, fail: bool) -> None:
    if fail:
        raise OSError(f"rank 0 could not write the tracker of step {step}")
    log.append(f"{step}:{(ckpt / 'commit.json').exists() or (ckpt / 'metadata.json').exists()}")


def _saves(root: str, backend: str, fail_step: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    queue = AsyncCallsQueue(persistent=False)
    log: list[str] = []
    errors: list[str] = []
    for step in (1, 2, 3):
        ckpt = Path(root) / f"s{step}"
        if rank == 0:
            ckpt.mkdir(parents=True)
        dist.barrier()
        request = dc.save(
            _state(rank, world, step),
            ckpt,
            dc.get_default_save_sharded_strategy(backend, 1),
            async_sharded_save=True,
        )
        assert isinstance(request, AsyncRequest)
        if rank == 0:  # as Megatron-LM adds its tracker file
            request.add_finalize_fn(partial(_tracker, log, ckpt, step, step == fail_step))
        if rank == world - 1:  # and its loggers
            request.add_finalize_fn(partial(log.append, f"{step}:logged"))
        queue.schedule_async_request(request)
        try:
            queue.maybe_finalize_async_calls(blocking=True)
        except CheckpointWriteError as err:
            errors.append(f"{step}: {err}")
    queue.close()
    return {"log": log, "errors": errors}


@pytest.mark.parametrize("backend", ["torch_dist", "raw_bytes"])
def test_finalize_functions_of_some_ranks_only(tmp_path: Path, backend: str) -> None:
    results = run_distributed(_saves, 3, str(tmp_path), backend, 2, timeout=120.0)
    assert results[0]["log"] == ["1:True", "3:True"], results[0]
    # The last rank's logger ran at step 2 too: the tracker failed on rank 0 only.
    assert results[1]["log"] == [] and results[2]["log"] == ["1:logged", "2:logged", "3:logged"]
    for rank, res in enumerate(results):  # step 2's tracker failed on rank 0: every rank raised
        (error,) = res["errors"]
        assert error.startswith("2: ") and "tracker of step 2" in error and "[0]" in error, (
            rank,
            error,
        )
