"""Maintenance and metadata API of the torch_dist backend: remove_sharded_tensors,
load_plain_tensors, load_tensors_metadata, load_sharded_metadata, load_content_metadata,
cached planning (``cached_metadata=True``) and saving/loading in a process subgroup.

One 2-rank checkpoint is written once per module (real gloo ranks) and copied for each
test; the queries on it run in this process, like the offline tools that use them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.engine.storage.local import LocalFileSystem
from dist_checkpointing.engine.storage.reader import FileSystemReader
from dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from tests.support.harness import run_distributed

pytestmark = pytest.mark.timeout(120)

WORLD = 2
# key -> (global shape, dtype). model.* split on axis 0, opt.* on axis 1, 'flat' is one
# block saved as uneven flat ranges (distributed-optimizer style).
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.a": ((8, 4), torch.float32),
    "model.b": ((8, 4), torch.float32),
    "opt.x": ((4, 6), torch.bfloat16),
    "opt.y": ((4, 6), torch.bfloat16),
    "flat": ((4, 6), torch.float32),
}
FLAT_RANGES = [slice(0, 10), slice(10, 24)]
OBJECT_KEYS = {f"obj/shard_{r}_{WORLD}" for r in range(WORLD)}
CONTENT = {"iteration": 3, "note": "maintenance"}
COMMON = 7


def _ref(key: str, shape: tuple[int, ...] | None = None, salt: int = 0) -> torch.Tensor:
    """Deterministic reference values of a global tensor (distinct per key and salt)."""
    shape = shape or TENSORS[key][0]
    dtype = TENSORS.get(key, ((), torch.float32))[1]
    numel = 1
    for s in shape:
        numel *= s
    base = (sum(ord(c) for c in key) % 97) * 64 + salt
    return (torch.arange(numel, dtype=torch.int64) + base).reshape(shape).to(dtype)


def _sharded_state_dict(rank: int, world: int, data: bool = True) -> dict[str, Any]:
    def val(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if data else torch.zeros_like(t)

    sd: dict[str, Any] = {}
    for key in ("model.a", "model.b"):
        sd[key] = ShardedTensor.from_rank_offsets(
            key, val(_ref(key).chunk(world)[rank]), (0, rank, world)
        )
    for key in ("opt.x", "opt.y"):
        sd[key] = ShardedTensor.from_rank_offsets(
            key, val(_ref(key).chunk(world, 1)[rank]), (1, rank, world)
        )
    fr = FLAT_RANGES[rank]
    sd["flat"] = ShardedTensor.from_rank_offsets_flat(
        "flat", val(_ref("flat").reshape(-1)[fr]), (4, 6), flattened_range=fr
    )
    sd["obj"] = ShardedObject("obj", {"rank": rank} if data else None, (world,), (rank,))
    return sd


def _rank_save(ckpt_dir: str) -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = _sharded_state_dict(rank, world)
    sd["common"] = COMMON
    # opt.* go to data files of their own (__<rank>_1.distcp).
    strategy = TorchDistSaveShardedStrategy(thread_count=2, separation_hint="opt.")
    dcp.save(sd, ckpt_dir, strategy, content_metadata=CONTENT)
    # Every rank can load every tensor whole.
    return dcp.load_plain_tensors(ckpt_dir)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    d = tmp_path_factory.mktemp("maintenance") / "ckpt"
    d.mkdir()
    plain = run_distributed(_rank_save, WORLD, str(d), timeout=60)
    return d, plain


@pytest.fixture
def ckpt(saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(saved[0], dst)
    return dst


def _files_of(ckpt_dir: Path) -> dict[str, set[str]]:
    """Data file -> the keys stored in it."""
    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    out: dict[str, set[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        out.setdefault(info.relative_path, set()).add(index.fqn)
    return out


def _expected_whole(key: str) -> torch.Tensor:
    return _ref(key).reshape(-1) if key == "flat" else _ref(key)


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, key: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, key
    assert torch.equal(actual, expected), key


# ----------------------------------------------------------------------------- metadata queries


def test_layout_of_the_saved_checkpoint(ckpt: Path) -> None:
    """The precondition of the removal tests: opt.* live in files of their own."""
    files = _files_of(ckpt)
    for rank in range(WORLD):
        assert files[f"opt.__{rank}_1.distcp"] == {"opt.x", "opt.y"}
        assert {"model.a", "model.b", "flat"} <= files[f"__{rank}_0.distcp"]


def test_load_tensors_metadata(ckpt: Path) -> None:
    md = dcp.load_tensors_metadata(ckpt)
    assert set(md) == set(TENSORS)
    for key, (shape, dtype) in TENSORS.items():
        sh = md[key]
        assert isinstance(sh, ShardedTensor) and sh.key == key
        assert tuple(sh.global_shape) == shape and sh.dtype == dtype, key
        assert sh.data is None
    # The flat tensor is reported with its logical shape, as one whole flat range.
    assert md["flat"].flattened_range == slice(0, 24)
    assert tuple(md["flat"].local_shape) == (4, 6)
    assert md["model.a"].flattened_range is None


def test_load_sharded_metadata(ckpt: Path) -> None:
    md = dcp.load_sharded_metadata(ckpt)
    assert set(md) == set(TENSORS) | OBJECT_KEYS
    for rank in range(WORLD):
        obj = md[f"obj/shard_{rank}_{WORLD}"]
        assert isinstance(obj, ShardedObject) and obj.key == "obj"
        assert obj.global_shape == (WORLD,) and obj.global_offset == (rank,)
        assert obj.data is None
    assert tuple(md["opt.x"].global_shape) == (4, 6) and md["opt.x"].dtype == torch.bfloat16


def test_load_plain_tensors(ckpt: Path) -> None:
    plain = dcp.load_plain_tensors(ckpt)
    for key in TENSORS:
        _assert_same(plain[key], _expected_whole(key), key)
    assert plain["common"] == COMMON  # the common state comes with it (as Megatron-Core)


def test_load_plain_tensors_on_every_rank(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    for rank, plain in enumerate(saved[1]):
        for key in TENSORS:
            _assert_same(plain[key], _expected_whole(key), f"rank {rank} {key}")


def test_load_content_metadata(ckpt: Path, tmp_path: Path) -> None:
    assert dcp.load_content_metadata(ckpt) == CONTENT
    common = dcp.load_common_state_dict(ckpt)
    assert dcp.load_content_metadata(preloaded_state_dict=common) == CONTENT
    assert common["common"] == COMMON
    # A checkpoint saved without content_metadata has none.
    other = tmp_path / "plain"
    other.mkdir()
    dcp.save({"t": ShardedTensor.from_rank_offsets("t", torch.ones(2))}, other)
    assert dcp.load_content_metadata(other) is None


# ----------------------------------------------------------------------------- remove_sharded_tensors


def test_remove_sharded_tensors_by_prefix(ckpt: Path) -> None:
    files_before = _files_of(ckpt)
    dcp.remove_sharded_tensors(ckpt, "opt.")
    # Files that held only removed keys are deleted; the others are kept.
    for rank in range(WORLD):
        assert not (ckpt / f"opt.__{rank}_1.distcp").exists()
        assert (ckpt / f"__{rank}_0.distcp").exists()
    assert set(dcp.load_tensors_metadata(ckpt)) == {"model.a", "model.b", "flat"}
    plain = dcp.load_plain_tensors(ckpt)
    assert not any(k.startswith("opt.") for k in plain)
    for key in ("model.a", "model.b", "flat"):
        _assert_same(plain[key], _expected_whole(key), key)

    # A prefix whose keys share files with kept keys: the files stay.
    dcp.remove_sharded_tensors(ckpt, "model.a")
    for rank in range(WORLD):
        assert (ckpt / f"__{rank}_0.distcp").exists()
    assert set(_files_of(ckpt)) == {f for f in files_before if f.endswith("_0.distcp")}
    md = dcp.load_sharded_metadata(ckpt)
    assert set(md) == {"model.b", "flat"} | OBJECT_KEYS  # objects are not tensors: kept
    # The remaining state still loads into the original (sharded) layout on 2 ranks.
    results = run_distributed(_rank_load_remaining, WORLD, str(ckpt), timeout=60)
    assert results == [True] * WORLD


def _rank_load_remaining(ckpt_dir: str) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    request = _sharded_state_dict(rank, world, data=False)
    for key in ("model.a", "opt.x", "opt.y"):
        del request[key]
    out = dcp.load(request, ckpt_dir)
    assert isinstance(out, dict)
    expected = _sharded_state_dict(rank, world)
    ok = out["obj"] == {"rank": rank} and out["common"] == COMMON
    for key in ("model.b", "flat"):
        ok = ok and torch.equal(out[key], expected[key].data)
    return bool(ok)


def test_remove_with_unmatched_prefix_changes_nothing(ckpt: Path) -> None:
    names = sorted(os.listdir(ckpt))
    dcp.remove_sharded_tensors(ckpt, "no_such_prefix")
    assert sorted(os.listdir(ckpt)) == names
    plain = dcp.load_plain_tensors(ckpt)
    for key in TENSORS:
        _assert_same(plain[key], _expected_whole(key), key)


def test_remove_writes_metadata_before_deleting(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    atomic_write = LocalFileSystem.atomic_write

    def logged_write(self: LocalFileSystem, path: str, data: bytes, **kw: Any) -> None:
        atomic_write(self, path, data, **kw)
        events.append(f"write {os.path.basename(path)}")

    def failing_remove(self: LocalFileSystem, path: str) -> None:
        events.append(f"remove {os.path.basename(path)}")
        raise OSError(f"injected failure removing {path}")

    monkeypatch.setattr(LocalFileSystem, "atomic_write", logged_write)
    monkeypatch.setattr(LocalFileSystem, "remove", failing_remove)
    with pytest.raises(OSError, match="injected"):
        dcp.remove_sharded_tensors(ckpt, "opt.")
    monkeypatch.undo()
    # The new .metadata and its index are staged, then committed by the commit record,
    # before any data file is removed.
    first_remove = next(i for i, e in enumerate(events) if e.startswith("remove opt.__"))
    assert events[0].startswith("write .metadata.") and events[2] == "write commit.json", events
    assert events[1].startswith("write .metadata_index.json."), events
    assert first_remove > 2, events

    # A crash between the two steps leaves a consistent checkpoint: the removed keys are
    # gone, the rest loads bit-exactly; only unreferenced files remain.
    assert (ckpt / "opt.__0_1.distcp").exists()
    assert set(dcp.load_tensors_metadata(ckpt)) == {"model.a", "model.b", "flat"}
    plain = dcp.load_plain_tensors(ckpt)
    for key in ("model.a", "model.b", "flat"):
        _assert_same(plain[key], _expected_whole(key), key)


# ----------------------------------------------------------------------------- cached_metadata


def _rank_cached_saves(base: str, keep_only_main_replica: bool) -> list[dict[str, Any]]:
    """Three saves with cached_metadata=True: same structure twice, then a new shape.

    Counts plan exchanges (scatters of the global plan: only when replicas must be
    deduplicated) and metadata builds from plan records (decentralized planning,
    on the coordinator at finalization).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    exchanges: list[int] = []
    builds: list[int] = []
    scatter = dist.scatter_object_list
    build = MCoreSavePlanner.metadata_from_records

    def counting_scatter(*args: Any, **kwargs: Any) -> Any:
        exchanges.append(1)
        return scatter(*args, **kwargs)

    def counting_build(records: Any) -> Any:
        builds.append(1)
        return build(records)

    dist.scatter_object_list = counting_scatter
    MCoreSavePlanner.metadata_from_records = staticmethod(counting_build)  # type: ignore[method-assign]
    strategy = TorchDistSaveShardedStrategy(
        cached_metadata=True, keep_only_main_replica=keep_only_main_replica
    )
    out = []
    previous = None
    try:
        for i, rows in enumerate((8, 8, 12)):
            ckpt_dir = os.path.join(base, f"ckpt{i}")
            if rank == 0:
                os.makedirs(ckpt_dir)
            dist.barrier()
            g = _ref("c", (rows, 4), salt=100 * i)
            sd = {
                "c": ShardedTensor.from_rank_offsets(
                    "c", g.chunk(world)[rank].clone(), (0, rank, world)
                )
            }
            before_x, before_b = len(exchanges), len(builds)
            dcp.save(sd, ckpt_dir, strategy)
            cached = strategy.cached_structure
            assert cached is not None
            reused = previous is not None and cached.central_plan is previous.central_plan
            out.append(
                {
                    "exchanges": len(exchanges) - before_x,
                    "builds": len(builds) - before_b,
                    "reused_plan": reused,
                }
            )
            previous = cached
    finally:
        dist.scatter_object_list = scatter
        MCoreSavePlanner.metadata_from_records = staticmethod(build)  # type: ignore[method-assign]
    # Every checkpoint (the earlier ones too) loads bit-exactly.
    for i, rows in enumerate((8, 8, 12)):
        request = {"c": ShardedTensor.from_rank_offsets("c", torch.zeros(rows, 4), replica_id=rank)}
        loaded = dcp.load(request, os.path.join(base, f"ckpt{i}"))
        assert isinstance(loaded, dict)
        out[i]["exact"] = torch.equal(loaded["c"], _ref("c", (rows, 4), salt=100 * i))
    return out


