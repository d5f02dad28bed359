"""Megatron-Core's by-hand N-D reformulation API (strategies.resharding) and the
cached-metadata reader, on checkpoints saved in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import CheckpointingException, MappingError
from dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from dist_checkpointing.strategies.resharding import (
    TensorReformulationMetadata,
    apply_nd_flattened_tensors_reformulation,
    is_nd_flattened_tensor,
    nd_flattened_tensor_reformulated_global_shape,
    restore_nd_flattened_tensors_formulation,
)

FULL = torch.arange(48.0).reshape(8, 6)


def _flat(grid: tuple[int, int], cut: int, data: torch.Tensor | None = None) -> dict[str, Any]:
    """Every block of ``grid`` as two flat ranges split at ``cut`` (all in this process)."""
    rows, cols = 8 // grid[0], 6 // grid[1]
    out = {}
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = FULL[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].reshape(-1)
            for k, rng in enumerate((slice(0, cut), slice(cut, rows * cols))):
                local = block[rng].clone() if data is None else torch.zeros(rng.stop - rng.start)
                out[f"{i}.{j}.{k}"] = ShardedTensor.from_rank_offsets_flat(
                    "w", local, (rows, cols), (0, i, grid[0]), (1, j, grid[1]), flattened_range=rng
                )
    return out


def test_load_under_another_grid_by_hand(tmp_path: Path) -> None:
    dcp.save(_flat((2, 2), 5), tmp_path)  # stored as (2, 2, 12)
    request = _flat((4, 1), 7, data=torch.zeros(0))
    expected = {
        k: FULL[sh.global_slice()].reshape(-1)[sh.flattened_range] for k, sh in request.items()
    }
    assert all(is_nd_flattened_tensor(sh) for sh in request.values())
    assert nd_flattened_tensor_reformulated_global_shape(request["0.0.0"]) == (4, 1, 12)
    metadata = {"w": TensorReformulationMetadata((8, 6), (2, 2, 12))}
    reformulated, restore = apply_nd_flattened_tensors_reformulation(request, metadata)
    loaded = dcp.load(reformulated, tmp_path, validate_access_integrity=False)
    result = restore_nd_flattened_tensors_formulation(loaded, restore)  # type: ignore[arg-type]
    for key, want in expected.items():
        assert torch.equal(result[key], want), key


def test_same_grid_is_left_alone_and_missing_metadata_is_an_error() -> None:
    request = _flat((2, 2), 5, data=torch.zeros(0))
    same = {"w": TensorReformulationMetadata((8, 6), (2, 2, 12))}
    reformulated, restore = apply_nd_flattened_tensors_reformulation(dict(request), same)
    assert all(isinstance(v, ShardedTensor) for v in reformulated.values()) and not restore
    with pytest.raises(CheckpointingException, match="no reformulation metadata for 'w'"):
        apply_nd_flattened_tensors_reformulation(dict(request), {})
    with pytest.raises(MappingError):
        TensorReformulationMetadata((), (1,))


def test_cached_metadata_reader_parses_once(tmp_path: Path) -> None:
    dcp.save({"w": ShardedTensor.from_rank_offsets("w", FULL.clone())}, tmp_path)
    reader = CachedMetadataFileSystemReader(tmp_path)
    first = reader.read_metadata()
    assert reader.read_metadata() is first
    reader.reset(tmp_path)
    assert reader.read_metadata() is first  # same checkpoint: still cached
    assert "w" in first.state_dict_metadata
