"""Irregular (non-grid) sharding: ShardedTensors with ``axis_fragmentations=None``.

Megatron-Core 0.16+ saves distributed-optimizer state this way ('dp_reshardable'):
one flat buffer per TP shard, each DP rank owning an arbitrary contiguous range.
These tests save such layouts (1-D and N-D), check the sharding validation, load
them into other irregular ranges, regular grids and whole tensors (and regular
into irregular), compare every value with the tensor built independently, and
exchange checkpoints of this form with plain ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import MappingError, ShardingError
from dist_checkpointing.strategies.torch import sharded_tensor_to_torch_sharded_tensor
from tests.support.harness import run_distributed, world_sizes

TIMEOUT_S = 90.0
N = 60  # 1-D buffer length, divisible by 1..4 for the regular layouts


def _full(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(int(torch.Size(shape).numel()), dtype=torch.float32).reshape(shape) * 0.5


def irregular(
    key: str, full: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...], **kw: Any
) -> ShardedTensor:
    """The block ``[offsets, offsets + sizes)`` of ``full``, on no grid."""
    block = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()
    return ShardedTensor(key, block, block.dtype, sizes, tuple(full.shape), offsets, None, **kw)


def _cuts(world: int, variant: int) -> list[int]:
    table = {
        1: [[0, N]],
        2: [[0, 23, N], [0, 41, N]],
        4: [[0, 7, 31, 40, N], [0, 19, 20, 52, N]],
    }
    return table[world][variant]


def _load_1d(ckpt: str) -> dict[str, bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = _full((N,))
    save_cuts, load_cuts = _cuts(world, 0), _cuts(world, -1)
    a, b = save_cuts[rank], save_cuts[rank + 1]
    dcp.save({"buf": irregular("buf", full, (a,), (b - a,))}, ckpt)
    out: dict[str, bool] = {}
    c, d = load_cuts[rank], load_cuts[rank + 1]
    request = irregular("buf", torch.zeros(N), (c,), (d - c,))
    out["other ranges"] = torch.equal(dcp.load({"buf": request}, ckpt)["buf"], full[c:d])  # type: ignore[index]
    rows = N // world
    grid = ShardedTensor.from_rank_offsets("buf", torch.zeros(rows), (0, rank, world))
    loaded = dcp.load({"buf": grid}, ckpt)["buf"]  # type: ignore[index]
    out["regular grid"] = torch.equal(loaded, full[rank * rows : (rank + 1) * rows])
    out["whole"] = torch.equal(dcp.load_plain_tensors(ckpt)["buf"], full)
    return out


@world_sizes(1, 2, 4)
def test_irregular_ranges_reshard_every_way(tmp_path: Path, world_size: int) -> None:
    for checks in run_distributed(_load_1d, world_size, str(tmp_path), timeout=TIMEOUT_S):
        assert checks == {"other ranges": True, "regular grid": True, "whole": True}


BOXES_2D = [((0, 0), (4, 7)), ((0, 7), (4, 3)), ((4, 0), (2, 5)), ((4, 5), (2, 5))]


def _load_2d(ckpt: str) -> dict[str, bool]:
    rank = dist.get_rank()
    full = _full((6, 10))
    # Regular 2x2 grid of (3, 5) blocks saved; irregular boxes loaded, and back.
    grid = ShardedTensor.from_rank_offsets(
        "w",
        full[(rank // 2) * 3 : (rank // 2) * 3 + 3, (rank % 2) * 5 : (rank % 2) * 5 + 5].clone(),
        (0, rank // 2, 2),
        (1, rank % 2, 2),
    )
    dcp.save({"w": grid, "v": irregular("v", full, *BOXES_2D[rank])}, ckpt)
    offsets, sizes = BOXES_2D[3 - rank]
    want = full[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
    request = {
        "w": irregular("w", torch.zeros(6, 10), offsets, sizes),
        "v": ShardedTensor.from_rank_offsets(
            "v", torch.zeros(3, 5), (0, rank // 2, 2), (1, rank % 2, 2)
        ),
    }
    loaded = dcp.load(request, ckpt)
    regular = full[(rank // 2) * 3 : (rank // 2) * 3 + 3, (rank % 2) * 5 : (rank % 2) * 5 + 5]
    return {
        "regular -> irregular": torch.equal(loaded["w"], want),  # type: ignore[index]
        "irregular -> regular": torch.equal(loaded["v"], regular),  # type: ignore[index]
        "whole": torch.equal(dcp.load_plain_tensors(ckpt)["v"], full),
    }


def test_irregular_nd_boxes(tmp_path: Path) -> None:
    for checks in run_distributed(_load_2d, 4, str(tmp_path), timeout=TIMEOUT_S):
        assert all(checks.values()), checks


def _bad_cover(ckpt: str, cuts: list[tuple[int, int]]) -> str:
    a, b = cuts[dist.get_rank()]
    try:
        dcp.save({"buf": irregular("buf", _full((N,)), (a,), (b - a,))}, ckpt)
    except ShardingError as e:
        return str(e)
    return ""


@pytest.mark.parametrize(
    ("cuts", "expected"),
    [
        (
            [(0, 23), (20, N)],
            "'buf': main replicas overlap at [20:23] (rank 0 block [0:23], rank 1",
        ),
        ([(0, 20), (23, N)], "'buf': 3 of 60 elements are not covered (within region [20:23])"),
    ],
    ids=["overlap", "gap"],
)
def test_irregular_cover_is_checked_exactly(tmp_path: Path, cuts: Any, expected: str) -> None:
    for message in run_distributed(_bad_cover, 2, str(tmp_path), cuts, timeout=TIMEOUT_S):
        assert expected in message


def test_irregular_block_outside_the_tensor_and_off_grid_flat_ranges_are_refused() -> None:
    outside = torch.zeros(20)
    with pytest.raises(MappingError, match="'buf'.*exceeds the global size 60"):
        ShardedTensor("buf", outside, outside.dtype, (20,), (N,), (50,), None)
    with pytest.raises(MappingError, match="'buf'.*blocks must lie on a regular grid"):
        irregular("buf", _full((N,)), (10,), (20,), flattened_range=slice(0, 5))


# ----------------------------------------------------------------------------- properties


def _split(draw: Any, length: int, max_parts: int) -> list[int]:
    inner = (
        draw(st.sets(st.integers(1, length - 1), max_size=max_parts - 1)) if length > 1 else set()
    )
    return [0, *sorted(inner), length]


@st.composite
def _layouts(draw: Any) -> tuple[tuple[int, int], list[int], list[int], list[int], list[int]]:
    shape = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    return (
        shape,
        _split(draw, shape[0], 4),
        _split(draw, shape[1], 3),
        _split(draw, shape[0], 4),
        _split(draw, shape[1], 3),
    )


def _pieces(key: str, full: torch.Tensor, rows: list[int], cols: list[int]) -> dict[str, Any]:
    out = {}
    for i in range(len(rows) - 1):
        for j in range(len(cols) - 1):
            offsets = (rows[i], cols[j])
            sizes = (rows[i + 1] - rows[i], cols[j + 1] - cols[j])
            out[f"{key}.{i}.{j}"] = irregular(key, full, offsets, sizes)
    return out


@settings(max_examples=25, deadline=None)
@given(_layouts())
def test_random_irregular_layouts_round_trip(layout: Any) -> None:
    """One process holds every piece: save one irregular split, load another."""
    shape, rows, cols, load_rows, load_cols = layout
    full = _full(shape)
    with tempfile.TemporaryDirectory() as ckpt:
        dcp.save(_pieces("t", full, rows, cols), ckpt)
        request = _pieces("t", torch.zeros(shape), load_rows, load_cols)
        loaded = dcp.load(request, ckpt)
        for name, sh in request.items():
            block = full[sh.global_slice()]
            assert torch.equal(loaded[name], block), (layout, name)  # type: ignore[index]


# ----------------------------------------------------------------------------- plain DCP


def _ours_to_plain_dcp(ckpt: str, out: str) -> None:
    rank = dist.get_rank()
    cuts = _cuts(2, 0)
    full = _full((N,))
    dcp.save({"buf": irregular("buf", full, (cuts[rank],), (cuts[rank + 1] - cuts[rank],))}, ckpt)
    dist.barrier()
    if rank == 0:
        dcp_to_torch_save(ckpt, out)  # plain torch, no dist_checkpointing involved


def test_plain_dcp_reads_our_irregular_checkpoint(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "whole.pt"
    ckpt.mkdir()
    run_distributed(_ours_to_plain_dcp, 2, str(ckpt), str(out), timeout=TIMEOUT_S)
    whole = torch.load(out, weights_only=True)
    assert torch.equal(whole["buf"], _full((N,)))


def _plain_dcp_writes_irregular(ckpt: str) -> bool:
    """A checkpoint laid out as Megatron-Core 0.19 lays out 'dp_reshardable' state,
    written by plain DCP (torch ShardedTensors at irregular offsets), then read by us."""
    rank = dist.get_rank()
    cuts = _cuts(2, 0)
    full = _full((N,))
    local = irregular("buf", full, (cuts[rank],), (cuts[rank + 1] - cuts[rank],))
    torch_dcp.save({"buf": sharded_tensor_to_torch_sharded_tensor([local])}, checkpoint_id=ckpt)
    if rank == 0:
        torch.save({}, Path(ckpt) / "common.pt")
        (Path(ckpt) / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    dist.barrier()
    rows = N // 2
    request = ShardedTensor.from_rank_offsets("buf", torch.zeros(rows), (0, rank, 2))
    loaded = dcp.load({"buf": request}, ckpt)["buf"]  # type: ignore[index]
    return torch.equal(loaded, full[rank * rows : (rank + 1) * rows])


def test_irregular_checkpoint_written_by_plain_dcp_loads(tmp_path: Path) -> None:
    assert run_distributed(_plain_dcp_writes_irregular, 2, str(tmp_path), timeout=TIMEOUT_S) == [
        True,
        True,
    ]
