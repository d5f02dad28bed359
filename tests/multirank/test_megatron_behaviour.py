"""Behaviour Megatron-Core users rely on, each found by running Megatron-style code.

- factories inside lists merge back position by position;
- ``allow_shape_mismatch``: what the checkpoint does not cover comes back as zeros in a
  tensor the loader allocates (a tensor the caller passed keeps its values there);
- ShardedObjects holding ``io.BytesIO`` load under safe loading;
- key mismatch errors and the common-state warning keep Megatron-Core's wording;
- ``FileSystemWriterAsync.write_preloaded_data`` is the hook the writers call, and
  a failure in it is a ``RuntimeError`` containing "Worker failure" on every rank;
- ``separation_hint`` names files as Megatron-Core does, so ``remove_sharded_tensors``
  deletes whole files.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedObject, ShardedTensor, ShardedTensorFactory, StrictHandling
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.support.harness import run_distributed, world_sizes
from tests.support.log_capture import WarningRecords

TIMEOUT_S = 90.0


def _whole(key: str, t: torch.Tensor, **kwargs: Any) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, t, **kwargs)


# ----------------------------------------------------------------------------- factories


def _split_build(
    key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any
) -> dict[str, ShardedTensor]:
    return {
        "head": _whole(f"{key}.head", t[:2].clone(), replica_id=replica_id),
        "tail": _whole(f"{key}.tail", t[2:].clone(), replica_id=replica_id),
    }


def _split_merge(loaded: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([loaded["head"], loaded["tail"]])


def _factory_in_list(ckpt: str) -> list[torch.Tensor]:
    rank = dist.get_rank() if dist.is_initialized() else 0

    def state(t: torch.Tensor, u: torch.Tensor) -> dict[str, Any]:
        return {
            "layers": [
                ShardedTensorFactory("f", t, _split_build, _split_merge, replica_id=rank),
                _whole("plain", u, replica_id=rank),
            ]
        }

    dcp.save(state(torch.arange(5.0), torch.ones(3)), ckpt)
    loaded = dcp.load(state(torch.zeros(5), torch.zeros(3)), ckpt)
    assert isinstance(loaded, dict)
    return list(loaded["layers"])


@world_sizes(1, 2)
def test_factories_in_a_list_merge_back_by_position(tmp_path: Path, world_size: int) -> None:
    for layers in run_distributed(_factory_in_list, world_size, str(tmp_path), timeout=TIMEOUT_S):
        assert len(layers) == 2
        assert torch.equal(layers[0], torch.arange(5.0))
        assert torch.equal(layers[1], torch.ones(3))


# ----------------------------------------------------------------------------- shape mismatch


def _load_padded(ckpt: str) -> dict[str, torch.Tensor]:
    """Save a (4, 3) tensor split by rows, load (6, 3) padded requests three ways."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(12.0).reshape(4, 3)
    rows = 4 // world
    part = full[rank * rows : (rank + 1) * rows].clone()
    dcp.save({"emb": ShardedTensor.from_rank_offsets("emb", part, (0, rank, world))}, ckpt)
    out: dict[str, torch.Tensor] = {}
    # No data: allocated by the loader.
    kw: dict[str, Any] = {"allow_shape_mismatch": True, "replica_id": rank}
    meta = _whole("emb", torch.empty(6, 3), **kw).without_data()
    out["allocated"] = dcp.load({"emb": meta}, ckpt)["emb"]  # type: ignore[index]
    # The caller's tensor, full of garbage.
    mine = _whole("emb", torch.full((6, 3), 9.9e13), **kw)
    out["given"] = dcp.load({"emb": mine}, ckpt)["emb"]  # type: ignore[index]
    # A non-contiguous destination (read through a staging buffer).
    base = torch.full((3, 6), -4.2e30)
    view = _whole("emb", base.t(), **kw)
    out["strided"] = dcp.load({"emb": view}, ckpt)["emb"].contiguous()  # type: ignore[index]
    return out


@world_sizes(1, 2)
def test_allow_shape_mismatch_never_returns_uninitialized_memory(
    tmp_path: Path, world_size: int
) -> None:
    stored = torch.arange(12.0).reshape(4, 3)
    padding = {"allocated": 0.0, "given": 9.9e13, "strided": -4.2e30}
    for results in run_distributed(_load_padded, world_size, str(tmp_path), timeout=TIMEOUT_S):
        for how, tensor in results.items():
            assert torch.equal(tensor[:4], stored), (how, tensor)
            assert torch.equal(tensor[4:], torch.full((2, 3), padding[how])), (how, tensor)


# ----------------------------------------------------------------------------- BytesIO objects


