"""Streamed GETs of ``msc://`` data files (:mod:`dist_checkpointing.engine.storage.msc_stream`).

Run against the ``s3open`` profile: a moto server that serves presigned GETs, so each
rank's reads of a data file are one streamed GET whose body lands in the tensors.
(The ``s3`` profile's server refuses presigned requests: every other msc suite reads
through MSC there, after the one warning.)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.storage.location import CheckpointDir
from tests.support.harness import run_distributed
from tests.support.layouts import TensorSpec, grid_layout, load_specs, loaded_mismatches, save_specs
from tests.support.msc_server import MscStore

pytest.importorskip("multistorageclient")
pytest.importorskip("moto")

PROFILE = "s3open"


def _ref(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    return torch.randn(64, 1024, generator=gen)  # 256 KiB each: several checksum blocks


def _state(fill: bool = True) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for n in range(6):
        local = _ref(n).chunk(world)[rank]
        local = local if fill else torch.zeros_like(local)
        out[f"t{n}"] = ShardedTensor.from_rank_offsets(f"t{n}", local, (0, rank, world))
    return out


@contextlib.contextmanager
def _data_file_requests(ours: str, s3_operation: str) -> Iterator[tuple[list[str], list[str]]]:
    """``(presigned, plain)``: the data files this rank sends our presigned request
    ``msc_stream.<ours>`` for, and those it sends botocore's ``s3_operation`` for."""
    import botocore.client

    from dist_checkpointing.engine.storage import msc_stream

    presigned: list[str] = []
    plain: list[str] = []
    original, call = getattr(msc_stream, ours), botocore.client.BaseClient._make_api_call

    def counting(*args: Any) -> Any:
        # _send(key, target, headers) / _put(client, path, url, data)
        where = args[1].split("?", 1)[0]
        presigned.append(where.rsplit("/", 1)[-1])
        return original(*args)

    def counting_call(client: Any, operation: str, params: Any) -> Any:
        if operation == s3_operation and ".distcp" in str(params.get("Key")):
            plain.append(str(params["Key"]).rsplit("/", 1)[-1])
        return call(client, operation, params)

    setattr(msc_stream, ours, counting)
    botocore.client.BaseClient._make_api_call = counting_call  # type: ignore[method-assign]
    try:
        yield presigned, plain
    finally:
        setattr(msc_stream, ours, original)
        botocore.client.BaseClient._make_api_call = call  # type: ignore[method-assign]


def _load_counting(url: str, env: dict[str, str]) -> dict[str, Any]:
    """Load, counting this rank's streamed GETs and botocore GETs of data files."""
    os.environ.update(env)
    with _data_file_requests("_send", "GetObject") as (streamed, plain):
        out = dcp.load(_state(fill=False), url)
    assert isinstance(out, dict)
    rank, world = dist.get_rank(), dist.get_world_size()
    same = all(torch.equal(out[f"t{n}"], _ref(n).chunk(world)[rank]) for n in range(6))
    return {"same": same, "streamed": streamed, "plain": plain}


def _save(url: str) -> None:
    dcp.save(_state(), url)


@pytest.mark.parametrize("stream", ["1", "0"])
def test_each_data_file_is_one_streamed_get(msc_store: MscStore, stream: str) -> None:
    url = msc_store.url(PROFILE)
    run_distributed(_save, 2, url, timeout=120.0)
    env = {"DIST_CKPT_MSC_PRESIGNED": stream}
    results = run_distributed(_load_counting, 2, url, env, timeout=120.0)
    for rank, res in enumerate(results):
        assert res["same"], rank
        if stream == "0":  # MSC's whole reads instead
            assert res["streamed"] == [] and len(res["plain"]) == len(set(res["plain"])) > 0
            continue
        # One GET per data file this rank reads, all streamed: items in offset order,
        # each read from inside the bytes just streamed, nothing fetched twice.
        assert res["plain"] == [], res
        assert len(res["streamed"]) == len(set(res["streamed"])) > 0, res


def _specs(world_size: int, fragm: tuple[int, int]) -> list[TensorSpec]:
    return [
        TensorSpec(
            f"w_{str(d).removeprefix('torch.')}", (40, 36), d, grid_layout(fragm, world_size)
        )
        for d in (torch.float32, torch.bfloat16, torch.int64, torch.uint8)
    ]


