"""``msc://`` checkpoints through multi-storage-client, against a real S3-protocol server.

Every test runs on two MSC profiles (:mod:`tests.support.msc_server`): ``s3`` (moto's
threaded S3 server on 127.0.0.1) and ``local`` (a posix profile). Ranks are real processes
(:mod:`tests.support.harness`); they find the profiles through ``MSC_CONFIG``.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.engine.checkpoint import integrity
from dist_checkpointing.engine.storage.location import CheckpointDir
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from tests.support.harness import run_distributed
from tests.support.layouts import (
    TensorSpec,
    grid_layout,
    load_specs,
    loaded_mismatches,
    same_bits,
    save_specs,
)
from tests.support.msc_server import PROFILES, MscStore

pytest.importorskip("multistorageclient")
pytest.importorskip("moto")

SHAPE = (8, 12)
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)


@pytest.fixture(params=PROFILES)
def profile(request: pytest.FixtureRequest, msc_store: MscStore) -> str:
    return str(request.param)


def _specs(world_size: int, fragm: tuple[int, int]) -> list[TensorSpec]:
    return [
        TensorSpec(f"w_{str(d).removeprefix('torch.')}", SHAPE, d, grid_layout(fragm, world_size))
        for d in DTYPES
    ]


# ----------------------------------------------------------------------------- round trip


def _ref(key: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(6, 4, generator=gen)


def _state(rank: int, world: int, fill: bool = True) -> dict[str, Any]:
    ref = _ref("a")
    local = ref.chunk(world)[rank] if fill else torch.zeros_like(ref.chunk(world)[rank])
    return {
        "a": ShardedTensor.from_rank_offsets("a", local, (0, rank, world)),
        "obj": ShardedObject("obj", {"rank": rank} if fill else None, (world,), (rank,)),
        "common": {"step": 7, "blob": b"\x00\xff" * 10},
    }


def _rank_roundtrip(url: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dcp.save(_state(rank, world), url, content_metadata={"it": 3})
    out = dcp.load(_state(rank, world, fill=False), url)
    assert isinstance(out, dict)
    return {
        "same": same_bits(out["a"], _ref("a").chunk(world)[rank]),
        "obj": out["obj"],
        "common": out["common"],
        "content": dcp.load_content_metadata(url),
        "tensors": sorted(dcp.load_tensors_metadata(url)),
        "sharded": sorted(dcp.load_sharded_metadata(url)),
        "plain": same_bits(dcp.load_plain_tensors(url)["a"], _ref("a")),
        "common_sd": dcp.load_common_state_dict(url)["common"],
        "verify": dcp.verify(url),  # split over both ranks
    }


def test_roundtrip_byte_exact(msc_store: MscStore, profile: str) -> None:
    url = msc_store.url(profile)
    results = run_distributed(_rank_roundtrip, 2, url, timeout=120.0)
    for rank, res in enumerate(results):
        assert res["same"] and res["plain"]
        assert res["obj"] == {"rank": rank}
        assert res["common"] == {"step": 7, "blob": b"\x00\xff" * 10} == res["common_sd"]
        assert res["content"] == {"it": 3}
        assert res["tensors"] == ["a"]
        assert res["sharded"] == ["a", "obj/shard_0_2", "obj/shard_1_2"]
        assert res["verify"].ok and res["verify"].checksums == "verified"
    names = set(CheckpointDir.of(url).listdir())
    assert {".metadata", "metadata.json", "common.pt", "__0_0.distcp", "__1_0.distcp"} <= names
    assert "commit.json" in names and not any(n.endswith(".pending") for n in names)
    assert results[0]["verify"] == results[1]["verify"]


@pytest.mark.parametrize("layout", [("torch_dist", 1), ("raw_bytes", 1)], ids=lambda x: x[0])
def test_load_verify_integrity(msc_store: MscStore, profile: str, layout: tuple[str, int]) -> None:
    url = msc_store.url(profile, layout[0])
    state = {"a": ShardedTensor.from_rank_offsets("a", _ref("a"))}
    dcp.save(state, url, layout, verify_integrity=True)
    ckpt = CheckpointDir.of(url)  # the writers' digests are those of the stored objects
    manifest = integrity.read_manifest(ckpt)
    assert manifest and all(integrity.file_digest(ckpt, n) == d for n, d in manifest.items())
    out = dcp.load(
        {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(6, 4))}, url, verify_integrity=True
    )
    assert isinstance(out, dict) and same_bits(out["a"], _ref("a"))


# ----------------------------------------------------------------------------- resharding


@pytest.mark.parametrize("backend", ["torch_dist", "raw_bytes"])
def test_resharding_2_to_4_to_1(msc_store: MscStore, profile: str, backend: str) -> None:
    # raw_bytes: the column blocks are staged reads, read in order from the stream
    first = msc_store.url(profile, f"two-{backend}")
    second = msc_store.url(profile, f"four-{backend}")
    run_distributed(save_specs, 2, first, _specs(2, (2, 1)), backend, timeout=120.0)
    specs4 = _specs(4, (1, 4))
    results = run_distributed(load_specs, 4, first, specs4, timeout=120.0)
    assert loaded_mismatches(results, specs4) == []
    run_distributed(save_specs, 4, second, specs4, backend, timeout=120.0)
    specs1 = _specs(1, (1, 1))
    results = run_distributed(load_specs, 1, second, specs1, timeout=120.0)
    assert loaded_mismatches(results, specs1) == []


def test_parallel_ranged_reads_and_prefetch(
    msc_store: MscStore, profile: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = msc_store.url(profile)
    specs = _specs(2, (2, 1))
    run_distributed(save_specs, 2, url, specs, timeout=120.0)
    monkeypatch.setenv("DIST_CKPT_MSC_READ_CHUNK_BYTES", "64")  # many ranged GETs per item
    monkeypatch.setenv("DIST_CKPT_MSC_READ_THREADS", "3")
    monkeypatch.setenv("DIST_CKPT_MSC_READ_AHEAD", "2")
    specs4 = _specs(4, (4, 1))
    assert loaded_mismatches(run_distributed(load_specs, 4, url, specs4), specs4) == []
    monkeypatch.setenv("DIST_CKPT_MSC_PREFETCH_WHOLE_FILES", "1")
    assert loaded_mismatches(run_distributed(load_specs, 4, url, specs4), specs4) == []


# ----------------------------------------------------------------------------- async save


def _rank_async(url: str, persistent: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    queue = AsyncCallsQueue(persistent=persistent)
    request = dcp.save(_state(rank, world), url, async_sharded_save=True)
    assert isinstance(request, AsyncRequest)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    out = dcp.load(_state(rank, world, fill=False), url)
    assert isinstance(out, dict)
    return {"same": same_bits(out["a"], _ref("a").chunk(world)[rank]), "obj": out["obj"]}


@pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
def test_async_save(msc_store: MscStore, profile: str, persistent: bool) -> None:
    url = msc_store.url(profile)
    results = run_distributed(_rank_async, 2, url, persistent, timeout=120.0)
    assert [r["same"] for r in results] == [True, True]
    assert [r["obj"] for r in results] == [{"rank": 0}, {"rank": 1}]


# ----------------------------------------------------------------------------- remove


def test_remove_sharded_tensors(msc_store: MscStore, profile: str) -> None:
    url = msc_store.url(profile)
    state = {
        "model.a": ShardedTensor.from_rank_offsets("model.a", _ref("a")),
        "opt.m": ShardedTensor.from_rank_offsets("opt.m", _ref("m")),
    }
    assert not dcp.check_is_distributed_checkpoint(url)
    dcp.save(state, url)
    assert dcp.check_is_distributed_checkpoint(url)
    dcp.remove_sharded_tensors(url, "opt.")
    assert set(dcp.load_tensors_metadata(url)) == {"model.a"}
    plain = dcp.load_plain_tensors(url)
    assert set(plain) == {"model.a"} and same_bits(plain["model.a"], _ref("a"))


def test_object_bytes_are_the_local_bytes(msc_store: MscStore, profile: str) -> None:
    """A checkpoint saved to msc:// holds the same data file a local save writes."""
    url = msc_store.url(profile)
    state = {"a": ShardedTensor.from_rank_offsets("a", _ref("a"))}
    dcp.save(state, url)
    ckpt = CheckpointDir.of(url)
    data = ckpt.read_bytes("__0_0.distcp")
    with ckpt.open_read("__0_0.distcp") as stream:
        stream.seek(3)
        part = bytearray(10)
        assert stream.readinto(part) == 10
    assert bytes(part) == data[3:13] and ckpt.size("__0_0.distcp") == len(data)
    buf = io.BytesIO(data)
    assert buf.getbuffer().nbytes > _ref("a").nbytes


