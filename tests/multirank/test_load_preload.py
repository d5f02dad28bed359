"""A load's small files are read once, by the coordinator, for every rank
(:mod:`dist_checkpointing.engine.checkpoint.preload`), and still checked as any read.

On ``msc://`` (moto's S3 server) the requests each rank sends are recorded by wrapping
botocore's API call; on a local directory ``LOAD_PRELOAD=2`` turns the step on, so the
checks that must still hold (foreign files, missing files, interrupted commits,
checkpoints without a commit record) run on both backends.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from tests.support.faults import save_interrupted_after_record
from tests.support.harness import run_distributed
from tests.support.layouts import same_bits

SMALL = {"commit.json", "metadata.json", ".metadata", "common.pt"}


def _ref(version: int) -> torch.Tensor:
    return torch.arange(48, dtype=torch.float32).reshape(8, 6) * version


def _state(version: int, fill: bool = True) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    local = _ref(version).chunk(world)[rank]
    return {
        "a": ShardedTensor.from_rank_offsets(
            "a", local if fill else torch.zeros_like(local), (0, rank, world)
        ),
        "step": version,
    }


def _load_matches(url: str, version: int) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = dcp.load(_state(version, fill=False), url)
    assert isinstance(out, dict)
    return same_bits(out["a"], _ref(version).chunk(world)[rank]) and out["step"] == version


def _set_env(env: dict[str, str]) -> None:
    os.environ.update(env)


# ----------------------------------------------------------------------------- object store


def _requests_of_load(url: str, env: dict[str, str]) -> dict[str, Any]:
    import botocore.client

    _set_env(env)
    dcp.save(_state(1), url)
    seen: list[tuple[str, str]] = []
    lock = threading.Lock()
    original = botocore.client.BaseClient._make_api_call

    def spy(client: Any, operation: str, params: Any) -> Any:
        with lock:
            seen.append(
                (operation, str(params.get("Key", params.get("Prefix", ""))).rsplit("/", 1)[-1])
            )
        return original(client, operation, params)

    dist.barrier()
    botocore.client.BaseClient._make_api_call = spy  # type: ignore[method-assign]
    try:
        ok = _load_matches(url, 1)
    finally:
        botocore.client.BaseClient._make_api_call = original  # type: ignore[method-assign]
    return {"ok": ok, "requests": seen}


@pytest.mark.parametrize("preload", ["1", "0"])
def test_coordinator_reads_the_small_files_for_every_rank(msc_store: Any, preload: str) -> None:
    pytest.importorskip("multistorageclient")
    url = msc_store.url("s3", f"preload{preload}")
    env = {"DIST_CKPT_LOAD_PRELOAD": preload}
    results = run_distributed(_requests_of_load, 2, url, env, timeout=120.0)
    assert all(r["ok"] for r in results)
    coordinator, other = (sorted(r["requests"]) for r in results)
    if preload == "0":  # without the step every rank lists and reads them itself
        assert {name for op, name in other if op == "GetObject"} >= SMALL, other
        return
    # One GET of each small file, all on the coordinator; no listing, no HEAD anywhere.
    assert sorted(name for op, name in coordinator if name in SMALL) == sorted(SMALL), coordinator
    assert {op for op, _ in coordinator + other} == {"GetObject"}, (coordinator, other)
    assert all(name.endswith(".distcp") for _, name in other), other


# ----------------------------------------------------------------------------- what is still checked

PRELOAD_EVERYWHERE = {"DIST_CKPT_LOAD_PRELOAD": "2"}


def _save_versions(ckpt: str, env: dict[str, str], versions: list[int]) -> None:
    _set_env(env)
    for v in versions:
        target = os.path.join(ckpt, f"v{v}")
        if dist.get_rank() == 0:
            os.makedirs(target, exist_ok=True)
        dist.barrier()
        dcp.save(_state(v), target)


def _load_result(ckpt: str, env: dict[str, str], version: int) -> tuple[str, str]:
    _set_env(env)
    try:
        return ("ok", "") if _load_matches(ckpt, version) else ("wrong values", "")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("env", [PRELOAD_EVERYWHERE, {"DIST_CKPT_LOAD_PRELOAD": "0"}])
def test_preloaded_files_are_checked_against_the_record(
    tmp_path: Path, env: dict[str, str]
) -> None:
    run_distributed(_save_versions, 2, str(tmp_path), env, [1, 2], timeout=120.0)
    assert run_distributed(_load_result, 2, str(tmp_path / "v1"), env, 1) == [("ok", "")] * 2
    # .metadata of another save of the same structure: refused on every rank.
    shutil.copy(tmp_path / "v2" / ".metadata", tmp_path / "v1" / ".metadata")
    results = run_distributed(_load_result, 2, str(tmp_path / "v1"), env, 1, timeout=120.0)
    for kind, msg in results:
        assert kind in ("ForeignFileError", "RankFailureError"), (kind, msg)
        assert ".metadata" in msg and "another save" in msg, msg


def test_preload_missing_file_is_incomplete_on_every_rank(tmp_path: Path) -> None:
    run_distributed(_save_versions, 2, str(tmp_path), PRELOAD_EVERYWHERE, [1], timeout=120.0)
    (tmp_path / "v1" / "common.pt").unlink()
    results = run_distributed(_load_result, 2, str(tmp_path / "v1"), PRELOAD_EVERYWHERE, 1)
    for kind, msg in results:
        assert kind in ("IncompleteCheckpointError", "RankFailureError"), (kind, msg)
        assert "common.pt" in msg, msg


def test_preload_without_a_commit_record(tmp_path: Path) -> None:
    """A checkpoint written without our record (Megatron-Core, plain DCP) still loads:
    the coordinator lists the directory once for the data files' sizes."""
    run_distributed(_save_versions, 2, str(tmp_path), PRELOAD_EVERYWHERE, [3], timeout=120.0)
    (tmp_path / "v3" / "commit.json").unlink()
    results = run_distributed(_load_result, 2, str(tmp_path / "v3"), PRELOAD_EVERYWHERE, 3)
    assert results == [("ok", "")] * 2


