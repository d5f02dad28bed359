"""dist_checkpointing.optimizer in one process: the mappings, keys, shapes and errors.

Resharding of real Adam state over TP=2/4/1 is in ``tests/multirank/test_optimizer.py``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from dist_checkpointing import LocalNonpersistentObject, ShardedTensor, ShardedTensorFactory
from dist_checkpointing.errors import MappingError
from dist_checkpointing.optimizer import (
    KEEP_VARS_HINT,
    get_optim_param_to_id_map,
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)


def _model() -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    params = model.state_dict(keep_vars=True)
    sharded = {
        "layers": [
            {
                "weight": ShardedTensor.from_rank_offsets("l0.weight", params["0.weight"]),
                "bias": ShardedTensor.from_rank_offsets("l0.bias", params["0.bias"]),
            },
            {"weight": ShardedTensor.from_rank_offsets("l1.weight", params["1.weight"])},
        ],
        "other": 3,
    }
    return model, sharded


def _stepped_adam(model: torch.nn.Module) -> torch.optim.Adam:
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(3, 4)).sum().backward()
    optim.step()
    return optim


def test_param_to_id_map_keeps_the_first_position() -> None:
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    assert get_optim_param_to_id_map([a, b, a]) == {id(a): 0, id(b): 1}


def test_id_to_sharded_param_map_matches_parameters_by_identity() -> None:
    model, sharded = _model()
    mapping = get_param_id_to_sharded_param_map(sharded, model.parameters())
    # parameters: l0.weight, l0.bias, l1.weight, l1.bias (the last one is not sharded)
    assert {i: sh.key for i, sh in mapping.items()} == {
        0: "l0.weight",
        1: "l0.bias",
        2: "l1.weight",
    }


def test_empty_mapping_warns_about_keep_vars(caplog: pytest.LogCaptureFixture) -> None:
    model, _ = _model()
    copies = {"w": ShardedTensor.from_rank_offsets("w", model[0].weight.detach().clone())}
    with caplog.at_level(logging.WARNING, logger="dist_checkpointing.optimizer"):
        assert get_param_id_to_sharded_param_map(copies, model.parameters()) == {}
    assert "keep_vars=True" in caplog.text


def test_adam_state_becomes_sharded_tensors_with_the_parameters_sharding() -> None:
    model, sharded = _model()
    optim = _stepped_adam(model)
    mapping = get_param_id_to_sharded_param_map(sharded, model.parameters())
    optim_sd = optim.state_dict()
    del optim_sd["state"][3]  # l1.bias is not part of the sharded model
    exp_avg = optim_sd["state"][0]["exp_avg"]
    optim_state_to_sharding_state(optim_sd, mapping, exclude_keys="step")
    state = optim_sd["state"]
    assert {k: set(v) for k, v in state.items()} == {i: {"exp_avg", "exp_avg_sq"} for i in range(3)}
    sh = state[0]["exp_avg"]
    assert sh.key == "optimizer.state.exp_avg.l0.weight" and sh.data is exp_avg
    assert (sh.global_shape, sh.global_offset) == (
        mapping[0].global_shape,
        mapping[0].global_offset,
    )
    assert state[1]["exp_avg_sq"].key == "optimizer.state.exp_avg_sq.l0.bias"
    (group,) = optim_sd["param_groups"]
    assert isinstance(group["params"], LocalNonpersistentObject)
    assert group["params"].unwrap() == [0, 1, 2, 3] and group["lr"] == 0.001
    assert optim.state_dict()["param_groups"][0]["params"] == [0, 1, 2, 3]  # a deep copy


def test_scalar_state_must_be_excluded() -> None:
    model, sharded = _model()
    optim_sd = _stepped_adam(model).state_dict()
    del optim_sd["state"][3]
    mapping = get_param_id_to_sharded_param_map(sharded, model.parameters())
    with pytest.raises(MappingError, match=r"'step' of param id 0 \('l0.weight'\).*exclude_keys"):
        optim_state_to_sharding_state(optim_sd, mapping)


def test_unknown_param_id() -> None:
    model, sharded = _model()
    optim_sd = _stepped_adam(model).state_dict()
    mapping = get_param_id_to_sharded_param_map(sharded, model.parameters())
    with pytest.raises(MappingError, match="Param id 3 does not match any model sharded param"):
        optim_state_to_sharding_state(optim_sd, mapping, exclude_keys=("step",))


def test_optimizer_tensor_of_another_shape() -> None:
    param = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 1, 2))
    with pytest.raises(MappingError, match=r"'opt.w'.*shape \(6, 4\).*'w'.*\(4, 6\)"):
        make_sharded_optimizer_tensor(param, torch.zeros(6, 4), "opt")


def test_optimizer_tensor_keeps_its_dtype_and_the_flat_range() -> None:
    flat = ShardedTensor.from_rank_offsets_flat(
        "w", torch.zeros(5, dtype=torch.bfloat16), (4, 3), (0, 1, 2), flattened_range=slice(2, 7)
    )
    state = torch.ones(5, dtype=torch.float32)
    sh = make_sharded_optimizer_tensor(flat, state, "optimizer.state.exp_avg")
    assert isinstance(sh, ShardedTensor)
    assert sh.dtype == torch.float32 and sh.data is state and sh.flattened_range == slice(2, 7)
    assert (sh.global_shape, sh.global_offset) == ((8, 3), (4, 0))
    with pytest.raises(MappingError, match=r"shape \(4, 3\).*local shape \(5,\)"):
        make_sharded_optimizer_tensor(flat, torch.zeros(4, 3), "opt")


def _build(key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any) -> Any:
    return ShardedTensor.from_rank_offsets(key, t)


def _merge(x: Any) -> torch.Tensor:
    return x


def test_factory_parameters_get_a_factory_with_the_optimizer_tensor() -> None:
    factory = ShardedTensorFactory("emb", torch.zeros(3), _build, _merge, replica_id=1)
    state = torch.ones(3)
    out = make_sharded_optimizer_tensor(factory, state, "optimizer.state.exp_avg")
    assert isinstance(out, ShardedTensorFactory)
    assert out.key == "optimizer.state.exp_avg.emb" and out.data is state and out.replica_id == 1
    assert factory.key == "emb"  # the model's factory is unchanged


def test_keep_vars_hint_is_megatrons() -> None:
    assert "keep_vars=True" in KEEP_VARS_HINT