def test_streamed_resharding_2_to_4_to_1(msc_store: MscStore) -> None:
    first, second = msc_store.url(PROFILE, "two"), msc_store.url(PROFILE, "four")
    run_distributed(save_specs, 2, first, _specs(2, (2, 1)), timeout=120.0)
    specs4 = _specs(4, (1, 4))  # every rank reads a strip of every item: ranged GETs
    assert loaded_mismatches(run_distributed(load_specs, 4, first, specs4), specs4) == []
    run_distributed(save_specs, 4, second, specs4, timeout=120.0)
    specs1 = _specs(1, (1, 1))
    assert loaded_mismatches(run_distributed(load_specs, 1, second, specs1), specs1) == []


def _load_error(url: str) -> tuple[str, str]:
    try:
        dcp.load(_state(fill=False), url)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc)
    return "", ""


def _damage(url: str, how: str) -> None:
    ckpt = CheckpointDir.of(url)
    name = "__1_0.distcp"
    data = bytearray(ckpt.read_bytes(name))
    if how == "missing":
        ckpt.remove(name)
    elif how == "truncated":
        ckpt.atomic_write(name, bytes(data[: len(data) // 2]))
    else:  # a flipped bit in the middle of the first tensor's bytes
        data[len(data) // 12] ^= 0x10
        ckpt.atomic_write(name, bytes(data))


@pytest.mark.parametrize(
    ("how", "kind", "words"),
    [
        ("missing", "CorruptCheckpointError", "missing"),
        ("truncated", "CorruptCheckpointError", "truncated"),
        ("flipped", "ChecksumMismatchError", "checksum mismatch"),
    ],
)
def test_streamed_damage_is_reported_on_every_rank(
    msc_store: MscStore, how: str, kind: str, words: str
) -> None:
    url = msc_store.url(PROFILE)
    run_distributed(_save, 2, url, timeout=120.0)
    _damage(url, how)
    results = run_distributed(_load_error, 2, url, timeout=120.0)
    assert {k for k, _ in results} <= {kind, "RankFailureError"}, results
    assert any(k == kind and words in msg and "__1_0.distcp" in msg for k, msg in results), results
    assert all(url in msg for _, msg in results), results


def _save_counting(url: str, env: dict[str, str]) -> dict[str, Any]:
    """Save, counting this rank's presigned PUTs and botocore PUTs of data files."""
    os.environ.update(env)
    with _data_file_requests("_put", "PutObject") as (presigned, plain):
        dcp.save(_state(), url)
    return {"presigned": presigned, "plain": plain}


@pytest.mark.parametrize("presign", ["1", "0"])
def test_each_data_file_is_one_presigned_put(msc_store: MscStore, presign: str) -> None:
    url = msc_store.url(PROFILE)
    env = {"DIST_CKPT_MSC_PRESIGNED": presign}
    results = run_distributed(_save_counting, 2, url, env, timeout=120.0)
    for res in results:
        data_files = res["presigned"] if presign == "1" else res["plain"]
        assert len(data_files) == len(set(data_files)) > 0, res
        assert all(".distcp" in name for name in data_files), res
        assert res["plain" if presign == "1" else "presigned"] == [], res
    # What was uploaded is what loads, bit for bit (the reads stream too).
    loaded = run_distributed(_load_counting, 2, url, {}, timeout=120.0)
    assert all(r["same"] for r in loaded)


def _async_roundtrip(url: str, persistent: bool) -> bool:
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

    queue = AsyncCallsQueue(persistent=persistent)
    request = dcp.save(_state(), url, async_sharded_save=True)
    assert isinstance(request, AsyncRequest)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    out = dcp.load(_state(fill=False), url)
    assert isinstance(out, dict)
    rank, world = dist.get_rank(), dist.get_world_size()
    return all(torch.equal(out[f"t{n}"], _ref(n).chunk(world)[rank]) for n in range(6))


@pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
def test_async_save_uploads_from_the_writer_processes(
    msc_store: MscStore, persistent: bool
) -> None:
    """The writer processes (forked) send presigned PUTs over connections of their own."""
    url = msc_store.url(PROFILE)
    assert run_distributed(_async_roundtrip, 2, url, persistent, timeout=120.0) == [True, True]
