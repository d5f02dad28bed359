"""CheckpointManager on real gloo groups: step directories, the ``latest`` pointer moved
only after a commit on every rank, retention, interrupted checkpoints, async saves."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_checkpointing import CheckpointManager, ShardedTensor
from dist_checkpointing.errors import CheckpointNotFoundError, InvalidArgumentError
from dist_checkpointing.manager import LATEST_FNAME
from tests.support.harness import run_distributed

pytestmark = pytest.mark.timeout(180)


def _state(step: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) + step
    rows = 8 // world
    local = full[rank * rows : (rank + 1) * rows].clone()
    return {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world)), "step": step}


def _empty() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    local = torch.zeros(8 // world, 4)
    return {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world))}


def _sync_run(root: str) -> dict[str, Any]:
    manager = CheckpointManager(root, keep_last=2, keep_every=3)
    assert manager.latest() is None
    for step in range(1, 8):
        manager.save(_state(step), step)
        assert manager.latest() == step
        assert manager.read_pointer() == step
    steps = manager.steps()
    loaded = manager.load(_empty())
    assert isinstance(loaded, dict)
    expected = _state(7)["w"].data
    return {"steps": steps, "ok": torch.equal(loaded["w"], expected), "step": loaded["step"]}


def test_sync_saves_pointer_and_retention(tmp_path: Path) -> None:
    results = run_distributed(_sync_run, 2, str(tmp_path), timeout=120)
    for r in results:
        assert r == {"steps": [3, 6, 7], "ok": True, "step": 7}
    assert sorted(os.listdir(tmp_path)) == [
        "iter_0000003",
        "iter_0000006",
        "iter_0000007",
        LATEST_FNAME,
    ]
    assert (tmp_path / LATEST_FNAME).read_text().strip() == "7"


def _async_run(root: str) -> dict[str, Any]:
    manager = CheckpointManager(root, keep_last=1, async_save=True)
    manager.save(_state(1), 1)
    manager.maybe_finalize(blocking=True)
    manager.save(_state(2), 2)
    # Not finalized yet: the pointer and the listing still say 1, and step 1 is not deleted.
    before = (manager.read_pointer(), manager.steps(), os.path.isdir(manager.path(1)))
    manager.maybe_finalize(blocking=True)
    after = (manager.read_pointer(), manager.steps(), os.path.isdir(manager.path(1)))
    manager.close()
    return {"before": before, "after": after}


def test_async_pointer_moves_only_after_finalize(tmp_path: Path) -> None:
    results = run_distributed(_async_run, 2, str(tmp_path), timeout=150)
    for r in results:
        assert r["before"] == (1, [1], True)
        assert r["after"] == (2, [2], False)


def test_interrupted_checkpoint_is_skipped_with_a_warning(tmp_path: Path) -> None:
    run_distributed(_sync_run, 1, str(tmp_path), timeout=120)
    broken = tmp_path / "iter_0000009"
    broken.mkdir()
    (broken / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / LATEST_FNAME).write_text("9\n")  # a pointer written too early
    manager = CheckpointManager(tmp_path)
    with pytest.warns(UserWarning, match="incomplete checkpoint"):
        assert manager.steps() == [3, 6, 7]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert manager.latest() == 7


def test_retention_spares_loading_and_in_flight(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=1)
    for step in (1, 2, 3):
        manager.path(step).mkdir()
        (manager.path(step) / "metadata.json").write_text("{}")
    assert manager.to_delete(3) == [1, 2]
    manager._loading.add(1)
    manager._in_flight.add(2)
    assert manager.to_delete(3) == []
    manager._loading.clear()
    manager._in_flight.clear()
    # Retention never touches a checkpoint newer than the one just committed.
    assert manager.to_delete(2) == [1]


def test_failed_save_does_not_move_the_pointer(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    good = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}
    manager.save(good, 1)
    bad = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, 0, 2))}  # half missing
    with pytest.raises(Exception, match="w"):
        manager.save(bad, 2)
    assert manager.read_pointer() == 1
    with pytest.warns(UserWarning, match="incomplete"):
        assert manager.latest() == 1


def test_arguments_and_empty_root(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError):
        CheckpointManager(tmp_path, keep_last=0)
    manager = CheckpointManager(tmp_path / "new")
    assert manager.steps() == [] and manager.latest() is None
    assert manager.path(100).name == "iter_0000100"
    with pytest.raises(CheckpointNotFoundError):
        manager.load({})