# ----------------------------------------------------------------------------- interrupted


def _rank_interrupted_save(url: str) -> tuple[str, list[str]]:
    """Rank 1's data upload fails: the save fails everywhere and commits nothing."""
    from dist_checkpointing.engine.storage import msc

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 1:

        def fail(self: Any) -> None:
            raise ConnectionError(f"simulated interruption of the upload of {self.url}")

        msc.UploadStream._upload = fail  # type: ignore[method-assign]
    try:
        dcp.save(_state(rank, world), url)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = type(exc).__name__
    else:
        error = ""
    dist.barrier()
    return error, CheckpointDir.of(url).listdir()


def test_interrupted_upload_never_looks_complete(msc_store: MscStore, profile: str) -> None:
    url = msc_store.url(profile)
    results = run_distributed(_rank_interrupted_save, 2, url, timeout=120.0)
    assert all(error for error, _ in results), results
    for _, names in results:
        assert not {".metadata", "metadata.json"} & set(names), names
    with pytest.raises(FileNotFoundError):  # CheckpointNotFound / IncompleteCheckpoint
        dcp.load_common_state_dict(url)


def test_failed_write_uploads_nothing_and_spooled_upload(
    msc_store: MscStore, profile: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = CheckpointDir.of(msc_store.url(profile))
    with pytest.raises(RuntimeError), ckpt.fs.open_write(ckpt.path("partial")) as stream:
        stream.write(b"x" * 100)
        raise RuntimeError("writer failed")
    assert not ckpt.has("partial")
    # Past the in-memory spool: the file goes through a local temporary file (upload_file).
    monkeypatch.setenv("DIST_CKPT_MSC_WRITE_SPOOL_BYTES", "1000")
    data = bytes(range(256)) * 40
    with ckpt.fs.open_write(ckpt.path("big")) as stream:
        for i in range(0, len(data), 999):
            assert stream.write(data[i : i + 999]) == len(data[i : i + 999])
        assert stream.tell() == len(data)
    assert ckpt.read_bytes("big") == data
    assert ckpt.listdir() == ["big"]
    ckpt.remove("big")
    assert not ckpt.has("big") and not ckpt.fs.is_dir(ckpt.root)
