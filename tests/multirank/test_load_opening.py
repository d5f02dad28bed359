"""A load's first verdict (every rank opened the checkpoint, loaded the common state
and read its request): in the default mode it rides the sharding check's first
all-reduce, otherwise it is an all-reduce of its own; either way a failure on one rank
before it raises on every rank (its own error there, :class:`RankFailureError` naming
it and ``Loading <dir>`` elsewhere), never a hang.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from tests.multirank.test_save_opening import _counted
from tests.support.faults import BAD_INPUTS, bad_input
from tests.support.harness import run_distributed

TIMEOUT_S = 120.0


def _request(rank: int, world: int) -> dict[str, Any]:
    return {
        f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.zeros(4, 3), (0, rank, world))
        for i in range(3)
    }


def _saved(root: str, backend: str) -> Path:
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Path(root) / backend
    if rank == 0:
        ckpt.mkdir(parents=True)
    dist.barrier()
    state = {
        f"w{i}": ShardedTensor.from_rank_offsets(
            f"w{i}", torch.full((4, 3), float(10 * i + rank)), (0, rank, world)
        )
        for i in range(3)
    }
    dcp.save(state, ckpt, dcp.get_default_save_sharded_strategy(backend, 1))
    return ckpt


def _collectives_of_a_load(root: str, backend: str, strict: str) -> dict[str, int]:
    ckpt = _saved(root, backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    with _counted() as counts:
        out = dcp.load(_request(rank, world), ckpt, strict=strict)
    loaded = out[0] if isinstance(out, tuple) else out
    for i in range(3):
        assert torch.equal(loaded[f"w{i}"], torch.full((4, 3), float(10 * i + rank)))
    return dict(counts)


@pytest.mark.parametrize("backend", ["torch_dist", "raw_bytes"])
def test_the_default_load_takes_its_first_verdict_in_the_sharding_check(
    tmp_path: Path, backend: str
) -> None:
    default, compared = (
        run_distributed(_collectives_of_a_load, 2, str(tmp_path / s), backend, s, timeout=TIMEOUT_S)
        for s in ("assume_ok_unexpected", "raise_unexpected")
    )
    assert default[0] == default[1] and compared[0] == compared[1]
    # The sharding check (its vote, the all-to-all of records, the problem count) and
    # the reads' verdict: three all-reduces where the key comparison adds one of its own
    # and the verdict before it another.
    assert default[0]["all_reduce"] == 3, default
    assert compared[0]["all_reduce"] >= default[0]["all_reduce"] + 2, (default, compared)


def _rank_fails_before_the_first_collective(
    root: str, how: str, strict: str, validate: bool, preload: bool
) -> str:
    """Rank 1 gets bad input that fails before any collective of ``load``; rank 0 a
    good request. Both must raise (never wait for each other); what each raised. With
    ``preload``, the coordinator first fetches the small files for every rank (a
    collective every rank makes, whatever its input)."""
    os.environ["DIST_CKPT_LOAD_PRELOAD"] = "2" if preload else "0"
    ckpt = _saved(root, "torch_dist")
    rank, world = dist.get_rank(), dist.get_world_size()
    request: Any = _request(rank, world)
    target = ckpt
    if rank == 1:
        request, target = bad_input(how, request, "w0", ckpt, Path(root))
    try:
        dcp.load(request, target, strict=strict, validate_access_integrity=validate)
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


@pytest.mark.parametrize("preload", [False, True], ids=["", "preloaded"])
@pytest.mark.parametrize("validate", [True, False], ids=["validated", "unvalidated"])
@pytest.mark.parametrize("strict", ["assume_ok_unexpected", "raise_all"])
@pytest.mark.parametrize("how", ["list", "factory", "missing dir"])
def test_a_load_failing_on_one_rank_before_any_collective_raises_on_every_rank(
    tmp_path: Path, how: str, strict: str, validate: bool, preload: bool
) -> None:
    results = run_distributed(
        _rank_fails_before_the_first_collective,
        2,
        str(tmp_path),
        how,
        strict,
        validate,
        preload,
        timeout=TIMEOUT_S,
    )
    assert results[1] != "loaded" and results[0].startswith("RankFailureError"), results
    assert "rank 1" in results[0] and f"Loading {tmp_path}" in results[0], results
    assert BAD_INPUTS[how] in results[0] and BAD_INPUTS[how] in results[1], results
