"""Resharding: save under one parallel layout, load under another (other world sizes too).

Each test saves deterministic reference tensors (``tests.support.layouts``) with one
``run_distributed`` call and loads them with another; every loaded shard is compared
byte for byte with the slice of the reference tensor it describes, computed
independently of the library.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from tests.support.harness import run_distributed
from tests.support.layouts import (
    Layout,
    TensorSpec,
    deal,
    even_cuts,
    flat_layout,
    flat_shards,
    grid_layout,
    load_specs,
    loaded_mismatches,
    pack,
    poison,
    reference_tensor,
    replicated_layout,
    same_bits,
    save_specs,
    unpack,
)

SHAPE = (8, 12)
DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def _specs(name: str, layout_of: Callable[[tuple[int, ...]], Layout]) -> list[TensorSpec]:
    """One spec of shape SHAPE per dtype, all in the layout ``layout_of(SHAPE)``."""
    return [
        TensorSpec(f"{name}_{str(dtype).removeprefix('torch.')}", SHAPE, dtype, layout_of(SHAPE))
        for dtype in DTYPES
    ]


def _save_then_load(
    ckpt_dir: Path,
    save: tuple[int, list[TensorSpec]],
    *loads: tuple[int, list[TensorSpec]],
) -> None:
    """Save ``save = (world_size, specs)``, then check each ``(world_size, specs)`` load."""
    run_distributed(save_specs, save[0], ckpt_dir, save[1])
    for world_size, specs in loads:
        results = run_distributed(load_specs, world_size, ckpt_dir, specs)
        assert loaded_mismatches(results, specs) == [], f"loading on {world_size} ranks"


def _grid(fragm: tuple[int, ...], world_size: int) -> Callable[[tuple[int, ...]], Layout]:
    return lambda shape: grid_layout(fragm, world_size)


def _flat(
    fragm: tuple[int, ...], cuts: list[list[int]], world_size: int
) -> Callable[[tuple[int, ...]], Layout]:
    return lambda shape: flat_layout(shape, fragm, cuts, world_size)


# ---------------------------------------------------------------------------- regular grids


def test_tp2_to_tp4_and_tp1(tmp_path: Path) -> None:
    # Half of the tensors split on axis 0, half on axis 1; loaded split on the other axis too.
    saved = _specs("row", _grid((2, 1), 2)) + _specs("col", _grid((1, 2), 2))
    tp4 = _specs("row", _grid((4, 1), 4)) + _specs("col", _grid((1, 4), 4))
    tp4_other_axis = _specs("row", _grid((1, 4), 4)) + _specs("col", _grid((4, 1), 4))
    whole = _specs("row", _grid((1, 1), 1)) + _specs("col", _grid((1, 1), 1))
    _save_then_load(tmp_path, (2, saved), (4, tp4), (4, tp4_other_axis), (1, whole))


def test_2x2_grid_to_1x4_4x1_and_whole(tmp_path: Path) -> None:
    saved = _specs("w", _grid((2, 2), 4))
    _save_then_load(
        tmp_path,
        (4, saved),
        (4, _specs("w", _grid((1, 4), 4))),
        (4, _specs("w", _grid((4, 1), 4))),
        (1, _specs("w", _grid((1, 1), 1))),
    )


def test_whole_replicated_to_grid(tmp_path: Path) -> None:
    # Every rank saves the whole tensor (only replica 0 is written), loaded TP-split.
    saved = _specs("rep", lambda shape: replicated_layout(len(shape), 2))
    _save_then_load(tmp_path, (2, saved), (2, _specs("rep", _grid((2, 2), 2))))


# ---------------------------------------------------------------------------- flat ranges

# TP blocks of SHAPE split (2, 1): 4 x 12 = 48 elements each.
_DP2_CUTS = [[29], [7]]
_DP4_CUTS = [[1, 20, 47], [12, 13, 30]]


def test_flat_dp2_to_dp4(tmp_path: Path) -> None:
    # Distributed-optimizer ranges over TP blocks; same block shape, other boundaries.
    saved = _specs("opt", _flat((2, 1), _DP2_CUTS, 2))
    _save_then_load(tmp_path, (2, saved), (4, _specs("opt", _flat((2, 1), _DP4_CUTS, 4))))


def test_flat_to_non_flat(tmp_path: Path) -> None:
    saved = _specs("opt", _flat((2, 1), _DP2_CUTS, 2))
    _save_then_load(
        tmp_path,
        (2, saved),
        (2, _specs("opt", _grid((2, 1), 2))),  # the stored TP blocks
        (2, _specs("opt", _grid((1, 2), 2))),  # across the stored blocks: assembled
        (1, _specs("opt", _grid((1, 1), 1))),
    )


def test_non_flat_to_flat(tmp_path: Path) -> None:
    saved = _specs("w", _grid((2, 1), 2))
    _save_then_load(
        tmp_path,
        (2, saved),
        (4, _specs("w", _flat((2, 1), _DP4_CUTS, 4))),
        (2, _specs("w", _flat((1, 2), [[5, 40], [0]], 2))),  # other blocks, a whole-block range
    )


def test_flat_tp2xdp2_to_tp1xdp2(tmp_path: Path) -> None:
    # Saved on 4 ranks, rank = tp + 2 * dp holding piece dp of TP block tp; loaded on 2
    # with ranges over the whole tensor, i.e. another block shape: every range is
    # assembled from the stored blocks.
    pieces = flat_shards(SHAPE, (2, 1), [[17], [40]])  # (tp, dp) = (0,0), (0,1), (1,0), (1,1)
    saved = _specs("opt", lambda shape: deal(pieces, 4, owners=[0, 2, 1, 3]))
    _save_then_load(
        tmp_path,
        (4, saved),
        (2, _specs("opt", _flat((1, 1), [[50]], 2))),
        (2, _specs("opt", _flat((1, 1), [even_cuts(96, 5)], 2))),
    )


# ---------------------------------------------------------------------------- per-layer tensors

LAYERS, ROWS, COLS = 4, 3, 4


def _layers_state_dict(
    rank: int, world_size: int, layers: list[int], tp: bool, replica_id: int, fill: bool
) -> dict[str, Any]:
    """Per-layer ShardedTensors (prepend_axis_num=1) of two stacked weights: 'attn' whole
    per layer, 'mlp' split over the ranks on its last axis when ``tp``."""
    sd: dict[str, Any] = {"attn": {}, "mlp": {}}
    for name in ("attn", "mlp"):
        ref = reference_tensor(name, (LAYERS, ROWS, COLS), torch.float32)
        for layer in layers:
            if tp and name == "mlp":
                width = COLS // world_size
                local = ref[layer, :, rank * width : (rank + 1) * width]
                offsets: tuple[tuple[int, int, int], ...] = (
                    (0, layer, LAYERS),
                    (2, rank, world_size),
                )
            else:
                local, offsets = ref[layer], ((0, layer, LAYERS),)
            data = local.clone() if fill else poison(local)
            sd[name][layer] = ShardedTensor.from_rank_offsets(
                name, data, *offsets, replica_id=replica_id, prepend_axis_num=1
            )
    return sd


def _save_layers(ckpt_dir: Path) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_rank = LAYERS // world_size
    layers = list(range(rank * per_rank, (rank + 1) * per_rank))
    # 'attn' layers split across ranks; 'mlp': every layer on every rank, TP-split.
    sd = _layers_state_dict(rank, world_size, layers, tp=False, replica_id=0, fill=True)
    sd["mlp"] = _layers_state_dict(rank, world_size, list(range(LAYERS)), True, 0, True)["mlp"]
    dcp.save(sd, ckpt_dir)


def _load_layers(ckpt_dir: Path, round_robin: bool) -> bytes:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if round_robin:
        layers, replica_id = list(range(rank, LAYERS, world_size)), 0
    else:
        layers, replica_id = list(range(LAYERS)), rank
    request = _layers_state_dict(rank, world_size, layers, False, replica_id, fill=False)
    return pack({"layers": layers, "loaded": dcp.load(request, ckpt_dir)})


@pytest.mark.parametrize("round_robin", [False, True], ids=["all_layers", "round_robin"])
def test_per_layer_prepended_axis(tmp_path: Path, round_robin: bool) -> None:
    run_distributed(_save_layers, 2, tmp_path)
    stored = dcp.load_tensors_metadata(tmp_path)
    assert {k: v.global_shape for k, v in stored.items()} == {
        "attn": (LAYERS, ROWS, COLS),
        "mlp": (LAYERS, ROWS, COLS),
    }
    for rank, packed in enumerate(run_distributed(_load_layers, 2, tmp_path, round_robin)):
        result = unpack(packed)
        expected_layers = list(range(rank, LAYERS, 2)) if round_robin else list(range(LAYERS))
        assert result["layers"] == expected_layers
        for name in ("attn", "mlp"):
            ref = reference_tensor(name, (LAYERS, ROWS, COLS), torch.float32)
            loaded = result["loaded"][name]
            assert sorted(loaded) == expected_layers
            for layer, tensor in loaded.items():
                assert same_bits(tensor, ref[layer]), (rank, name, layer)


# ---------------------------------------------------------------------------- shape mismatch

STORED_ROWS = 10


def _save_vocab(ckpt_dir: Path) -> None:
    rank = dist.get_rank()
    ref = reference_tensor("vocab", (STORED_ROWS, 4), torch.bfloat16)
    half = STORED_ROWS // 2
    local = ref[rank * half : (rank + 1) * half].clone()
    dcp.save({"vocab": ShardedTensor.from_rank_offsets("vocab", local, (0, rank, 2))}, ckpt_dir)


def _load_vocab(ckpt_dir: Path, local_rows: int) -> bytes:
    rank = dist.get_rank()
    data = torch.full((local_rows, 4), -7.0, dtype=torch.bfloat16)
    request = {
        "vocab": ShardedTensor.from_rank_offsets(
            "vocab", data, (0, rank, 2), allow_shape_mismatch=True
        )
    }
    loaded = dcp.load(request, ckpt_dir)
    assert isinstance(loaded, dict)
    return pack(loaded["vocab"])


@pytest.mark.parametrize("local_rows", [6, 4], ids=["padded", "truncated"])
def test_allow_shape_mismatch_fills_only_the_overlap(tmp_path: Path, local_rows: int) -> None:
    run_distributed(_save_vocab, 2, tmp_path)
    ref = reference_tensor("vocab", (STORED_ROWS, 4), torch.bfloat16)
    for rank, packed in enumerate(run_distributed(_load_vocab, 2, tmp_path, local_rows)):
        loaded = unpack(packed)
        start = rank * local_rows
        overlap = max(0, min(STORED_ROWS, start + local_rows) - start)
        assert same_bits(loaded[:overlap], ref[start : start + overlap]), rank
        # Rows past the stored tensor keep the value they were initialised with.
        assert torch.equal(loaded[overlap:], torch.full((local_rows - overlap, 4), -7.0).bfloat16())
