"""Local checkpoints on gloo ranks: MCoreTensorAwareStateDict saved and loaded by
nvidia-resiliency-ext's LocalCheckpointManager.

Each rank holds a row block of ``tp`` (split over all ranks), a fully replicated ``rep``
(``replica_id`` = rank), a flat range of ``flat`` (distributed-optimizer style), one
ShardedObject and common values. Every loaded tensor is compared bit for bit with the
reference built independently (``reference_tensor``) into poisoned destinations.

On CPU the manager saves synchronously without replication (its asynchronous save calls
``torch.cuda.synchronize`` and its replication sends CUDA tensors: the ``gpu`` test).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.errors import KeyMismatchError, RankFailureError
from dist_checkpointing.tensor_aware_state_dict import HAVE_NVRX, MCoreTensorAwareStateDict
from tests.support.harness import requires_gpus, run_distributed, world_sizes
from tests.support.layouts import poison, reference_tensor, same_bits

pytestmark = pytest.mark.skipif(not HAVE_NVRX, reason="nvidia-resiliency-ext is not installed")

TIMEOUT_S = 120.0
ROWS, COLS, REP, FLAT = 8, 3, (5, 2), 12  # ROWS and FLAT divisible by 1, 2 and 4


def _state(poisoned: bool = False, device: str = "cpu") -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()

    def local(t: torch.Tensor) -> torch.Tensor:
        return (poison(t) if poisoned else t.clone()).to(device)

    rows = ROWS // world
    tp = reference_tensor("tp", (ROWS, COLS), torch.float32)[rank * rows : (rank + 1) * rows]
    flat_len = FLAT // world
    flat_range = slice(rank * flat_len, (rank + 1) * flat_len)
    flat = reference_tensor("flat", (FLAT,), torch.bfloat16)[flat_range]
    return {
        "tp": ShardedTensor.from_rank_offsets("tp", local(tp), (0, rank, world)),
        "rep": ShardedTensor.from_rank_offsets(
            "rep", local(reference_tensor("rep", REP, torch.float64)), replica_id=rank
        ),
        "flat": ShardedTensor.from_rank_offsets_flat(
            "flat", local(flat), (FLAT,), flattened_range=flat_range
        ),
        "rng": ShardedObject("rng", None if poisoned else f"rng-{rank}", (world,), (rank,)),
        "iteration": 7,
    }


def _check(loaded: dict[str, Any]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows, flat_len = ROWS // world, FLAT // world
    tp = reference_tensor("tp", (ROWS, COLS), torch.float32)[rank * rows : (rank + 1) * rows]
    flat = reference_tensor("flat", (FLAT,), torch.bfloat16)
    assert same_bits(loaded["tp"].cpu(), tp), f"rank {rank}: tp"
    assert same_bits(loaded["rep"].cpu(), reference_tensor("rep", REP, torch.float64))
    assert same_bits(loaded["flat"].cpu(), flat[rank * flat_len : (rank + 1) * flat_len])
    assert loaded["rng"] == f"rng-{rank}" and loaded["iteration"] == 7


def _manager(root: Path) -> Any:
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )

    return LocalCheckpointManager(root)


def _save_and_load(root: Path, algo: str, exchange_algo: str) -> dict[str, Any]:
    tasd, distribution = MCoreTensorAwareStateDict.from_state_dict(_state(), algo=algo)
    held = sum(t.nbytes for t in tasd.tensors)
    _manager(root).save(tasd, iteration=1)
    manager = _manager(root)  # a restarted job
    assert manager.find_latest() == 1
    loaded_tasd, ckpt_id = manager.load()
    assert ckpt_id == (1, dist.get_rank(), "")
    loaded = loaded_tasd.to_state_dict(
        _state(poisoned=True), algo=algo, exchange_algo=exchange_algo
    )
    _check(loaded)
    # The distribution can be reused for the next save: same shards kept, no validation.
    again, cached = MCoreTensorAwareStateDict.from_state_dict(
        _state(), algo=algo, cached_metadata=distribution
    )
    assert sum(t.nbytes for t in again.tensors) == held and cached is distribution
    return {"held": held}


def _total_bytes() -> int:
    """Bytes of every shard once: tp (split), rep (one copy) and flat (split)."""
    return ROWS * COLS * 4 + REP[0] * REP[1] * 8 + FLAT * 2


@world_sizes(1, 2, 4)
@pytest.mark.parametrize(
    "algo, exchange_algo",
    [
        ("atomic", "broadcast"),
        ("fully_parallel", "broadcast"),
        ("fully_parallel", "gather_rounds"),
        ("fully_parallel", "gather_object"),
    ],
)
def test_local_checkpoint_manager_round_trip(
    tmp_path: Path, world_size: int, algo: str, exchange_algo: str
) -> None:
    results = run_distributed(
        _save_and_load, world_size, tmp_path, algo, exchange_algo, timeout=TIMEOUT_S
    )
    held = sum(r["held"] for r in results)
    replicas = REP[0] * REP[1] * 8 * (world_size - 1)  # the extra copies of "rep"
    if algo == "fully_parallel":
        assert held == _total_bytes()  # each shard kept by one rank only
    else:
        assert held == _total_bytes() + replicas


def _wrong_request(root: Path) -> None:
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_state(), algo="atomic")
    _manager(root).save(tasd, iteration=3)
    manager = _manager(root)
    manager.find_latest()
    loaded_tasd, _ = manager.load()
    request = _state(poisoned=True)
    if dist.get_rank() == 1:
        request["extra"] = ShardedTensor.from_rank_offsets("extra", torch.zeros(2), replica_id=1)
    loaded_tasd.to_state_dict(request, validate_access_integrity=False)


def _expect_failure(root: Path) -> str:
    try:
        _wrong_request(root)
    except (KeyMismatchError, RankFailureError) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("to_state_dict accepted a key absent from the local checkpoint")


def test_key_absent_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_expect_failure, 2, tmp_path, timeout=TIMEOUT_S)
    assert results[1].startswith("KeyMismatchError") and "'extra'" in results[1]
    assert results[0].startswith("RankFailureError") and "'extra'" in results[0]


def _fully_parallel_other_layout(root: Path) -> str:
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_state(), algo="fully_parallel")
    _manager(root).save(tasd, iteration=1)
    manager = _manager(root)
    manager.find_latest()
    loaded_tasd, _ = manager.load()
    request = _state(poisoned=True)
    rank = dist.get_rank()
    # Rank 1 now also asks for the row block rank 0 holds: the distribution differs.
    extra = poison(reference_tensor("tp", (ROWS, COLS), torch.float32)[: ROWS // 2])
    request["tp"] = ShardedTensor.from_rank_offsets("tp", extra, (0, 0, 2), replica_id=rank)
    try:
        loaded_tasd.to_state_dict(request, algo="fully_parallel", validate_access_integrity=False)
    except (KeyMismatchError, RankFailureError) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("a layout the local checkpoints do not hold was accepted")


def test_fully_parallel_with_another_layout_fails_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_fully_parallel_other_layout, 2, tmp_path, timeout=TIMEOUT_S)
    assert any(r.startswith("KeyMismatchError") and "'tp'" in r for r in results), results
    assert all("'tp'" in r for r in results), results


def _on_gpu(root: Path) -> None:
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

    torch.cuda.set_device(dist.get_rank())
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_state(device="cuda"), algo="atomic")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(_manager(root).save(tasd, iteration=2, is_async=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    manager = _manager(root)
    assert manager.find_latest() == 2
    loaded_tasd, _ = manager.load()
    assert all(t.is_cuda for t in loaded_tasd.tensors)
    _check(loaded_tasd.to_state_dict(_state(poisoned=True, device="cuda")))


@pytest.mark.gpu
@requires_gpus(2)
def test_async_save_of_cuda_tensors(tmp_path: Path) -> None:
    run_distributed(_on_gpu, 2, tmp_path, timeout=TIMEOUT_S)
