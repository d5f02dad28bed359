"""CUDA state through every layout and caller (tests marked ``gpu``, skipped without CUDA).

Gloo ranks place their tensors on ``cuda:(rank % device_count)``, so two ranks may share
one GPU. Every loaded value is compared bit for bit with the full tensor built
independently on the CPU (``reference_tensor``), under another sharding than the save's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from tests.support.harness import run_distributed
from tests.support.layouts import reference_tensor

pytestmark = pytest.mark.gpu

TIMEOUT_S = 180.0
# Shapes divisible by 2 on both axes; one bf16 tensor, one of several MiB (staged in pieces).
SHAPES = {"emb": ((64, 48), torch.float32), "w": ((1024, 1536), torch.float32)}
SHAPES["b"] = ((40, 2), torch.bfloat16)
LAYOUTS = ["torch_dist", "raw_bytes"]


def _device() -> torch.device:
    return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())


def _rows(full: torch.Tensor, axis: int) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    return full.chunk(world, dim=axis)[rank]


def _state(axis: int, fill: float | None = None, step: int = 0) -> dict[str, ShardedTensor]:
    """Each tensor split over the ranks on ``axis``, on this rank's GPU."""
    out = {}
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, (shape, dtype) in SHAPES.items():
        local = (_rows(reference_tensor(name, shape, dtype), axis) + step).to(_device())
        if fill is not None:
            local = torch.full_like(local, fill)
        out[name] = ShardedTensor.from_rank_offsets(name, local.contiguous(), (axis, rank, world))
    return out


def _mismatches(loaded: dict[str, Any], axis: int, step: int = 0) -> list[str]:
    bad = []
    for name, (shape, dtype) in SHAPES.items():
        got = loaded[name]
        want = _rows(reference_tensor(name, shape, dtype), axis) + step
        if got.device != _device() or not torch.equal(got.cpu(), want):
            bad.append(name)
    return bad


def _save_then_load_resharded(ckpt: str, layout: str) -> list[str]:
    strategy = dc.get_default_save_sharded_strategy(layout, 1)
    dc.save(_state(axis=0), ckpt, strategy)
    return _mismatches(dc.load(_state(axis=1, fill=float("nan")), ckpt), axis=1)


def _save_with_small_staging_buffers(ckpt: str, layout: str) -> None:
    """Save under staging buffers of 1 MiB (2 at most): the 3 MiB item of each rank goes
    out, and comes back into a CUDA target, in several chunks."""
    os.environ["DIST_CKPT_STAGING_BUFFER_BYTES"] = str(1 << 20)
    os.environ["DIST_CKPT_COPY_AHEAD_BYTES"] = str(2 << 20)
    dc.save(_state(axis=0), ckpt, dc.get_default_save_sharded_strategy(layout, 1))


def _save_then_load_in_pieces(ckpt: str, layout: str) -> list[str]:
    """The same layout (whole stored items into CUDA targets), through staging buffers
    smaller than an item."""
    _save_with_small_staging_buffers(ckpt, layout)
    return _mismatches(dc.load(_state(axis=0, fill=float("nan")), ckpt), axis=0)


