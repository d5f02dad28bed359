"""Checkpoints move both ways with a live Megatron-Core, on 2 gloo ranks.

``make test`` (and ``make bench``) install two ``megatron-core`` releases (0.13.1, the
oldest we promise, and 0.16.1, the newest on PyPI; ``MCORE_VERSIONS`` in the Makefile)
without their dependencies into ``.mcore-site/<release>``, outside the virtual
environment the rest of the suite runs in; each rank here puts one on its path. Without
them (no package index) these tests skip.

Each test saves with one library in one layout (synchronously, or asynchronously through
the saver's own ``AsyncCallsQueue``) and loads with the other in another:
tensor parallel blocks to whole replicas, column blocks to row blocks in the other rank
order, a ShardedObject and a common value; the loaded values are compared with the full
tensors built independently, and the loader's ``load_content_metadata`` and
``load_tensors_metadata`` must report what the saver was given. With 0.13.1 also a distributed-optimizer flat range, saved
split one way and loaded split another (0.16 no longer accepts flattened ranges).
"""

from __future__ import annotations

import importlib
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import run_distributed
from tests.support.item_files import count_large

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


def _mcore_compat() -> Any:
    """``bench/mcore_compat.py``: the CPU and NumPy 2 stand-ins Megatron-Core needs here."""
    bench = str(ROOT / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module("mcore_compat")


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


CONTENT = {"format": "live-interop", "iteration": 12}  # save(..., content_metadata=...)


def _save_async(lib: Any, state: dict[str, Any], root: str, persistent: bool) -> None:
    """Save as a training loop does: an async request on the library's own queue."""
    queues = importlib.import_module(f"{lib.__name__}.strategies.async_utils")
    queue = queues.AsyncCallsQueue(persistent=persistent)
    request = lib.save(state, root, async_sharded_save=True, content_metadata=CONTENT)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()


def _save_then_load(
    root: str, saver: str, loader: str, release: str, how: str = "sync"
) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = _with_flat(release)
    with _mcore_compat().stand_ins():
        save_lib, load_lib = _library(saver, release), _library(loader, release)
        state = _state(save_lib, rank, world, saving=True, flat=flat)
        if how == "sync":
            save_lib.save(state, root, content_metadata=CONTENT)
        else:
            _save_async(save_lib, state, root, persistent=how == "persistent")
        loaded = load_lib.load(_state(load_lib, rank, world, saving=False, flat=flat), root)
        content = load_lib.serialization.load_content_metadata(root)
        shapes = {
            key: (tuple(sh.global_shape), sh.dtype)
            for key, sh in load_lib.load_tensors_metadata(root).items()
        }
    assert content == CONTENT, content
    assert shapes["w"] == ((ROWS, COLS), torch.float32), shapes
    assert shapes["opt.exp_avg"] == ((ROWS, COLS), torch.float64), shapes
    _check_loaded(loaded, rank, world, flat)
    assert loaded["rng"] == {"seed": 7}, loaded["rng"]
    assert loaded["iteration"] == 12, loaded["iteration"]
    return {"files": sorted(p.name for p in Path(root).iterdir())}


def _check_loaded(loaded: dict[str, Any], rank: int, world: int, flat: bool) -> None:
    """What ``_state(..., saving=False)`` asks for, as saved by ``_state(..., saving=True)``."""
    rows, part = ROWS // world, world - 1 - rank
    assert torch.equal(loaded["w"], FULL), f"rank {rank}: w"
    expected = OTHER[part * rows : (part + 1) * rows]
    assert torch.equal(loaded["opt"]["exp_avg"], expected), f"rank {rank}: exp_avg"
    if flat:
        fr = _flat_range(rank, world, reverse=True)
        got = loaded["opt"]["param"]
        assert torch.equal(got, FLAT.reshape(-1)[fr]), f"rank {rank}: flat range {fr}"


# Megatron-Core's persistent async worker calls ``torch.cuda.set_device(rank %
# torch.cuda.device_count())`` at start, which fails without a GPU (its queue then waits
# for ever): its async saves are tested with a process per save only.
DIRECTIONS = [
    pytest.param("ours", "megatron", how, id=f"to-mcore-{how}")
    for how in ("sync", "async", "persistent")
] + [pytest.param("megatron", "ours", how, id=f"from-{how}") for how in ("sync", "async")]


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize(("saver", "loader", "how"), DIRECTIONS)
def test_a_checkpoint_moves_between_us_and_megatron_core(
    tmp_path: Path, saver: str, loader: str, how: str, release: str
) -> None:
    """Saved synchronously, or asynchronously through the saver's own queue (a process
    per save, or its persistent worker), and loaded by the other library."""
    if not (MCORE_SITE / release / "megatron" / "core").is_dir():
        pytest.skip(f"megatron-core {release} is not in .mcore-site (make test installs it)")
    (tmp_path / "ckpt").mkdir()
    results = run_distributed(
        _save_then_load, 2, str(tmp_path / "ckpt"), saver, loader, release, how, timeout=300.0
    )
    files = results[0]["files"]
    assert {"metadata.json", "common.pt", ".metadata"} <= set(files), files
    if saver == "ours":
        assert "commit.json" in files, files  # ours commits; Megatron-Core reads past it


DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.uint8)