def test_preload_budget_zero_still_loads(tmp_path: Path) -> None:
    env = {**PRELOAD_EVERYWHERE, "DIST_CKPT_LOAD_PRELOAD_BYTES": "0"}
    run_distributed(_save_versions, 2, str(tmp_path), env, [2], timeout=120.0)
    assert run_distributed(_load_result, 2, str(tmp_path / "v2"), env, 2) == [("ok", "")] * 2


def _damaged_record(ckpt: str) -> tuple[str, str]:
    _set_env(PRELOAD_EVERYWHERE)
    dcp.save(_state(1), ckpt)
    dist.barrier()
    if dist.get_rank() == 0:
        Path(ckpt, "commit.json").write_text("{not json")
    dist.barrier()
    return _load_result(ckpt, PRELOAD_EVERYWHERE, 1)


def test_preload_of_a_damaged_record_fails_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_damaged_record, 2, str(tmp_path), timeout=120.0)
    for kind, msg in results:
        assert kind in ("CorruptCheckpointError", "RankFailureError"), (kind, msg)
        assert "commit.json" in msg, msg


def _interrupted_commit(ckpt: str) -> bool:
    _set_env(PRELOAD_EVERYWHERE)
    dcp.save(_state(1), ckpt)
    save_interrupted_after_record(lambda: dcp.save(_state(2), ckpt))
    dist.barrier()
    return _load_matches(ckpt, 2)  # the staged files of the record, preloaded


def test_preload_reads_the_staged_files_of_an_interrupted_commit(tmp_path: Path) -> None:
    assert run_distributed(_interrupted_commit, 2, str(tmp_path), timeout=120.0) == [True, True]
    record = json.loads((tmp_path / "commit.json").read_text())
    assert record["install"], "the commit was not left interrupted"