@pytest.mark.parametrize(
    "round_trip",
    [_save_then_load_resharded, _save_then_load_in_pieces],
    ids=["resharded", "in_staging_pieces"],
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_state_round_trips_into_cuda_targets(
    tmp_path: Path, layout: str, round_trip: Callable[[str, str], list[str]]
) -> None:
    assert run_distributed(round_trip, 2, str(tmp_path), layout, timeout=TIMEOUT_S) == [[], []]


def _load_after_work_on_a_side_stream(ckpt: str, layout: str) -> list[str]:
    """The caller's current stream has pending work on the targets (a long kernel, then a
    fill) when it loads, reading two files at once: every copy to the device, made in the
    reading threads, must come after that work, as it would in the caller's thread."""
    os.environ["DIST_CKPT_READ_THREADS"] = "2"
    dc.save(_state(axis=0), ckpt, dc.get_default_save_sharded_strategy(layout, 1))
    request = _state(axis=0, fill=0.0)
    side = torch.cuda.Stream(_device())
    side.wait_stream(torch.cuda.current_stream(_device()))
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of pending work on the caller's stream
        for sh in request.values():
            assert sh.data is not None
            sh.data.fill_(float("nan"))
        loaded = dc.load(request, ckpt)
    side.synchronize()
    return _mismatches(loaded, axis=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_load_follows_the_callers_stream(tmp_path: Path, layout: str) -> None:
    result = run_distributed(
        _load_after_work_on_a_side_stream, 2, str(tmp_path), layout, timeout=TIMEOUT_S
    )
    assert result == [[], []]


def _damaged_then_load_in_pieces(ckpt: str, layout: str) -> str:
    """A byte flipped in the middle of the largest data file: the load into CUDA
    targets, chunk by chunk through the staging buffers, must refuse it."""
    _save_with_small_staging_buffers(ckpt, layout)
    if dist.get_rank() == 0:
        data = max(Path(ckpt).glob("__*"), key=lambda p: p.stat().st_size)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    dist.barrier()
    try:
        dc.load(_state(axis=0, fill=0.0), ckpt)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_damage_is_found_in_a_load_through_staging_buffers(tmp_path: Path, layout: str) -> None:
    results = run_distributed(
        _damaged_then_load_in_pieces, 2, str(tmp_path), layout, timeout=TIMEOUT_S
    )
    # The rank that read the damaged item names it and the file; the other one is told.
    assert any("checksum mismatch" in r and "'w'" in r and "__" in r for r in results), results
    assert all(r != "loaded" for r in results), results


def _async_then_change(root: str, layout: str, persistent: bool) -> list[list[str]]:
    strategy = dc.get_default_save_sharded_strategy(layout, 1)
    queue = AsyncCallsQueue(persistent=persistent)
    state = _state(axis=0)
    try:
        for step in range(2):
            ckpt = f"{root}/step{step}"
            if dist.get_rank() == 0:
                Path(ckpt).mkdir()
            dist.barrier()
            request = dc.save(state, ckpt, strategy, async_sharded_save=True)
            assert isinstance(request, AsyncRequest)
            queue.schedule_async_request(request)
            for sh in state.values():  # the next step, at once, on the default stream
                sh.data.add_(1)
            queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    return [
        _mismatches(dc.load(_state(axis=1, fill=0.0), f"{root}/step{s}"), axis=1, step=s)
        for s in range(2)
    ]


@pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_async_saves_of_cuda_state_hold_the_values_at_save_time(
    tmp_path: Path, layout: str, persistent: bool
) -> None:
    results = run_distributed(
        _async_then_change, 2, str(tmp_path), layout, persistent, timeout=TIMEOUT_S
    )
    assert results == [[[], []], [[], []]]


def _replicated(fill: float | None) -> dict[str, ShardedTensor]:
    out = {}
    for name, (shape, dtype) in SHAPES.items():
        full = reference_tensor(name, shape, dtype).to(_device())
        if fill is not None:
            full = torch.full_like(full, fill)
        out[name] = ShardedTensor.from_rank_offsets(name, full, replica_id=dist.get_rank())
    return out


def _fully_parallel(ckpt: str) -> list[str]:
    save = FullyParallelSaveStrategyWrapper(dc.get_default_save_sharded_strategy())
    dc.save(_replicated(None), ckpt, save)
    load = FullyParallelLoadStrategyWrapper(dc.get_default_load_sharded_strategy(ckpt))
    loaded = dc.load(_replicated(float("nan")), ckpt, load)
    return [
        name
        for name, (shape, dtype) in SHAPES.items()
        if loaded[name].device != _device()
        or not torch.equal(loaded[name].cpu(), reference_tensor(name, shape, dtype))
    ]


def test_fully_parallel_exchanges_cuda_shards_bit_exactly(tmp_path: Path) -> None:
    assert run_distributed(_fully_parallel, 2, str(tmp_path), timeout=TIMEOUT_S) == [[], []]
