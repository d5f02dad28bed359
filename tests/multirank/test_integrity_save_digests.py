"""``save(..., verify_integrity=True)`` takes each data file's sha256 from the bytes its
writer wrote: the save does not read its data files back (in the trainer, where an
async save finalizes), and the manifest still holds the sha256 of every file as it is
on disk.

Two ranks save a mixed state (small and large tensors, so padded and packed items; a
dtype the fast item path does not take; empty blocks; objects; common state) in both
layouts, synchronously and through both async callers. Each rank records the files
``integrity.file_digest`` reads in its own (trainer) process. Checked: no data file is
read back at save; every manifest entry is the sha256 of the file read independently,
and every file of the checkpoint but the protocol's own is listed; a load with
``verify_integrity`` is bit-exact. A writer that reports no digest (a patched
``write_preloaded_data`` returning a plain list) makes the save read that file back,
with the same manifest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.engine.async_save import AsyncCallsQueue
from dist_checkpointing.engine.checkpoint import commit
from dist_checkpointing.engine.checkpoint.integrity import INTEGRITY_FNAME
from dist_checkpointing.engine.checkpoint.record import COMMIT_RECORD
from dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from tests.support.digests import recording_digests
from tests.support.harness import run_distributed
from tests.support.layouts import same_bits

pytestmark = pytest.mark.timeout(240)

LAYOUTS = [("torch_dist", 1), ("raw_bytes", 1)]
MODES = ["sync", "async", "persistent"]


def _full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(64, 1100, generator=gen),  # > 64 KiB per rank: aligned items
        "small": torch.randn(6, 3, generator=gen),
        "flags": torch.rand(8, 5, generator=gen) > 0.5,  # bool: not the fast item path
        "half": torch.randn(4, 2, generator=gen).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
    }


def _state(rank: int, world: int, zeros: bool = False) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for k, full in _full().items():
        block = full.chunk(world)[rank] if full.shape[0] else full
        block = torch.zeros_like(block) if zeros else block.clone()
        sd[k] = ShardedTensor.from_rank_offsets(k, block, (0, rank, world))
    sd["obj"] = ShardedObject("obj", {"rank": rank, "note": "x" * 300}, (world,), (rank,))
    sd["step"] = 12  # common state
    return sd


def _save(ckpt: str, layout: tuple[str, int], mode: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = _state(rank, world)
    if mode == "sync":
        dc.save(sd, ckpt, layout, verify_integrity=True)
        return
    queue = AsyncCallsQueue(persistent=mode == "persistent")
    request = dc.save(sd, ckpt, layout, verify_integrity=True, async_sharded_save=True)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()


def _rank_saves(ckpt: str, layout: tuple[str, int], mode: str) -> dict[str, Any]:
    seen = recording_digests()
    _save(ckpt, layout, mode)
    read_at_save = list(seen)
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = dc.get_default_save_sharded_strategy(*layout)
    data_files = {n for r in range(world) for n in strategy.files_written_by(ckpt, r)}
    loaded = dc.load(_state(rank, world, zeros=True), ckpt, verify_integrity=True)
    expected = _state(rank, world)
    bad = [k for k in _full() if not same_bits(loaded[k], expected[k].data)]
    if loaded["obj"] != expected["obj"].data or loaded["step"] != 12:
        bad.append("obj/step")
    return {"read_at_save": read_at_save, "data_files": data_files, "bad": bad}


def _check_manifest(ckpt: Path) -> dict[str, str]:
    """The manifest, each entry checked against the file read here; every file of the
    checkpoint but the protocol's own records is listed."""
    files = json.loads((ckpt / INTEGRITY_FNAME).read_text())["files"]
    for name, digest in files.items():
        assert hashlib.sha256((ckpt / name).read_bytes()).hexdigest() == digest, name
    protocol = {INTEGRITY_FNAME, commit.COMMIT_MARKER, COMMIT_RECORD}
    on_disk = {p.name for p in ckpt.iterdir() if p.is_file()} - protocol
    assert on_disk <= set(files), on_disk - set(files)
    return files


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x[0])
def test_the_save_reads_no_data_file_back_and_the_manifest_matches_the_disk(
    tmp_path: Path, layout: tuple[str, int], mode: str
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    out = run_distributed(_rank_saves, 2, str(ckpt), layout, mode)
    files = _check_manifest(ckpt)
    data_files = out[0]["data_files"]
    assert data_files and data_files <= set(files)
    for rank in range(2):
        assert out[rank]["bad"] == []
        assert not set(out[rank]["read_at_save"]) & data_files, out[rank]["read_at_save"]


def _plain_list(bucket: Any, fs: Any, sync_files: bool) -> Any:
    from dist_checkpointing.engine.storage import write_workers

    return list(write_workers.write_bucket_file(bucket, fs, sync_files))


def _rank_saves_without_writer_digests(ckpt: str) -> list[str]:
    FileSystemWriterAsync.write_preloaded_data = staticmethod(_plain_list)  # type: ignore[method-assign]
    seen = recording_digests()
    dc.save(_state(dist.get_rank(), dist.get_world_size()), ckpt, verify_integrity=True)
    return seen


def test_a_writer_without_digests_has_its_files_read_back(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    seen = run_distributed(_rank_saves_without_writer_digests, 2, str(ckpt))
    files = _check_manifest(ckpt)
    data = {n for n in files if n.endswith(".distcp")}
    assert len(data) >= 2
    assert data <= set(seen[0]) | set(seen[1])  # read back, each by the rank that wrote it


def _rank_saves_fully_parallel(ckpt: str) -> dict[str, Any]:
    """Every rank holds every tensor whole; the fully parallel wrapper spreads the writing."""
    from dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    seen = recording_digests()
    rank = dist.get_rank()
    state = {
        k: ShardedTensor.from_rank_offsets(k, v.clone(), replica_id=rank)
        for k, v in _full().items()
    }
    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    dc.save(state, ckpt, strategy, verify_integrity=True)
    read_at_save = list(seen)
    data_files = {n for r in range(2) for n in strategy.files_written_by(ckpt, r)}
    return {"read_at_save": read_at_save, "data_files": data_files}


def test_the_fully_parallel_wrapper_takes_the_writers_digests_too(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    out = run_distributed(_rank_saves_fully_parallel, 2, str(ckpt))
    files = _check_manifest(ckpt)
    data_files = out[0]["data_files"]
    assert len(data_files) >= 2 and data_files <= set(files)
    for rank in range(2):
        assert not set(out[rank]["read_at_save"]) & data_files, out[rank]["read_at_save"]
