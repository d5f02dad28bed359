"""Checkpoints move both ways with a live Megatron-Core, on 2 gloo ranks.

``make test`` (and ``make bench``) install two ``megatron-core`` releases (0.13.1, the
oldest we promise, and 0.16.1, the newest on PyPI; ``MCORE_VERSIONS`` in the Makefile)
without their dependencies into ``.mcore-site/<release>``, outside the virtual
environment the rest of the suite runs in; each rank here puts one on its path. Without
them (no package index) these tests skip.

Each test saves with one library in one layout and loads with the other in another:
tensor parallel blocks to whole replicas, column blocks to row blocks in the other rank
order, a ShardedObject and a common value; the loaded values are compared with the full
tensors built independently. With 0.13.1 also a distributed-optimizer flat range, saved
split one way and loaded split another (0.16 no longer accepts flattened ranges).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.support.harness import run_distributed

ROOT = Path(__file__).resolve().parents[2]
MCORE_SITE = ROOT / ".mcore-site"  # one folder per release (MCORE_VERSIONS in the Makefile)
# The oldest release we promise and the newest on PyPI; 0.13 still saves the distributed
# optimizer's flattened ranges, 0.16 no longer accepts them.
RELEASES = ("0.13.1", "0.16.1")
FLAT_UNTIL = (0, 16)

pytestmark = pytest.mark.slow

ROWS, COLS = 8, 6
FULL = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
OTHER = torch.arange(ROWS * COLS, dtype=torch.float64).mul(0.5).reshape(ROWS, COLS)
FLAT = torch.arange(ROWS * COLS, dtype=torch.float32).add(1000).reshape(ROWS, COLS)


@contextlib.contextmanager
def _stand_ins() -> Iterator[None]:
    """Megatron-Core's save calls ``torch.cuda.synchronize()`` and puts a flag tensor on
    ``torch.cuda.current_device()`` even for CPU state: without CUDA, stand in for both.
    0.13 also calls ``numpy.product``, which NumPy 2 removed (0.13 asked for NumPy 1):
    stand in with ``numpy.prod``."""
    saved = torch.cuda.synchronize, torch.cuda.current_device
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    no_product = not hasattr(np, "product")
    if no_product:
        np.product = np.prod  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved
        if no_product:
            del np.product  # type: ignore[attr-defined]


def _library(name: str, release: str) -> Any:
    if name == "megatron":
        site = str(MCORE_SITE / release)
        if site not in sys.path:
            sys.path.insert(0, site)
        return importlib.import_module("megatron.core.dist_checkpointing")
    return importlib.import_module("dist_checkpointing")


def _with_flat(release: str) -> bool:
    return tuple(int(x) for x in release.split(".")[:2]) < FLAT_UNTIL


def _flat_range(rank: int, world: int, reverse: bool) -> slice:
    """Rank ``rank``'s share of the flat elements (unequal shares), in rank order or
    reversed."""
    n = ROWS * COLS
    bounds = [i * n // world for i in range(world + 1)]
    bounds[1] = n // 3 if world == 2 else bounds[1]
    part = world - 1 - rank if reverse else rank
    return slice(bounds[part], bounds[part + 1])


def _state(lib: Any, rank: int, world: int, saving: bool, flat: bool) -> dict[str, Any]:
    """Saving: ``w`` in rows split over the ranks (tensor parallel), ``exp_avg`` in
    columns split over the ranks. Loading: every rank the whole ``w`` (a replica each) and
    ``exp_avg`` in rows, rank r taking the rows saving rank ``world - 1 - r`` held of
    ``w``; tensors empty, the object None. With ``flat``, also a distributed-optimizer
    flat range of one block, split over the ranks in rank order (saving) or reversed
    (loading)."""
    rows, cols = ROWS // world, COLS // world
    if saving:
        w = lib.ShardedTensor.from_rank_offsets(
            "w", FULL[rank * rows : (rank + 1) * rows].clone(), (0, rank, world)
        )
        avg = OTHER[:, rank * cols : (rank + 1) * cols].clone()
        exp_avg = lib.ShardedTensor.from_rank_offsets("opt.exp_avg", avg, (1, rank, world))
    else:
        w = lib.ShardedTensor.from_rank_offsets("w", torch.empty(ROWS, COLS), replica_id=rank)
        part = world - 1 - rank
        exp_avg = lib.ShardedTensor.from_rank_offsets(
            "opt.exp_avg", torch.empty(rows, COLS, dtype=OTHER.dtype), (0, part, world)
        )
    obj = lib.ShardedObject("rng", {"seed": 7} if saving else None, (1,), (0,), replica_id=rank)
    opt = {"exp_avg": exp_avg}
    if flat:
        fr = _flat_range(rank, world, reverse=not saving)
        data = FLAT.reshape(-1)[fr].clone() if saving else torch.empty(fr.stop - fr.start)
        opt["param"] = lib.ShardedTensor.from_rank_offsets_flat(
            "optimizer.fp32_param", data, (ROWS, COLS), flattened_range=fr
        )
    return {"w": w, "opt": opt, "rng": obj, "iteration": 12 if saving else None}


def _save_then_load(root: str, saver: str, loader: str, release: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = _with_flat(release)
    with _stand_ins():
        save_lib, load_lib = _library(saver, release), _library(loader, release)
        save_lib.save(_state(save_lib, rank, world, saving=True, flat=flat), root)
        loaded = load_lib.load(_state(load_lib, rank, world, saving=False, flat=flat), root)
    rows, part = ROWS // world, world - 1 - rank
    assert torch.equal(loaded["w"], FULL), f"rank {rank}: w"
    expected = OTHER[part * rows : (part + 1) * rows]
    assert torch.equal(loaded["opt"]["exp_avg"], expected), f"rank {rank}: exp_avg"
    if flat:
        fr = _flat_range(rank, world, reverse=True)
        got = loaded["opt"]["param"]
        assert torch.equal(got, FLAT.reshape(-1)[fr]), f"rank {rank}: flat range {fr}"
    assert loaded["rng"] == {"seed": 7}, loaded["rng"]
    assert loaded["iteration"] == 12, loaded["iteration"]
    return {"files": sorted(p.name for p in Path(root).iterdir())}


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize(
    ("saver", "loader"), [("ours", "megatron"), ("megatron", "ours")], ids=["to-mcore", "from"]
)
def test_a_checkpoint_moves_between_us_and_megatron_core(
    tmp_path: Path, saver: str, loader: str, release: str
) -> None:
    if not (MCORE_SITE / release / "megatron" / "core").is_dir():
        pytest.skip(f"megatron-core {release} is not in .mcore-site (make test installs it)")
    (tmp_path / "ckpt").mkdir()
    results = run_distributed(
        _save_then_load, 2, str(tmp_path / "ckpt"), saver, loader, release, timeout=300.0
    )
    files = results[0]["files"]
    assert {"metadata.json", "common.pt", ".metadata"} <= set(files), files
    if saver == "ours":
        assert "commit.json" in files, files  # ours commits; Megatron-Core reads past it