def test_cached_metadata_skips_metadata_build_for_same_structure(tmp_path: Path) -> None:
    # Only main replicas: decentralized planning (no plan exchange at all); the
    # coordinator builds the metadata once, then reuses it while the structure holds.
    results = run_distributed(_rank_cached_saves, WORLD, str(tmp_path), True, timeout=60)
    for rank, saves in enumerate(results):
        first, same, changed = saves
        coordinator = 1 if rank == 0 else 0
        assert [s["exchanges"] for s in saves] == [0, 0, 0], (rank, saves)
        assert [s["builds"] for s in saves] == [coordinator, 0, coordinator], (rank, saves)
        assert not first["reused_plan"] and same["reused_plan"] and not changed["reused_plan"]
        assert all(s["exact"] for s in saves), (rank, saves)


def test_cached_metadata_skips_plan_exchange_with_deduplication(tmp_path: Path) -> None:
    # keep_only_main_replica=False: plans are exchanged (for DCP's dedup), except
    # when every rank's plan equals the cached one.
    results = run_distributed(_rank_cached_saves, WORLD, str(tmp_path), False, timeout=60)
    for rank, saves in enumerate(results):
        first, same, changed = saves
        assert [s["exchanges"] for s in saves] == [1, 0, 1], (rank, saves)
        assert [s["builds"] for s in saves] == [0, 0, 0], (rank, saves)
        assert not first["reused_plan"] and same["reused_plan"] and not changed["reused_plan"]
        assert all(s["exact"] for s in saves), (rank, saves)


