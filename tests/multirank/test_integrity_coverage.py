"""verify_integrity covers every file that is unpickled, before it is unpickled."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.checkpoint.integrity import INTEGRITY_FNAME
from dist_checkpointing.errors import CheckpointingException, CorruptCheckpointError

pytestmark = pytest.mark.timeout(60)


def _state(seed: int) -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0) + seed),
        "step": seed,
    }


def _request() -> dict[str, Any]:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}


@pytest.fixture
def two(tmp_path: Path) -> tuple[Path, Path]:
    first, second = tmp_path / "one", tmp_path / "two"
    for d, seed in ((first, 1), (second, 2)):
        d.mkdir()
        dcp.save(_state(seed), d, verify_integrity=True)
    return first, second


def test_manifest_lists_metadata_and_common_state(two: tuple[Path, Path]) -> None:
    files = json.loads((two[0] / INTEGRITY_FNAME).read_text())["files"]
    assert ".metadata" in files and "common.pt" in files


@pytest.mark.parametrize("name", [".metadata", "common.pt"])
def test_swapped_file_is_detected(two: tuple[Path, Path], name: str) -> None:
    first, second = two
    (first / name).write_bytes((second / name).read_bytes())
    with pytest.raises(CorruptCheckpointError, match=f"{name}: sha256"):
        dcp.load(_request(), first, verify_integrity=True)


def test_common_state_is_checked_before_it_is_unpickled(
    two: tuple[Path, Path], tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    first, _ = two
    (first / "common.pt").write_bytes(pickle.dumps(Payload()))
    strategy = dcp.strategies.common.TorchCommonLoadStrategy(trusted=True)
    with pytest.raises(CorruptCheckpointError, match="common.pt: sha256"):
        dcp.load(_request(), first, verify_integrity=True, common_strategy=strategy)
    assert not marker.exists()


def test_deleted_manifest_is_an_error(two: tuple[Path, Path]) -> None:
    first, _ = two
    (first / INTEGRITY_FNAME).unlink()
    with pytest.raises(CheckpointingException, match=INTEGRITY_FNAME):
        dcp.load(_request(), first, verify_integrity=True)


def test_intact_checkpoint_loads(two: tuple[Path, Path]) -> None:
    loaded = dcp.load(_request(), two[1], verify_integrity=True)
    assert torch.equal(loaded["w"], torch.arange(8.0) + 2) and loaded["step"] == 2


def test_remove_sharded_tensors_keeps_the_manifest_true(tmp_path: Path) -> None:
    state = {k: ShardedTensor.from_rank_offsets(k, torch.ones(4) * i) for i, k in enumerate("vw")}
    dcp.save(state, tmp_path, verify_integrity=True)
    dcp.remove_sharded_tensors(tmp_path, "w")
    files = json.loads((tmp_path / INTEGRITY_FNAME).read_text())["files"]
    assert all((tmp_path / name).is_file() for name in files)
    request = {"v": ShardedTensor.from_rank_offsets("v", torch.zeros(4))}
    loaded = dcp.load(request, tmp_path, verify_integrity=True)
    assert torch.equal(loaded["v"], torch.zeros(4))
