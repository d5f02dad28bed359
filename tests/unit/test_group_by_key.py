"""The leaves of a sharded state dict grouped by sharded key (strategies/torch/converter
``group_by_key``): what ``_replace_state_dict_keys_with_sharded_keys`` groups, in the
same order, with the same errors naming the paths, without a path kept per leaf."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.errors import MappingError
from dist_checkpointing.strategies.torch.converter import (
    _replace_state_dict_keys_with_sharded_keys,
    group_by_key,
)


def _tensor(key: str, replica: int = 0) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, torch.zeros(2), replica_id=replica)


def _state_dict() -> dict[Any, Any]:
    return {
        "decoder.layers.0.weight": _tensor("decoder.layers.0.weight"),
        "decoder.layers.0.weight_copy": _tensor("decoder.layers.0.weight", replica=1),
        "optimizer": {
            "state": {0: {"exp_avg": _tensor("opt.0.exp_avg")}, 1: [_tensor("opt.1", 1)]},
            "param_groups": ShardedObject("opt.groups", {"lr": 1.0}, (2,), (0,), replica_id=0),
        },
        3: _tensor("int.key"),
    }


@pytest.mark.parametrize("main_only", [False, True])
def test_groups_as_the_full_flattening_does(main_only: bool) -> None:
    sd = _state_dict()
    got = group_by_key(sd, main_only)
    expected = _replace_state_dict_keys_with_sharded_keys(sd, main_only)[0]
    assert list(got) == list(expected)
    assert all(
        [id(x) for x in got[k]] == [id(x) for x in expected[k]] for k in expected
    )  # the same leaves, in the same order
    assert ("opt.1" in got) != main_only and len(got["decoder.layers.0.weight"]) == 2 - main_only


def test_a_dotted_path_twice_is_an_error_naming_both_paths() -> None:
    sd = {"a.b": _tensor("x"), "a": {"b": _tensor("y")}}
    with pytest.raises(
        MappingError, match=r"Duplicated flattened key 'a\.b'.*\('a\.b',\).*\('a', 'b'\)"
    ):
        group_by_key(sd)
    with pytest.raises(MappingError, match=r"Duplicated flattened key '1'"):
        group_by_key({1: _tensor("x"), "1": _tensor("y")})


def test_a_leaf_that_is_not_sharded_is_an_error_naming_its_path() -> None:
    with pytest.raises(MappingError, match=r"'m\.0\.w' is a Tensor, expected a ShardedBase"):
        group_by_key({"m": [{"w": torch.zeros(1)}]})
