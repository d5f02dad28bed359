"""Loads of part of a checkpoint's keys (pipeline stages), through the metadata of the
requested keys only (``FileSystemReader.read_metadata_of``).

Two or four ranks save a model of several stages (each rank one stage's layers, TP
row blocks of a shared embedding, one ShardedObject per stage); every rank then
loads another stage's layers, resharded, with and without ``verify_integrity``.
Every tensor is compared bit for bit with the full tensor built independently; each
rank's parsed metadata holds only its keys; strict modes that compare with the
checkpoint's keys still see all of them; a request for a key that is not stored names it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.engine.storage.location import CheckpointDir
from dist_checkpointing.engine.storage.reader import FileSystemReader
from dist_checkpointing.errors import KeyMismatchError
from dist_checkpointing.validation import StrictHandling
from tests.support.harness import run_distributed, world_sizes
from tests.support.layouts import same_bits

LAYERS = 6  # per stage


def _full(key: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(8, 6, generator=gen)


def _stage_keys(stage: int) -> list[str]:
    return [f"decoder.layers.{stage * LAYERS + i}.weight" for i in range(LAYERS)]


def _request(stage: int, fill: bool, replica: int = 0) -> dict[str, Any]:
    """Stage ``stage``'s layers (whole), this rank's row block of the embedding, the
    stage's object (replica ``replica``); data from the full tensors where ``fill``, else
    zeros."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for key in _stage_keys(stage):
        data = _full(key) if fill else torch.zeros(8, 6)
        out[key] = ShardedTensor.from_rank_offsets(key, data.clone(), replica_id=replica)
    emb = _full("embedding").chunk(world)[rank]
    out["embedding"] = ShardedTensor.from_rank_offsets(
        "embedding", emb.clone() if fill else torch.zeros_like(emb), (0, rank, world)
    )
    out["extra"] = ShardedObject(
        f"stage{stage}", {"stage": stage} if fill else None, (1,), (0,), replica_id=replica
    )
    return out


def _stage_loads(ckpt: str) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dcp.save(_request(rank, fill=True), ckpt, verify_integrity=True)
    other = (rank + 1) % world
    handle = CheckpointDir.of(ckpt)
    out = dcp.load(_request(other, fill=False), handle, verify_integrity=True)
    assert isinstance(out, dict)
    for key in _stage_keys(other):
        assert same_bits(out[key], _full(key)), key
    assert same_bits(out["embedding"], _full("embedding").chunk(world)[rank])
    assert out["extra"] == {"stage": other}
    part = handle.memoized(".metadata#part")
    assert handle.memoized(".metadata") is None and part is not None
    held = sorted(part.metadata.state_dict_metadata)
    # The items built (all of the part's here: the reads are most of them) are those
    # of the requested keys.
    built = {i.fqn for i in part.metadata.storage_data}
    assert built == {*_stage_keys(other), "embedding", f"stage{other}/shard_0_1"}
    # Strict modes that compare with the checkpoint's keys see all of them (same handle):
    # every rank requests stage 0 and a key that is not stored.
    request = _request(0, fill=False, replica=rank)
    request["gone"] = ShardedTensor.from_rank_offsets(
        "decoder.layers.999", torch.zeros(2), replica_id=rank
    )
    out, missing, unexpected = dcp.load(request, handle, strict=StrictHandling.RETURN_ALL)
    others = {k for s in range(1, world) for k in [*_stage_keys(s), f"stage{s}"]}
    assert missing == others and unexpected == {"decoder.layers.999"}, (missing, unexpected)
    assert same_bits(out[_stage_keys(0)[0]], _full(_stage_keys(0)[0]))
    with pytest.raises(KeyMismatchError, match="decoder.layers.999"):
        dcp.load(request, ckpt)  # the default mode: not stored, named
    return held


@world_sizes(2, 4)
def test_each_stage_reads_only_its_keys_metadata(tmp_path: Path, world_size: int) -> None:
    (tmp_path / "ckpt").mkdir()
    held = run_distributed(_stage_loads, world_size, str(tmp_path / "ckpt"), timeout=180)
    for rank, keys in enumerate(held):
        other = (rank + 1) % world_size
        assert keys == sorted([*_stage_keys(other), "embedding", f"stage{other}/shard_0_1"])


def _stage_only(stage: int, fill: bool) -> dict[str, Any]:
    """The request without the tensor every rank shares."""
    request = _request(stage, fill)
    del request["embedding"]
    return request


def _one_rank_fails_integrity(ckpt: str) -> str:
    rank = dist.get_rank()
    dcp.save(_stage_only(rank, fill=True), ckpt, verify_integrity=True)
    dist.barrier()
    if rank == 0:  # damage the files of rank 1's stage (only rank 1 reads them)
        for name in FileSystemReader(ckpt).files_of(set(_stage_keys(1))):
            path = Path(ckpt) / name
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
    dist.barrier()
    try:
        dcp.load(_stage_only(rank, fill=False), ckpt, verify_integrity=True)
    except Exception as exc:  # noqa: BLE001 - compared below
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_an_integrity_failure_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    """Each rank checks the files it reads: the rank whose file was damaged raises the
    digest error, the other a RankFailureError naming it, and neither waits forever."""
    (tmp_path / "ckpt").mkdir()
    out = run_distributed(_one_rank_fails_integrity, 2, str(tmp_path / "ckpt"), timeout=120)
    assert out[1].startswith("CorruptCheckpointError") and "integrity" in out[1], out
    assert out[0].startswith("RankFailureError") and "rank 1" in out[0], out