def _bytesio_objects(ckpt: str) -> tuple[bytes, int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    payload = io.BytesIO(f"rank {rank} \x00 state".encode())
    payload.seek(3)
    sd = {"rng": ShardedObject("rng", payload, (world,), (rank,))}
    dcp.save(sd, ckpt)
    out = dcp.load({"rng": ShardedObject("rng", None, (world,), (rank,))}, ckpt)
    loaded = out["rng"]  # type: ignore[index]
    assert isinstance(loaded, io.BytesIO)
    return loaded.getvalue(), loaded.tell()


def test_sharded_objects_holding_bytesio_load_safely(tmp_path: Path) -> None:
    results = run_distributed(_bytesio_objects, 2, str(tmp_path), timeout=TIMEOUT_S)
    for rank, (value, position) in enumerate(results):
        assert value == f"rank {rank} \x00 state".encode()
        assert position == 3


# ----------------------------------------------------------------------------- wording


def _mismatched_keys(ckpt: str) -> str:
    dcp.save({"a": _whole("a", torch.ones(2), replica_id=dist.get_rank())}, ckpt)
    request = {"b": _whole("b", torch.zeros(2), replica_id=dist.get_rank())}
    try:
        dcp.load(request, ckpt, strict=StrictHandling.RAISE_ALL)
    except Exception as e:  # noqa: BLE001 - returned for inspection
        return str(e)
    return ""


def test_key_mismatch_error_keeps_megatron_wording(tmp_path: Path) -> None:
    for message in run_distributed(_mismatched_keys, 2, str(tmp_path), timeout=TIMEOUT_S):
        assert "Missing keys (for all ranks): ['a']" in message
        assert "Unexpected keys (for this rank): ['b']" in message
        assert "strict" in message  # and says what to do


def _common_state_differs(ckpt: str) -> list[str]:
    handler = WarningRecords()
    logging.getLogger("dist_checkpointing").addHandler(handler)
    rank = dist.get_rank()
    sd = {"w": _whole("w", torch.ones(2), replica_id=rank), "step": 10 + rank}
    dcp.save(sd, ckpt)
    return handler.messages


def test_common_state_difference_warning_keeps_megatron_wording(tmp_path: Path) -> None:
    results = run_distributed(_common_state_differs, 2, str(tmp_path), timeout=TIMEOUT_S)
    warnings = [m for m in results[0] if "common state dict" in m]
    assert len(warnings) == 1, results[0]
    assert warnings[0].startswith(
        "There is difference in the common state dict in different ranks. The differences are "
    )
    assert "'step'" in warnings[0] and "rank 0's common state is the one saved" in warnings[0]
    assert not [m for m in results[1] if "common state dict" in m]  # only the first rank warns


# ----------------------------------------------------------------------------- writer hook


def _faulty_write(bucket: Any, fs: Any, sync_files: bool) -> Any:
    """Module level, so a spawned persistent worker can import it by name."""
    raise OSError(28, f"injected: no space left while writing {bucket.relative_path}")


def _save_with_faulty_writer(ckpt: str, mode: str) -> tuple[str, bool, str]:
    rank = dist.get_rank()
    FileSystemWriterAsync.write_preloaded_data = _faulty_write  # type: ignore[method-assign,assignment]
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), (0, rank, 2))}
    try:
        if mode == "sync":
            dcp.save(sd, ckpt)
        else:
            queue = AsyncCallsQueue(persistent=mode == "persistent")
            try:
                request = dcp.save(sd, ckpt, async_sharded_save=True)
                assert request is not None
                queue.schedule_async_request(request)
                queue.maybe_finalize_async_calls(blocking=True)
            finally:
                queue.close()
    except Exception as e:  # noqa: BLE001 - returned for inspection
        return type(e).__name__, isinstance(e, RuntimeError), str(e)
    return "ok", False, ""


@pytest.mark.parametrize("mode", ["sync", "temporal", "persistent"])
def test_patched_write_preloaded_data_fails_every_rank_with_worker_failure(
    tmp_path: Path, mode: str
) -> None:
    results = run_distributed(_save_with_faulty_writer, 2, str(tmp_path), mode, timeout=TIMEOUT_S)
    for rank, (name, is_runtime_error, message) in enumerate(results):
        assert name != "ok", rank
        assert is_runtime_error, (rank, name)
        assert "Worker failure" in message, (rank, message)
        assert "injected: no space left" in message, (rank, message)
    assert not (tmp_path / "metadata.json").exists()  # nothing committed


# ----------------------------------------------------------------------------- separation hint


def _save_with_hint(ckpt: str) -> None:
    rank = dist.get_rank()
    sd = {
        f"{prefix}{name}": ShardedTensor.from_rank_offsets(
            f"{prefix}{name}", torch.full((4, 3), float(rank + i)), (0, rank, 2)
        )
        for i, (prefix, name) in enumerate(
            [("model.", "w"), ("model.", "b"), ("optimizer.", "exp_avg.w"), ("optimizer.", "m")]
        )
    }
    strategy = TorchDistSaveShardedStrategy(thread_count=2, separation_hint="optimizer.")
    dcp.save(sd, ckpt, sharded_strategy=strategy, verify_integrity=True)


def _load_model_only(ckpt: str) -> bool:
    rank = dist.get_rank()
    request = {
        name: ShardedTensor.from_rank_offsets(name, torch.zeros(4, 3), (0, rank, 2))
        for name in ("model.w", "model.b")
    }
    loaded = dcp.load(request, ckpt, verify_integrity=True)
    return torch.equal(loaded["model.w"], torch.full((4, 3), float(rank)))  # type: ignore[index]


def test_separation_hint_names_files_and_remove_deletes_them_whole(tmp_path: Path) -> None:
    run_distributed(_save_with_hint, 2, str(tmp_path), timeout=TIMEOUT_S)
    data_files = sorted(p.name for p in tmp_path.glob("*.distcp"))
    hinted = [n for n in data_files if n.startswith("optimizer.")]
    assert hinted and all(n.startswith("optimizer.__") for n in hinted), data_files
    manifest = json.loads((tmp_path / "integrity.json").read_text())["files"]
    assert set(data_files) <= set(manifest)  # hinted files are digested too
    dcp.remove_sharded_tensors(str(tmp_path), "optimizer.")
    left = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert left == [n for n in data_files if not n.startswith("optimizer.")]
    assert set(dcp.load_tensors_metadata(str(tmp_path))) == {"model.w", "model.b"}
    assert run_distributed(_load_model_only, 2, str(tmp_path), timeout=TIMEOUT_S) == [True, True]
