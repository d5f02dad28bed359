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


# --------------------------------------------------- regressions found by fuzzing the manager


def _pointer_unwritable(root: str, async_save: bool) -> list[str]:
    """The pointer file cannot be written (here: a directory stands where it goes, as a
    full disk or a permission would): rank 0 alone fails to write it. Every rank must
    raise at each step, none wait in a barrier the coordinator skipped."""
    manager = CheckpointManager(root, async_save=async_save)
    if dist.get_rank() == 0:
        (Path(root) / LATEST_FNAME).mkdir()
    dist.barrier()
    seen = []
    try:
        for step in (1, 2):
            try:
                manager.save(_state(step), step)
                manager.maybe_finalize(blocking=True)
                seen.append("saved")
            except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
                seen.append(type(exc).__name__)
    finally:
        manager.close()
    return seen


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_pointer_that_cannot_be_written_raises_on_every_rank(
    tmp_path: Path, async_save: bool
) -> None:
    results = run_distributed(_pointer_unwritable, 2, str(tmp_path), async_save, timeout=90)
    assert all(len(r) == 2 and "saved" not in r for r in results), results


def _retry_after_a_failed_async_save(root: str) -> list[Any]:
    """An async save that fails in the background writer (raw_bytes cannot store
    complex32: its plan fails) must leave the step free to save again."""
    import dist_checkpointing as dcp

    manager = CheckpointManager(root, async_save=True)
    rank = dist.get_rank()
    bad = {
        "c": ShardedTensor.from_rank_offsets(
            "c", torch.zeros(2, dtype=torch.complex32), replica_id=rank
        )
    }
    strategy = dcp.get_default_save_sharded_strategy("raw_bytes", 1)
    out: list[Any] = []
    try:
        manager.save(bad, 5, sharded_strategy=strategy)
        manager.maybe_finalize(blocking=True)
        out.append("saved")
    except Exception as exc:  # noqa: BLE001 - the test checks the failure, then the retry
        out.append(type(exc).__name__)
    manager.save(_state(5), 5, sharded_strategy=strategy)
    manager.maybe_finalize(blocking=True)
    loaded = manager.load(_empty())
    assert isinstance(loaded, dict)
    out.append((manager.steps(), bool(torch.equal(loaded["w"], _state(5)["w"].data))))
    manager.close()
    return out


def test_a_failed_async_save_can_be_retried(tmp_path: Path) -> None:
    results = run_distributed(_retry_after_a_failed_async_save, 2, str(tmp_path), timeout=120)
    for r in results:
        assert r == ["CheckpointWriteError", ([5], True)], results
