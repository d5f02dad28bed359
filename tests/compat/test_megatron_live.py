"""Checkpoints move both ways with a live Megatron-Core, on 2 gloo ranks.

``make test`` (and ``make bench``) install ``megatron-core`` (``MCORE_VERSION`` in the
Makefile, the newest release on PyPI) without its dependencies into ``.mcore-site``,
outside the virtual environment the rest of the suite runs in; each rank here puts that
folder on its path. Without it (no package index) these tests skip.

Each test saves with one library in one layout and loads with the other in another:
tensor parallel blocks to whole replicas, column blocks to row blocks in the other rank
order, a ShardedObject and a common value; the loaded values are compared with the full
tensors built independently. (Megatron-Core 0.16 refuses flattened ranges; those are
covered by the 0.13 golden checkpoints.)
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import run_distributed

ROOT = Path(__file__).resolve().parents[2]
MCORE_SITE = ROOT / ".mcore-site"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (MCORE_SITE / "megatron" / "core").is_dir(),
        reason="megatron-core is not installed in .mcore-site (make test installs it)",
    ),
]

ROWS, COLS = 8, 6
FULL = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
OTHER = torch.arange(ROWS * COLS, dtype=torch.float64).mul(0.5).reshape(ROWS, COLS)


@contextlib.contextmanager
def _cpu_stand_ins() -> Iterator[None]:
    """Megatron-Core's save calls ``torch.cuda.synchronize()`` and puts a flag tensor on
    ``torch.cuda.current_device()`` even for CPU state; without CUDA, stand in for both."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def _library(name: str) -> Any:
    if name == "megatron":
        if str(MCORE_SITE) not in sys.path:
            sys.path.insert(0, str(MCORE_SITE))
        return importlib.import_module("megatron.core.dist_checkpointing")
    return importlib.import_module("dist_checkpointing")


def _state(lib: Any, rank: int, world: int, saving: bool) -> dict[str, Any]:
    """Saving: ``w`` in rows split over the ranks (tensor parallel), ``exp_avg`` in
    columns split over the ranks. Loading: every rank the whole ``w`` (a replica each) and
    ``exp_avg`` in rows, rank r taking the rows saving rank ``world - 1 - r`` held of
    ``w``; tensors empty, the object None."""
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
    return {"w": w, "opt": {"exp_avg": exp_avg}, "rng": obj, "iteration": 12 if saving else None}


def _save_then_load(root: str, saver: str, loader: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    with _cpu_stand_ins():
        save_lib, load_lib = _library(saver), _library(loader)
        save_lib.save(_state(save_lib, rank, world, saving=True), root)
        loaded = load_lib.load(_state(load_lib, rank, world, saving=False), root)
    rows, part = ROWS // world, world - 1 - rank
    assert torch.equal(loaded["w"], FULL), f"rank {rank}: w"
    expected = OTHER[part * rows : (part + 1) * rows]
    assert torch.equal(loaded["opt"]["exp_avg"], expected), f"rank {rank}: exp_avg"
    assert loaded["rng"] == {"seed": 7}, loaded["rng"]
    assert loaded["iteration"] == 12, loaded["iteration"]
    return {"files": sorted(p.name for p in Path(root).iterdir())}


@pytest.mark.parametrize(
    ("saver", "loader"), [("ours", "megatron"), ("megatron", "ours")], ids=["to-mcore", "from"]
)
def test_a_checkpoint_moves_between_us_and_megatron_core(
    tmp_path: Path, saver: str, loader: str
) -> None:
    (tmp_path / "ckpt").mkdir()
    results = run_distributed(
        _save_then_load, 2, str(tmp_path / "ckpt"), saver, loader, timeout=300.0
    )
    files = results[0]["files"]
    assert {"metadata.json", "common.pt", ".metadata"} <= set(files), files
    if saver == "ours":
        assert "commit.json" in files, files  # ours commits; Megatron-Core reads past it
