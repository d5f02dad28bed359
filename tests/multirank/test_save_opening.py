"""A save's opening vote: the sharding check, the common-state comparison, the start of
the commit protocol and the coordinator's write of ``common.pt`` share one all-reduce.

Counts the collectives ``torch.distributed`` really runs (every call still goes through
to gloo) while a save plans: a save whose structure every rank keeps costs one
all-reduce before it returns its request (``raw_bytes``), two with the planning of
``torch_dist`` (its cached-plan vote). The common states are gathered only where they
differ; a coordinator that fails its first write fails the save on every rank and
leaves the directory as it found it.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.common import TorchCommonSaveStrategy
from tests.support.harness import run_distributed, world_sizes
from tests.support.log_capture import WarningRecords

TIMEOUT_S = 120.0
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "gather_object",
    "broadcast",
    "broadcast_object_list",
    "scatter_object_list",
    "all_to_all_single",
    "barrier",
)


@contextmanager
def _counted() -> Iterator[collections.Counter[str]]:
    """Count the calls of ``torch.distributed``'s collectives (each still runs)."""
    counts: collections.Counter[str] = collections.Counter()
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return saved[name](*args, **kwargs)

        return call

    for name in _COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _state(rank: int, step: int, extra: bool = False) -> dict[str, Any]:
    sd: dict[str, Any] = {
        f"w{i}": ShardedTensor.from_rank_offsets(
            f"w{i}",
            torch.full((4, 3), float(step * 10 + i + rank)),
            (0, rank, dist.get_world_size()),
        )
        for i in range(3)
    }
    if extra:  # a key only this rank's state has (a changed structure)
        sd["extra"] = ShardedTensor.from_rank_offsets(f"extra{rank}", torch.full((2,), float(step)))
    sd["iteration"] = 7
    return sd


def _cached_strategy(backend: str) -> Any:
    strategy = dcp.get_default_save_sharded_strategy(backend, 1)
    return type(strategy)(backend, 1, cached_metadata=True)


def _fresh_dir(root: str, name: str) -> str:
    """``root/name``, made by rank 0, seen by every rank."""
    path = os.path.join(root, name)
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    return path


def _plan_counts(root: str, backend: str) -> list[dict[str, int]]:
    """The collectives each of three saves makes before it returns its request."""
    rank = dist.get_rank()
    strategy = _cached_strategy(backend)
    counts = []
    for step in range(3):
        path = _fresh_dir(root, f"step{step}")
        with _counted() as counted:
            request = dcp.save(
                _state(rank, step), path, sharded_strategy=strategy, async_sharded_save=True
            )
        assert request is not None
        request.execute_sync()
        loaded = dcp.load(_state(rank, 0), path)
        for i in range(3):
            assert torch.equal(loaded[f"w{i}"], torch.full((4, 3), float(step * 10 + i + rank)))
        counts.append(dict(counted))
    return counts


@pytest.mark.parametrize(("backend", "votes"), [("raw_bytes", 1), ("torch_dist", 2)])
def test_a_save_of_an_unchanged_structure_plans_with_its_votes_alone(
    tmp_path: Path, backend: str, votes: int
) -> None:
    for counts in run_distributed(_plan_counts, 2, str(tmp_path), backend, timeout=TIMEOUT_S):
        first, *later = counts
        assert first.get("all_to_all_single", 0) >= 1  # the first save checks the sharding
        for count in later:
            assert count == {"all_reduce": votes}, counts


def _common_gathers(root: str) -> list[tuple[int, int]]:
    """(gathers, warnings) of the planning of a save whose common states agree, then of
    one whose common states differ (``raw_bytes``: its plan gathers nothing else)."""
    rank = dist.get_rank()
    handler = WarningRecords()
    logging.getLogger("dist_checkpointing").addHandler(handler)
    out = []
    for n, step in enumerate((5, 5 + rank)):  # the second: a step per rank
        path = _fresh_dir(root, f"s{n}")
        sd = _state(rank, 1)
        sd["iteration"] = step
        before = len(handler.messages)
        with _counted() as counted:
            request = dcp.save(sd, path, sharded_strategy=("raw_bytes", 1), async_sharded_save=True)
        assert request is not None
        request.execute_sync()
        out.append((counted["gather_object"], len(handler.messages) - before))
    return out


def test_common_states_are_gathered_only_where_their_digests_differ(tmp_path: Path) -> None:
    first, second = run_distributed(_common_gathers, 2, str(tmp_path), timeout=TIMEOUT_S)
    assert first[0] == (0, 0) and second[0] == (0, 0)  # equal: no gather, no warning
    assert first[1] == (1, 1)  # differing: gathered to the first rank, which warns
    assert second[1] == (1, 0)


