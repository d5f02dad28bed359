"""Bad inputs for ``msc://`` checkpoints: each error names the URL and is raised on every rank.

Runs against moto's S3 server and a posix MSC profile (:mod:`tests.support.msc_server`);
the ``s3-badcreds`` profile holds keys the server refuses, ``s3-down`` an endpoint where
nothing listens.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing import errors as E
from dist_checkpointing.engine.storage.location import CheckpointDir
from tests.support.harness import run_distributed
from tests.support.msc_server import PROFILES, MscStore

pytest.importorskip("multistorageclient")
pytest.importorskip("moto")


@pytest.fixture(params=PROFILES)
def profile(request: pytest.FixtureRequest, msc_store: MscStore) -> str:
    return str(request.param)


def _state(rank: int, world: int, fill: bool = True) -> dict[str, Any]:
    ref = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    local = ref.chunk(world)[rank]
    if not fill:
        local = torch.zeros_like(local)
    return {"a": ShardedTensor.from_rank_offsets("a", local, (0, rank, world))}


def _rank_save(url: str) -> None:
    dcp.save(_state(dist.get_rank(), dist.get_world_size()), url)


def _rank_error(url: str, action: str) -> tuple[str, str, float]:
    """(exception type, message, seconds) of ``action`` on this rank; ("", "", s) if none."""
    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.monotonic()
    try:
        if action == "save":
            dcp.save(_state(rank, world), url)
        else:
            dcp.load(_state(rank, world, fill=False), url)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "", "", time.monotonic() - start


def _errors(url: str, action: str, world: int = 2) -> list[tuple[str, str, float]]:
    results: list[tuple[str, str, float]] = run_distributed(
        _rank_error, world, url, action, timeout=120.0
    )
    return results


def _assert_every_rank_names(results: list[tuple[str, str, float]], url: str) -> None:
    for rank, (kind, msg, _) in enumerate(results):
        assert kind, f"rank {rank} raised nothing"
        assert url in msg, f"rank {rank}: {kind}: {msg}"


def test_missing_checkpoint(msc_store: MscStore, profile: str) -> None:
    url = msc_store.url(profile, "never-saved")
    results = _errors(url, "load")
    _assert_every_rank_names(results, url)
    assert {kind for kind, _, _ in results} == {"CheckpointNotFoundError"}


def test_missing_data_object(msc_store: MscStore, profile: str) -> None:
    url = msc_store.url(profile)
    run_distributed(_rank_save, 2, url)
    CheckpointDir.of(url).remove("__1_0.distcp")
    results = _errors(url, "load")
    _assert_every_rank_names(results, url)
    assert any("__1_0.distcp" in msg and "missing" in msg for _, msg, _ in results)


def test_truncated_data_object(msc_store: MscStore, profile: str) -> None:
    url = msc_store.url(profile)
    run_distributed(_rank_save, 2, url)
    ckpt = CheckpointDir.of(url)
    data = ckpt.read_bytes("__0_0.distcp")
    ckpt.atomic_write("__0_0.distcp", data[: len(data) // 2])
    results = _errors(url, "load")
    _assert_every_rank_names(results, url)
    assert any("truncated" in msg or "short read" in msg for _, msg, _ in results)


def test_missing_metadata_is_incomplete(msc_store: MscStore, profile: str) -> None:
    url = msc_store.url(profile)
    run_distributed(_rank_save, 2, url)
    CheckpointDir.of(url).remove("metadata.json")
    results = _errors(url, "load")
    _assert_every_rank_names(results, url)


@pytest.mark.parametrize("action", ["save", "load"])
def test_refused_credentials(msc_store: MscStore, action: str) -> None:
    url = msc_store.url("s3-badcreds")
    results = _errors(url, action)
    _assert_every_rank_names(results, url)
    assert any("refused" in msg for _, msg, _ in results), results


@pytest.mark.parametrize("action", ["save", "load"])
def test_unreachable_endpoint_bounded_retry(
    msc_store: MscStore, action: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DIST_CKPT_MSC_ATTEMPTS", "2")
    monkeypatch.setenv("DIST_CKPT_MSC_RETRY_DELAY_S", "0.01")
    url = msc_store.url("s3-down")
    results = _errors(url, action)
    _assert_every_rank_names(results, url)
    assert any("after 2 attempt(s)" in msg for _, msg, _ in results), results
    assert max(seconds for _, _, seconds in results) < 60


def test_storage_access_error_is_an_oserror() -> None:
    assert issubclass(E.StorageAccessError, E.CheckpointingException)
    assert issubclass(E.StorageAccessError, OSError)


def test_other_url_schemes_are_unsupported() -> None:
    with pytest.raises(E.UnsupportedFeatureError, match="msc://profile/path"):
        CheckpointDir.of("s3://bucket/ckpt")


def test_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "multistorageclient", None)  # import fails
    with pytest.raises(E.MissingDependencyError, match=r"pip install dist_checkpointing\[msc\]"):
        dcp.load_common_state_dict("msc://s3/anything")
    with pytest.raises(ImportError):
        CheckpointDir.of("msc://s3/anything")
