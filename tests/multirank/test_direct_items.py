"""Small ``torch_dist`` items read straight into their destinations
(:mod:`dist_checkpointing.engine.storage.direct_items`).

Once a layout is known, runs of small items are read with ``preadv`` into their
destinations, without a window. These tests check that the path is taken, that what it
loads is bit-exact (also when resharded into views of larger tensors), and that a
damaged byte anywhere gets exactly the outcome it gets from the usual path: the same
error, naming the same item, or (checksums off) the same values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.engine.storage import direct_items
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.support.harness import run_distributed
from tests.support.item_files import damage_outcomes, load_blocks_whole, load_outcome

_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn]
# Same length, other shape (and so another data.pkl): both layouts of a length are kept.
_SHAPES = [(1024,), (32, 32), (8, 128), (700,), (3, 5, 7)]


def _values(i: int) -> torch.Tensor:
    dtype, shape = _DTYPES[i % len(_DTYPES)], _SHAPES[i % len(_SHAPES)]
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 120, shape, generator=g).to(dtype)


def _state(count: int, zeros: bool) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for i in range(count):
        t = _values(i)
        sd[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", torch.zeros_like(t) if zeros else t)
        if i == count // 2:  # a bytes item among the tensors
            sd["obj"] = ShardedObject("obj", None if zeros else {"step": 7}, (1,), (0,))
    return sd


def _count_direct(monkeypatch_target: Any) -> list[int]:
    """Counts the items each direct run read (patched in the rank process)."""
    counts: list[int] = []
    original = monkeypatch_target._read_run

    def counting(file: Any, run: list[Any]) -> None:
        counts.append(len(run))
        original(file, run)

    monkeypatch_target._read_run = counting
    return counts


def _small_windows() -> None:
    """Windows of 64 KiB: the first window of a file (read the usual way, which learns the
    layouts) does not hold every item of these small files."""
    os.environ["DIST_CKPT_READ_WINDOW_BYTES"] = str(64 << 10)


def _round_trip(root: str, count: int) -> tuple[int, int]:
    _small_windows()
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dc.save(_state(count, zeros=False), root, strategy)
    counts = _count_direct(direct_items)
    direct = []
    for _ in range(2):  # the first load learns the layouts, the second reads directly
        before = sum(counts)
        loaded = dc.load(_state(count, zeros=True), root)
        for i in range(count):
            assert torch.equal(loaded[f"t{i}"].view(torch.uint8), _values(i).view(torch.uint8)), i
        assert loaded["obj"] == {"step": 7}
        direct.append(sum(counts) - before)
    return direct[0], direct[1]


def test_small_items_are_read_straight_into_their_destinations(tmp_path: Path) -> None:
    ((first, second),) = run_distributed(_round_trip, 1, str(tmp_path), 300, timeout=120.0)
    # The first load learns the layouts in its first window; the second reads all but
    # the items of that window directly.
    assert second > 250 and first < second, (first, second)


def _first_load(root: str, count: int) -> int:
    """Default windows (16 MiB, more than the file): the first load of a process reads the
    usual way only the first item of each layout (which it learns from), and the
    object; every other item directly."""
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dc.save(_state(count, zeros=False), root, strategy)
    counts = _count_direct(direct_items)
    loaded = dc.load(_state(count, zeros=True), root)
    for i in range(count):
        assert torch.equal(loaded[f"t{i}"].view(torch.uint8), _values(i).view(torch.uint8)), i
    return sum(counts)


def _first_load_same_length(root: str, count: int) -> int:
    """As _first_load, with two layouts of one length (float32 (1024,) and (32, 32)):
    the first item of the second is read alone too, not with a whole window."""
    shapes = [(1024,), (32, 32)]
    values = {f"s{i}": torch.full(shapes[i % 2], float(i)) for i in range(count)}
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dc.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in values.items()}, root, strategy)
    counts = _count_direct(direct_items)
    request = {
        k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in values.items()
    }
    loaded = dc.load(request, root)
    assert all(torch.equal(loaded[k], v) for k, v in values.items())
    return sum(counts)


def test_two_layouts_of_one_length_are_both_learnt_from_one_item(tmp_path: Path) -> None:
    (direct,) = run_distributed(_first_load_same_length, 1, str(tmp_path), 200, timeout=120.0)
    assert direct == 200 - 2, direct


def test_the_first_load_learns_the_layouts_in_a_small_window(tmp_path: Path) -> None:
    # 600 items of 0.1-8 KiB (five layouts): about 2.5 MiB in one file.
    (direct,) = run_distributed(_first_load, 1, str(tmp_path), 600, timeout=120.0)
    assert direct == 600 - 5, direct


def _shared_destination(root: str) -> bool:
    """Keys 'a' and 'b' saved with different values, loaded into one tensor (as a model
    with tied weights may request them), after a load that learnt the layouts."""
    a, b = torch.arange(1024.0), -torch.arange(1024.0)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    sd = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in (("a", a), ("b", b))}
    dc.save(sd, root, strategy)
    counts = _count_direct(direct_items)
    dc.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(1024)) for k in "ab"}, root)
    shared = torch.zeros(1024)
    dc.load({k: ShardedTensor.from_rank_offsets(k, shared) for k in "ab"}, root)
    return sum(counts) > 0 and (torch.equal(shared, a) or torch.equal(shared, b))


def test_one_destination_requested_under_two_keys_loads(tmp_path: Path) -> None:
    assert run_distributed(_shared_destination, 1, str(tmp_path), timeout=120.0) == [True]


def _reshard(root: str, split_dim: int) -> int:
    """Row blocks are contiguous views of the destination (direct), columns are not."""
    _small_windows()
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    counts = _count_direct(direct_items)
    return load_blocks_whole(
        root, split_dim, 40, lambda sd, path: dc.save(sd, path, strategy), counts
    )


@pytest.mark.parametrize("split_dim", [0, 1], ids=["rows", "columns"])
def test_resharded_loads_are_bit_exact(tmp_path: Path, split_dim: int) -> None:
    direct = run_distributed(_reshard, 2, str(tmp_path), split_dim, timeout=120.0)
    if split_dim == 0:  # rows: contiguous views, read directly
        assert min(direct) > 20, direct
    else:  # columns: strided views, read the usual way
        assert direct == [0, 0]


def _outcome(root: str, count: int, verify: bool) -> str:
    return load_outcome(_state(count, zeros=True), root, verify)


def _damage(root: str, count: int) -> tuple[dict[str, tuple[str, str]], int, int]:
    """For bytes across the data file: the outcome of a load with and without the direct
    path, with checksums verified and not."""
    _small_windows()
    saved = Path(root) / "saved"
    saved.mkdir()
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dc.save(_state(count, zeros=False), saved, strategy)
    assert _outcome(str(saved), count, True).startswith("loaded")  # layouts now known
    counts = _count_direct(direct_items)
    results, plain_counts = damage_outcomes(
        saved, Path(root), 23, lambda path, verify: _outcome(path, count, verify), counts
    )
    return results, sum(counts), plain_counts


def test_a_damaged_byte_has_the_outcome_of_the_usual_path(tmp_path: Path) -> None:
    ((results, direct, plain_direct),) = run_distributed(
        _damage, 1, str(tmp_path), 60, timeout=300.0
    )
    assert direct > 1000 and plain_direct == 0, (direct, plain_direct)
    for where, (direct, plain) in results.items():
        assert direct == plain, (where, direct, plain)
        if "verify=True" in where:
            assert direct.startswith("ChecksumMismatchError"), (where, direct)
