"""The first and last checksum block of a large tensor item are shared with its zip
header and directory: a load completes their CRCs from the edges it already read, and a
damaged byte anywhere there is still found."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import ChecksumMismatchError, CorruptCheckpointError
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.support.harness import run_distributed

ELEMENTS = (3 << 20) // 4 + 7  # 3 MiB + 28 bytes of float32


def _request() -> dict[str, ShardedTensor]:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ELEMENTS))}


def _damage_each(root: str, thread: str) -> dict[str, str]:
    """Save once, then for bytes near the item's start, middle and end: flip it in a copy
    and load; what each load did, by offset."""
    os.environ["DIST_CKPT_CHECKSUM_THREAD"] = thread
    values = torch.arange(ELEMENTS, dtype=torch.float32)
    saved = Path(root) / "saved"
    saved.mkdir()
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", values.clone())}, saved, strategy)
    loaded = dc.load(_request(), saved)["w"]
    assert torch.equal(loaded, values)  # intact: bit-exact through the edge path
    size = (saved / "__0_0.distcp").stat().st_size
    outcome: dict[str, str] = {}
    for at in (3, 40, 100, 1000, size // 2, size - 1000, size - 100, size - 40, size - 3):
        copy = Path(root) / f"c{at}"
        shutil.copytree(saved, copy)
        data = bytearray((copy / "__0_0.distcp").read_bytes())
        data[at] ^= 0x04
        (copy / "__0_0.distcp").write_bytes(bytes(data))
        try:
            dc.load(_request(), copy)
            outcome[str(at)] = "loaded"
        except (ChecksumMismatchError, CorruptCheckpointError) as err:
            outcome[str(at)] = type(err).__name__
    return outcome


@pytest.mark.parametrize("thread", ["1", "0"], ids=["hashing-thread", "inline"])
def test_a_damaged_byte_in_an_edge_block_is_found(tmp_path: Path, thread: str) -> None:
    (outcome,) = run_distributed(_damage_each, 1, str(tmp_path), thread, timeout=120.0)
    assert "loaded" not in outcome.values(), outcome
