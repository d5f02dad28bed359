"""A ShardedTensor whose ``data`` was replaced after construction by a tensor of other
size (or, for ``raw_bytes``, dtype) is refused at save, naming its key, in both layouts;
the checkpoint already in the directory stays whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import CheckpointingException
from tests.support.layouts import same_bits

LAYOUTS = [("torch_dist", 1), ("raw_bytes", 1)]


def _state(data: torch.Tensor | None = None) -> dict[str, ShardedTensor]:
    sh = ShardedTensor.from_rank_offsets("decoder.weight", torch.arange(1000.0).reshape(10, 100))
    if data is not None:
        sh.data = data
    return {"w": sh}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x[0])
@pytest.mark.parametrize("data", [torch.zeros(10), torch.zeros(11, 100)], ids=["fewer", "more"])
def test_data_of_another_size_is_refused_by_key(
    tmp_path: Path, layout: tuple[str, int], data: torch.Tensor
) -> None:
    dc.save(_state(), tmp_path, layout)
    with pytest.raises(CheckpointingException, match="decoder.weight"):
        dc.save(_state(data), tmp_path, layout)
    loaded = dc.load(
        {"w": ShardedTensor.from_rank_offsets("decoder.weight", torch.zeros(10, 100))}, tmp_path
    )
    assert same_bits(loaded["w"], torch.arange(1000.0).reshape(10, 100))


def test_raw_bytes_refuses_data_of_another_dtype(tmp_path: Path) -> None:
    with pytest.raises(CheckpointingException, match="decoder.weight.*torch.float16"):
        dc.save(_state(torch.zeros(10, 100, dtype=torch.float16)), tmp_path, ("raw_bytes", 1))
