"""Behaviour of the Megatron-Core names added by the module-map audit."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dist_checkpointing as dcp
from dist_checkpointing import validation
from dist_checkpointing.errors import CheckpointingException, UnsupportedFeatureError
from dist_checkpointing.exchange_utils import distribute_shards_to_ranks, is_float8tensor
from dist_checkpointing.mapping import ShardedTensor
from dist_checkpointing.strategies import base, common, nvrx, state_dict_saver
from dist_checkpointing.strategies.async_utils import AsyncRequest
from dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from dist_checkpointing.strategies.torch import (
    TorchDistSaveShardedStrategy,
    get_async_strategy,
    get_reformulation_metadata,
)


def _save(path: Path) -> None:
    dcp.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}, path)


def test_default_strategies_is_a_live_view_of_the_registry() -> None:
    with base.isolated_registry():
        saver = base.default_strategies["save_sharded"][("torch_dist", 1)]
        assert isinstance(saver, TorchDistSaveShardedStrategy)
        mine = TorchDistSaveShardedStrategy()
        base.default_strategies[base.StrategyAction.SAVE_SHARDED.value][("mine", 3)] = mine
        assert base.get_default_strategy(base.StrategyAction.SAVE_SHARDED, "mine", 3) is mine
    with pytest.raises(KeyError):
        base.default_strategies["nonsense"]


def test_is_float8tensor_recognises_transformer_engine_classes_only() -> None:
    assert not is_float8tensor(torch.zeros(2))
    assert not is_float8tensor(torch.zeros(2).to(torch.float8_e4m3fn))
    fake = type("Float8Tensor", (torch.Tensor,), {"__module__": "transformer_engine.pytorch"})
    assert is_float8tensor(torch.zeros(2).as_subclass(fake))


def test_cross_group_loads_are_assigned_last() -> None:
    ranks = {"a": [0, 1], "b": [0, 1]}
    sizes = {"a": 10, "b": 5}
    assert distribute_shards_to_ranks(ranks, sizes, 2) == {"a": 0, "b": 1}
    # "a" is a cross-group load: "b" goes first, to rank 0.
    assert distribute_shards_to_ranks(ranks, sizes, 2, {"a"}) == {"b": 0, "a": 1}


def test_integrity_manifest_of_a_whole_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path)
    validation.verify_checkpoint(tmp_path)
    with pytest.raises(CheckpointingException, match="Integrity manifest not found"):
        validation.verify_integrity_manifest(tmp_path)
    validation.save_integrity_manifest(tmp_path)
    assert (tmp_path / validation.INTEGRITY_FNAME).exists()
    validation.verify_integrity_manifest(tmp_path)
    data = sorted(f for f in os.listdir(tmp_path) if f.endswith(".distcp"))[0]
    with open(tmp_path / data, "ab") as f:
        f.write(b"x")
    with pytest.raises(CheckpointingException, match=data):
        validation.verify_integrity_manifest(tmp_path)


def test_verify_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointingException, match="does not exist"):
        validation.verify_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointingException, match="not a distributed checkpoint"):
        validation.verify_checkpoint(tmp_path)


def test_common_function_forms_round_trip(tmp_path: Path) -> None:
    common.save_common({"a": 1, "t": torch.ones(2)}, tmp_path)
    loaded = common.load_common(tmp_path)
    assert loaded["a"] == 1 and torch.equal(loaded["t"], torch.ones(2))


def test_cached_reader_shares_metadata_unless_asked_not_to(tmp_path: Path) -> None:
    _save(tmp_path)
    CachedMetadataFileSystemReader.clear_metadata_cache()
    first = CachedMetadataFileSystemReader(tmp_path).read_metadata()
    assert CachedMetadataFileSystemReader(tmp_path).read_metadata() is first
    own = CachedMetadataFileSystemReader(tmp_path, cache_metadata=False)
    assert own.read_metadata() is not first and own.read_metadata() is own.read_metadata()
    CachedMetadataFileSystemReader.clear_metadata_cache()
    assert CachedMetadataFileSystemReader(tmp_path).read_metadata() is not first


def test_verify_global_md_reuse_and_wrapper_groups() -> None:
    plan = state_dict_saver.SavePlan([])
    assert not state_dict_saver.verify_global_md_reuse(None, plan, 0, None)
    assert state_dict_saver.verify_global_md_reuse([plan], plan, 0, None)
    other = state_dict_saver.SavePlan([], planner_data={"x": 1})
    assert not state_dict_saver.verify_global_md_reuse([other], plan, 0, None)
    wrapper = SimpleNamespace(group=None, coordinator_rank=0)
    assert state_dict_saver.verify_global_md_reuse([plan], plan, 0, wrapper)
    with pytest.raises(CheckpointingException, match="process group"):
        state_dict_saver._group_of(object())


def test_nvrx_helpers_without_nvrx() -> None:
    assert not nvrx.is_nvrx_min_version("99999.0")
    request = nvrx.make_nvrx_async_request(AsyncRequest, None, (), [])
    assert isinstance(request, AsyncRequest)
    name, modules = get_async_strategy("mcore")
    assert name == "mcore" and modules["AsyncRequest"] is AsyncRequest
    assert get_async_strategy("mcore", "AsyncRequest") == ("mcore", AsyncRequest)
    with pytest.raises(UnsupportedFeatureError, match="mcore"):
        get_async_strategy("nvrx")


def test_reformulation_metadata_of_a_plain_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path)
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}
    assert get_reformulation_metadata(request, tmp_path) == {}


def test_fully_parallel_wrapper_checks_backend_and_version() -> None:
    inner = TorchDistSaveShardedStrategy()
    FullyParallelSaveStrategyWrapper(inner, None, False, "torch_dist", 1)
    with pytest.raises(CheckpointingException, match="backend"):
        FullyParallelSaveStrategyWrapper(inner, None, False, "zarr", 1)


def test_names_that_cannot_apply_raise_unsupported() -> None:
    from dist_checkpointing import gpt_checkpoint_interop as gpt
    from dist_checkpointing.strategies import checkpointable

    with pytest.raises(UnsupportedFeatureError, match="outside dist_checkpointing"):
        gpt.gpt_compatible_layer_maps("M*-")
    with pytest.raises(UnsupportedFeatureError, match="_Checkpointable"):
        checkpointable.CheckpointableShardedTensor(torch.zeros(1), None)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedFeatureError):
        checkpointable.LocalShardsContainer([torch.zeros(1)])