def _subgroup(rank: int) -> tuple[int, dist.ProcessGroup]:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    return rank // 2, groups[rank // 2]


def _group_ref(group_index: int) -> torch.Tensor:
    return _ref("g", (8, 4), salt=1000 * group_index)


def _rank_subgroup_strategies(base: str) -> bool:
    """Each pair of ranks saves and loads its own checkpoint with the strategies alone."""
    group_index, pg = _subgroup(dist.get_rank())
    local_rank = dist.get_rank(pg)
    ckpt_dir = os.path.join(base, f"group{group_index}")
    os.makedirs(ckpt_dir, exist_ok=True)
    g = _group_ref(group_index)
    sh = ShardedTensor.from_rank_offsets("g", g.chunk(2)[local_rank].clone(), (0, local_rank, 2))
    TorchDistSaveShardedStrategy(process_group=pg).save({"g": sh}, ckpt_dir)
    request = {"g": ShardedTensor.from_rank_offsets("g", torch.zeros(4, 4), (0, 1 - local_rank, 2))}
    loaded = TorchDistLoadShardedStrategy(process_group=pg).load(request, ckpt_dir)
    return torch.equal(loaded["g"], g.chunk(2)[1 - local_rank])


def test_subgroup_save_and_load_with_strategies(tmp_path: Path) -> None:
    assert run_distributed(_rank_subgroup_strategies, 4, str(tmp_path), timeout=60) == [True] * 4
    for group_index in range(2):
        # The strategies alone write no metadata.json; .metadata holds the group's tensor.
        reader = FileSystemReader(str(tmp_path / f"group{group_index}"))
        assert "g" in reader.read_metadata().state_dict_metadata