def _random_tensors(
    rng: random.Random, case: int, flat: bool, mcore_loads: bool
) -> list[dict[str, Any]]:
    """Three tensors of a random case (the same on every rank): dtype, global shape
    (every axis even, so that any axis splits over 2 ranks), the saving and the loading
    layout, and the full values (from a generator seeded by the case). Megatron-Core
    loads flat ranges only of a tensor saved as flat ranges, and grid blocks only of one
    saved as grid blocks: 0.13.1 raises "Cannot find global shape metadata for N-D
    flattened tensor" and "Global shape mismatch" for the other two, on checkpoints it
    saved itself too. Ours loads all four."""
    out = []
    for j in range(3):
        shape = tuple(2 * rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        dtype = rng.choice(DTYPES)
        gen = torch.Generator().manual_seed(1000 * case + j)
        if dtype.is_floating_point:
            full = torch.randn(shape, generator=gen).to(dtype)
        else:
            full = torch.randint(0, 100, shape, generator=gen).to(dtype)
        kinds = ["split", "replica"] + (["flat"] if flat and dtype.is_floating_point else [])
        save, load = rng.choice(kinds), rng.choice(kinds)
        if mcore_loads and (load == "flat") != (save == "flat"):
            load = "flat" if save == "flat" else "replica"
        numel = full.numel()
        out.append(
            {
                "key": f"case{case}.t{j}",
                "full": full,
                "save": (
                    save,
                    rng.randrange(len(shape)),
                    rng.random() < 0.5,
                    rng.randint(1, numel - 1),
                ),
                "load": (
                    load,
                    rng.randrange(len(shape)),
                    rng.random() < 0.5,
                    rng.randint(1, numel - 1),
                ),
            }
        )
    return out


def _leaf(
    lib: Any,
    t: dict[str, Any],
    layout: tuple[str, int, bool, int],
    rank: int,
    world: int,
    saving: bool,
) -> tuple[Any, torch.Tensor]:
    """The ShardedTensor of ``t`` on ``rank`` in ``layout`` (kind, axis, reversed rank
    order, flat cut) and the values it must hold."""
    kind, axis, reverse, cut = layout
    full = t["full"]
    part = world - 1 - rank if reverse else rank
    if kind == "replica":
        expected = full
        data = full.clone() if saving else torch.empty_like(full)
        return lib.ShardedTensor.from_rank_offsets(t["key"], data, replica_id=rank), expected
    if kind == "split":
        expected = full.chunk(world, axis)[part]
        data = expected.clone() if saving else torch.empty_like(expected)
        return lib.ShardedTensor.from_rank_offsets(t["key"], data, (axis, part, world)), expected
    bounds = [0, cut, full.numel()]  # flat: one block, cut in two at ``cut``
    fr = slice(bounds[part], bounds[part + 1])
    expected = full.reshape(-1)[fr]
    data = expected.clone() if saving else torch.empty_like(expected)
    sh = lib.ShardedTensor.from_rank_offsets_flat(
        t["key"], data, tuple(full.shape), flattened_range=fr
    )
    return sh, expected


def _ours_strategy(save_lib: Any, ours: Any, case: int) -> tuple[Any, ...]:
    """How ours saves case ``case``: every other save of ours through the fully parallel
    wrapper (the replicas' writes spread over the ranks: other ranks write other chunks)."""
    if save_lib is not ours or case % 4 != 2:
        return ()
    fully_parallel = importlib.import_module("dist_checkpointing.strategies.fully_parallel")
    default = ours.serialization.get_default_save_sharded_strategy()
    return (fully_parallel.FullyParallelSaveStrategyWrapper(default),)


def _random_cases(root: str, release: str, seed: int, cases: int) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = random.Random(seed)
    checked = 0
    with _mcore_compat().stand_ins():
        ours, mcore = _library("ours", release), _library("megatron", release)
        for case in range(cases):
            save_lib, load_lib = (ours, mcore) if case % 2 == 0 else (mcore, ours)
            tensors = _random_tensors(rng, case, _with_flat(release), load_lib is mcore)
            path = f"{root}/case{case}"
            if rank == 0:
                Path(path).mkdir()
            dist.barrier()
            state = {t["key"]: _leaf(save_lib, t, t["save"], rank, world, True)[0] for t in tensors}
            state["obj"] = save_lib.ShardedObject(
                f"case{case}.obj", {"rank": rank}, (world,), (rank,), replica_id=0
            )
            save_lib.save(state, path, *_ours_strategy(save_lib, ours, case))
            request, expected = {}, {}
            for t in tensors:
                request[t["key"]], expected[t["key"]] = _leaf(
                    load_lib, t, t["load"], rank, world, False
                )
            other = world - 1 - rank
            request["obj"] = load_lib.ShardedObject(
                f"case{case}.obj", None, (world,), (other,), replica_id=0
            )
            loaded = load_lib.load(request, path)
            for t in tensors:
                what = (
                    f"rank {rank} case {case} {t['key']} {t['full'].dtype} {t['save']}->{t['load']}"
                )
                assert torch.equal(loaded[t["key"]], expected[t["key"]]), what
            assert loaded["obj"] == {"rank": other}, (case, loaded["obj"])
            checked += len(tensors)
    return checked


@pytest.mark.parametrize("release", RELEASES)
def test_random_layouts_move_between_us_and_megatron_core(tmp_path: Path, release: str) -> None:
    """Random cases, each saved by one library and loaded by the other (alternating; ours
    saves every other time through the fully parallel wrapper): dtypes, 1-3 axes,
    tensor-parallel splits on any axis in either rank order, whole replicas and (0.13.1)
    flat ranges cut anywhere, resharded between save and load."""
    if not (MCORE_SITE / release / "megatron" / "core").is_dir():
        pytest.skip(f"megatron-core {release} is not in .mcore-site (make test installs it)")
    checked = run_distributed(_random_cases, 2, str(tmp_path), release, 2026, 8, timeout=300.0)
    assert checked == [24, 24]


def _read_directly(root: str, release: str) -> list[int]:
    """Saved by Megatron-Core, loaded by us three times with every item counted as large
    (no "small item" window): the loads after the first read the items whose layout they
    learnt straight into their destinations (``w`` whole, the flat range reversed, and
    ``exp_avg``'s column blocks into rows the usual way), bit-exactly each time."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = _with_flat(release)
    taken = count_large()
    os.environ["DIST_CKPT_READ_SMALL_ITEM_BYTES"] = "0"
    per_load = []
    with _mcore_compat().stand_ins():
        mcore, ours = _library("megatron", release), _library("ours", release)
        mcore.save(_state(mcore, rank, world, saving=True, flat=flat), root)
        for _ in range(3):
            before = sum(taken)
            loaded = ours.load(_state(ours, rank, world, saving=False, flat=flat), root)
            per_load.append(sum(taken) - before)
            _check_loaded(loaded, rank, world, flat)
    return per_load


@pytest.mark.parametrize("release", RELEASES)
def test_megatron_core_items_are_read_straight_into_their_destinations(
    tmp_path: Path, release: str
) -> None:
    if not (MCORE_SITE / release / "megatron" / "core").is_dir():
        pytest.skip(f"megatron-core {release} is not in .mcore-site (make test installs it)")
    (tmp_path / "ckpt").mkdir()
    for per_load in run_distributed(_read_directly, 2, str(tmp_path / "ckpt"), release):
        # w's two row blocks (whole items into views of the destination), and with flat
        # ranges the parts of them the reversed range meets; none before a layout is known.
        assert per_load[1] == per_load[2] >= 2, per_load
