"""A ``raw_bytes`` save strategy's layout reused for an unchanged structure
(``engine/raw/plan_reuse.py``): the same index and files as a fresh plan, with the new
data; anything structural changed, or data that no longer fits, plans afresh."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.engine.raw.load import read_index
from dist_checkpointing.engine.raw.pieces import IndexPiece
from dist_checkpointing.engine.raw.plan_reuse import LayoutCache
from dist_checkpointing.engine.raw.writer import RankWrite, plan_rank
from dist_checkpointing.engine.storage.location import CheckpointDir
from dist_checkpointing.strategies.raw_bytes import RawBytesSaveShardedStrategy


def _leaves(fill: float, rid: int = 1, payload: str = "abc") -> list[Any]:
    """Every kind of leaf a plan meets: grid blocks (one a transposed view), a flat
    range, an empty flat range, a bfloat16 0-d tensor, an object, a non-main replica."""
    full = torch.full((6, 4), fill)
    return [
        ShardedTensor.from_rank_offsets("grid", full[:3].clone(), (0, 0, 2)),
        ShardedTensor.from_rank_offsets("view", torch.full((4, 6), fill).t()),
        ShardedTensor.from_rank_offsets_flat(
            "flat", full.reshape(-1)[5:17].clone(), (6, 4), flattened_range=slice(5, 17)
        ),
        ShardedTensor.from_rank_offsets_flat(
            "empty", torch.zeros(0), (6, 4), flattened_range=slice(3, 3)
        ),
        ShardedTensor.from_rank_offsets("scalar", torch.tensor(fill, dtype=torch.bfloat16)),
        ShardedObject("obj", {"text": payload}, (1,), (0,)),
        ShardedTensor.from_rank_offsets("replica", full.clone(), replica_id=rid),
    ]


def _same(a: tuple[RankWrite, IndexPiece], b: tuple[RankWrite, IndexPiece]) -> None:
    (wa, pa), (wb, pb) = a, b
    assert wa.names == wb.names and wa.sizes == wb.sizes and wa.special == wb.special
    for fa, fb in zip(wa.items, wb.items, strict=True):
        assert [(o, n) for o, n, _ in fa] == [(o, n) for o, n, _ in fb]
        for (_, _, da), (_, _, db) in zip(fa, fb):
            assert da is db if isinstance(da, torch.Tensor) else da == db
    assert pa.files == pb.files and pa.file_sizes == pb.file_sizes
    assert pa.keys == pb.keys and pa.dtypes == pb.dtypes
    assert np.array_equal(pa.entries, pb.entries) and np.array_equal(pa.dims, pb.dims)
    assert len(pa.crcs) == len(pb.crcs) and not pa.crcs.any()


def test_an_unchanged_structure_reuses_the_layout_with_the_new_data() -> None:
    cache = LayoutCache()
    old = _leaves(1.0)
    first = cache.plan(old, "/a", 3, 2, 64, 4096, "t1")
    _same(first, plan_rank(old, "/a", 3, 2, 64, 4096, "t1"))
    new = _leaves(2.0)
    second = cache.plan(new, "/b", 3, 2, 64, 4096, "t2")
    assert cache.reused == 1
    # Another save's index piece: not the arrays the first one handed out.
    assert second[1].entries is not first[1].entries
    _same(second, plan_rank(new, "/b", 3, 2, 64, 4096, "t2"))


@pytest.mark.parametrize(
    "change",
    [
        "shape",
        "offset",
        "key",
        "dtype",
        "main replica",
        "object payload",
        "block size",
        "files",
        "dtype of data",
    ],
)
def test_a_changed_structure_plans_afresh(change: str) -> None:
    cache = LayoutCache()
    cache.plan(_leaves(1.0), "/a", 0, 2, 64, 4096)
    leaves = _leaves(2.0)
    files, block = 2, 4096
    if change == "shape":
        leaves[0] = ShardedTensor.from_rank_offsets("grid", torch.zeros(2, 4), (0, 0, 3))
    elif change == "offset":  # the same bytes, the other half of the tensor
        leaves[0] = ShardedTensor.from_rank_offsets("grid", torch.zeros(3, 4), (0, 1, 2))
    elif change == "key":
        leaves[0] = ShardedTensor.from_rank_offsets("other", torch.zeros(3, 4), (0, 0, 2))
    elif change == "dtype":  # the same bytes, another dtype
        leaves[0] = ShardedTensor.from_rank_offsets(
            "grid", torch.zeros(3, 4, dtype=torch.int32), (0, 0, 2)
        )
    elif change == "main replica":
        leaves = _leaves(2.0, rid=0)
    elif change == "object payload":
        leaves = _leaves(2.0, payload="x" * 1000)  # a payload of another length
    elif change == "block size":
        block = 1 << 20
    elif change == "files":
        files = 1
    if change == "dtype of data":
        leaves[0].data = torch.zeros(3, 4, dtype=torch.float16)  # replaced after construction
        with pytest.raises(ValueError, match=r"'grid'.*does not match its dtype"):
            cache.plan(leaves, "/b", 0, files, 64, block)
        assert cache.reused == 0
        return
    got = cache.plan(leaves, "/b", 0, files, 64, block)
    assert cache.reused == 0
    _same(got, plan_rank(leaves, "/b", 0, files, 64, block))


def _whole(fill: float) -> dict[str, Any]:
    """A one-rank state of every kind: whole tensors, a transposed view, a bfloat16 0-d
    tensor, a flat range covering its tensor, an object."""
    return {
        "grid": ShardedTensor.from_rank_offsets("grid", torch.full((6, 4), fill)),
        "view": ShardedTensor.from_rank_offsets("view", torch.full((4, 6), fill).t()),
        "flat": ShardedTensor.from_rank_offsets_flat(
            "flat", torch.full((24,), fill), (6, 4), flattened_range=slice(0, 24)
        ),
        "scalar": ShardedTensor.from_rank_offsets(
            "scalar", torch.tensor(fill, dtype=torch.bfloat16)
        ),
        "obj": ShardedObject("obj", {"fill": fill}, (1,), (0,)),
    }


def test_cached_saves_load_their_own_values(tmp_path: Path) -> None:
    """Three saves of one structure with ``cached_metadata``: the second and third reuse
    the layout, and each checkpoint loads its own values bit for bit."""
    strategy = RawBytesSaveShardedStrategy()
    strategy.use_cached_ckpt_structure = True  # as Megatron-LM turns it on
    for i in range(3):
        ckpt = tmp_path / f"c{i}"
        ckpt.mkdir()
        dc.save(_whole(i + 0.5), str(ckpt), sharded_strategy=strategy)
        expected = _whole(i + 0.5)
        request = _whole(-1.0)
        loaded = dc.load(request, str(ckpt))
        for k, sh in expected.items():
            got = loaded[k]
            assert got == sh.data if k == "obj" else torch.equal(got, sh.data), (i, k)
        assert len(read_index(CheckpointDir.of(str(ckpt))).entries) == 5
    assert strategy.cached_metadata and strategy.layout_cache.reused == 2
