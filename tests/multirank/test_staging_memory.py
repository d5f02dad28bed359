"""Host memory of saves: the persistent caller reuses one snapshot segment from save to
save (its worker maps it once), every checkpoint holds the state at save time; on a GPU,
synchronous saves stream device tensors through the bounded staging pool and async saves
stage into pinned segments (tests marked ``gpu``, skipped without CUDA)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.storage import staging_pool
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from tests.support.harness import run_distributed

MIB = 1 << 20


def _state(rank: int, step: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return {
        "w": torch.randn(256, 1024, generator=gen).to(device),  # 1 MiB
        "b": torch.randn(1000, generator=gen).to(torch.bfloat16).to(device),
        "view": torch.randn(64, 64, generator=gen).to(device)[8:40],  # a view
    }


def _sharded(local: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    return {k: ShardedTensor.from_rank_offsets(k, t, (0, rank, world)) for k, t in local.items()}


def _mismatches(ckpt: Path, expected: dict[str, torch.Tensor], device: str = "cpu") -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    request = {k: torch.empty_like(t, device=device) for k, t in expected.items()}
    loaded = dc.load(_sharded(request, rank, world), ckpt)
    return [k for k, t in expected.items() if not torch.equal(loaded[k].cpu(), t.cpu())]


def _rank_persistent_reuse(root: Path, device: str, layout: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = dc.get_default_save_sharded_strategy(layout, 1)
    queue = AsyncCallsQueue(persistent=True)
    local = _state(rank, 0, device)
    expected = []
    for step in range(3):
        ckpt = root / f"step{step}"
        if rank == 0:
            ckpt.mkdir()
        dist.barrier()
        request = dc.save(_sharded(local, rank, world), ckpt, strategy, async_sharded_save=True)
        assert isinstance(request, AsyncRequest)
        queue.schedule_async_request(request)
        expected.append({k: t.detach().cpu().clone() for k, t in local.items()})
        for t in local.values():
            t.add_(1)  # the next training step, while the save is written
        queue.maybe_finalize_async_calls(blocking=True)
    caller = queue.persistent_caller
    assert caller is not None
    arena = caller.arena
    out = {
        "stats": dict(arena.stats),
        "segments": len(arena.segments),
        "pinned": [s.pinned for s in arena.segments.values()],
        "mismatches": [_mismatches(root / f"step{s}", expected[s], device) for s in range(3)],
    }
    queue.close()
    out["after_close"] = len(arena.segments)
    return out


@pytest.mark.parametrize("layout", ["torch_dist", "raw_bytes"])
def test_the_persistent_caller_reuses_one_snapshot_segment(tmp_path: Path, layout: str) -> None:
    results = run_distributed(_rank_persistent_reuse, 2, tmp_path, "cpu", layout, timeout=180.0)
    for res in results:
        assert res["mismatches"] == [[], [], []]  # each checkpoint: the state at save time
        assert res["stats"] == {"allocated": 1, "reused": 2}
        assert res["segments"] == 1 and res["after_close"] == 0


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["torch_dist", "raw_bytes"])
def test_persistent_saves_of_cuda_state_stage_into_pinned_segments(
    tmp_path: Path, layout: str
) -> None:
    results = run_distributed(_rank_persistent_reuse, 1, tmp_path, "cuda", layout, timeout=180.0)
    res = results[0]
    assert res["mismatches"] == [[], [], []]
    assert res["stats"] == {"allocated": 1, "reused": 2} and res["pinned"] == [True]


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _rank_sync_cuda(root: Path, size_mib: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["DIST_CKPT_COPY_AHEAD_BYTES"] = str(8 * MIB)
    os.environ["DIST_CKPT_STAGING_BUFFER_BYTES"] = str(2 * MIB)
    local = {f"t{i}": torch.randn(size_mib * MIB // 4 // 8, device="cuda") for i in range(8)}
    local["view"] = torch.randn(100, 100, device="cuda")[10:20]
    before = _rss_anon()
    dc.save(_sharded(local, rank, world), root)
    growth = _rss_anon() - before
    pool = staging_pool.shared_pool()
    assert pool is not None
    return {
        "growth": growth,
        "peak_in_use": pool.stats.peak_in_use,
        "capacity": pool.capacity,
        "pinned": pool.pinned,
        "mismatches": _mismatches(root, local, "cuda"),
    }


@pytest.mark.gpu
def test_a_sync_save_of_cuda_state_stays_within_the_copy_ahead_budget(tmp_path: Path) -> None:
    (res,) = run_distributed(_rank_sync_cuda, 1, tmp_path, 256, timeout=180.0)
    assert res["mismatches"] == []
    assert res["pinned"] and res["capacity"] == 4 and res["peak_in_use"] <= 4
    # 256 MiB of device state, an 8 MiB budget: host memory grows by far less than the state.
    assert res["growth"] < 96 * MIB, f"anonymous memory grew by {res['growth'] / MIB:.0f} MiB"


@pytest.mark.gpu
def test_copy_ahead_from_cuda_is_byte_exact_through_pinned_buffers() -> None:
    pool = staging_pool.StagingPool(budget_bytes=2 * MIB, buffer_bytes=MIB)
    assert pool.pinned
    sources = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda") for n in (3 * MIB + 1, 5)
    ]
    out = [bytearray(), bytearray()]
    for chunk in staging_pool.CopyAhead(pool, sources):
        out[chunk.source] += chunk.view
    assert [bytes(o) for o in out] == [s.cpu().numpy().tobytes() for s in sources]
    buffer = pool.acquire()
    assert buffer is not None and buffer.data.is_pinned()


def _rank_worker_restart(root: Path) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    queue = AsyncCallsQueue(persistent=True)
    caller = queue.persistent_caller
    assert caller is not None
    local = _state(rank, 1)
    mismatches, pids = [], []
    for step in range(2):
        ckpt = root / f"step{step}"
        if rank == 0:
            ckpt.mkdir()
        dist.barrier()
        request = dc.save(_sharded(local, rank, world), ckpt, async_sharded_save=True)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        pids.append(caller.worker_pid)
        mismatches.append(_mismatches(ckpt, local))
        if step == 0:  # the worker dies between saves: the next one maps the segment anew
            assert caller.process is not None
            caller.process.proc.kill()
            caller.process.proc.wait()
    out = {"mismatches": mismatches, "pids": pids, "stats": dict(caller.arena.stats)}
    queue.close()
    return out


def test_a_new_worker_receives_the_reused_segment_again(tmp_path: Path) -> None:
    results = run_distributed(_rank_worker_restart, 2, tmp_path, timeout=180.0)
    for res in results:
        assert res["mismatches"] == [[], []]
        assert res["pids"][0] != res["pids"][1]
        assert res["stats"] == {"allocated": 1, "reused": 1}