def _failing_first_write(root: str) -> tuple[str, str, list[str], bool]:
    rank = dist.get_rank()
    original = TorchCommonSaveStrategy.save_common

    def refuse(self: Any, common: Any, checkpoint_dir: Any) -> None:
        original(self, common, checkpoint_dir)  # staged: common.pt.<tag>.pending
        raise OSError(28, "injected: no space left after writing common.pt")

    TorchCommonSaveStrategy.save_common = refuse  # type: ignore[method-assign]
    try:
        dcp.save(_state(rank, 1), root)
        kind, message = "saved", ""
    except Exception as exc:  # noqa: BLE001 - returned for inspection
        kind, message = type(exc).__name__, str(exc)
    finally:
        TorchCommonSaveStrategy.save_common = original  # type: ignore[method-assign]
    dist.barrier()
    left = sorted(os.listdir(root))
    dist.barrier()
    dcp.save(_state(rank, 2), root)  # the lock was released: the next save works
    loaded = dcp.load(_state(rank, 0), root)
    ok = all(
        torch.equal(loaded[f"w{i}"], torch.full((4, 3), float(20 + i + rank))) for i in range(3)
    )
    return kind, message, left, ok


@world_sizes(2, 3)
def test_a_coordinator_failing_its_first_write_fails_every_rank_and_leaves_nothing(
    tmp_path: Path, world_size: int
) -> None:
    results = run_distributed(_failing_first_write, world_size, str(tmp_path), timeout=TIMEOUT_S)
    kind, message, left, ok = results[0]
    assert kind == "OSError" and "injected" in message and left == [] and ok
    for kind, message, left, ok in results[1:]:
        assert kind == "RankFailureError" and "rank 0" in message and "injected" in message
        assert left == [] and ok


def _one_rank_changes(root: str) -> list[bool]:
    """Three cached torch_dist saves; at the third only rank 1's structure changes, so
    rank 0 prepared its data with the cached plan before the vote, then again."""
    rank = dist.get_rank()
    strategy = _cached_strategy("torch_dist")
    out = []
    for step in range(3):
        path = _fresh_dir(root, f"step{step}")
        changed = step == 2 and rank == 1
        dcp.save(_state(rank, step, extra=changed), path, sharded_strategy=strategy)
        loaded = dcp.load(_state(rank, 0, extra=changed), path)
        good = all(
            torch.equal(loaded[f"w{i}"], torch.full((4, 3), float(step * 10 + i + rank)))
            for i in range(3)
        )
        if changed:
            good = good and torch.equal(loaded["extra"], torch.full((2,), float(step)))
        out.append(good)
    return out


def test_a_rank_that_prepared_with_the_cached_plan_prepares_again_when_another_changed(
    tmp_path: Path,
) -> None:
    for result in run_distributed(_one_rank_changes, 2, str(tmp_path), timeout=TIMEOUT_S):
        assert result == [True, True, True]


def _raw_results_lost(root: str) -> tuple[str, str, list[str]]:
    """A raw_bytes save whose rank 1 loses its write results at finalize."""
    from dist_checkpointing.engine.raw import save as raw_save
    from dist_checkpointing.errors import CheckpointWriteError

    rank = dist.get_rank()
    original = raw_save._outcome

    def lost(results: Any, names: list[str], r: int) -> Any:
        original(results, names, r)
        raise CheckpointWriteError(f"rank {r}: injected: the write results were lost")

    if rank == 1:
        raw_save._outcome = lost  # type: ignore[assignment]
    try:
        dcp.save(_state(rank, 1), root, sharded_strategy=("raw_bytes", 1))
        kind, message = "saved", ""
    except Exception as exc:  # noqa: BLE001 - returned for inspection
        kind, message = type(exc).__name__, str(exc)
    finally:
        raw_save._outcome = original  # type: ignore[assignment]
    dist.barrier()
    return kind, message, sorted(os.listdir(root))


def test_a_rank_losing_its_write_results_fails_the_raw_save_everywhere(tmp_path: Path) -> None:
    """The writes' and the index's verdicts are one all-reduce: the coordinator writes
    no index without every rank's piece, and every rank raises naming rank 1."""
    for kind, message, left in run_distributed(
        _raw_results_lost, 2, str(tmp_path), timeout=TIMEOUT_S
    ):
        assert kind == "CheckpointWriteError" and "injected" in message and "1" in message
        assert "commit.json" not in left and "metadata.json" not in left
        assert not any(name.startswith(".raw_index") for name in left), left