def _rank_subgroup_serialization(base: str, validate: bool) -> dict[str, Any]:
    group_index, pg = _subgroup(dist.get_rank())
    local_rank = dist.get_rank(pg)
    ckpt_dir = os.path.join(base, f"group{group_index}")
    os.makedirs(ckpt_dir, exist_ok=True)
    g = _group_ref(group_index)
    sd = {
        "g": ShardedTensor.from_rank_offsets(
            "g", g.chunk(2)[local_rank].clone(), (0, local_rank, 2)
        ),
        "group": group_index,
    }
    out: dict[str, Any] = {}
    try:
        dcp.save(
            sd,
            ckpt_dir,
            TorchDistSaveShardedStrategy(process_group=pg),
            validate_access_integrity=validate,
            process_group=pg,
        )
        dist.barrier()
        request = {"g": ShardedTensor.from_rank_offsets("g", torch.zeros(4, 4), (0, local_rank, 2))}
        loaded = dcp.load(
            request,
            ckpt_dir,
            TorchDistLoadShardedStrategy(process_group=pg),
            validate_access_integrity=validate,
            process_group=pg,
        )
        assert isinstance(loaded, dict)
        out["exact"] = torch.equal(loaded["g"], g.chunk(2)[local_rank])
        out["common"] = loaded.get("group")
    except Exception as e:  # noqa: BLE001 - returned to the test for inspection
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def test_subgroup_save_and_load_through_serialization(tmp_path: Path) -> None:
    results = run_distributed(_rank_subgroup_serialization, 4, str(tmp_path), True, timeout=60)
    for rank, res in enumerate(results):
        assert res == {"exact": True, "common": rank // 2}, (rank, res)


def test_subgroup_save_without_validation_commits_every_group(tmp_path: Path) -> None:
    results = run_distributed(_rank_subgroup_serialization, 4, str(tmp_path), False, timeout=60)
    for rank, res in enumerate(results):
        assert res == {"exact": True, "common": rank // 2}, (rank, res)
