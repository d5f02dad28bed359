"""save_preprocess / load_preprocess skip the steps a state dict does not need.

One pass finds factories, non-persistent leaves and empty flat ranges; without them
the copies those steps make are skipped. Property: for any nested state dict, the
result is the same structure holding the same leaf objects as running every step.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
from dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from dist_checkpointing.state_dict_utils import (
    filter_out_empty_flatten_tensor,
    load_preprocess,
    save_preprocess,
)
from dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base


def _all_save_steps(sd: Any) -> tuple[Any, Any]:
    _, persistent = extract_nonpersistent(sd)
    sharded, common = extract_sharded_base(persistent)
    return filter_out_empty_flatten_tensor(sharded), common


def _all_load_steps(sd: Any) -> tuple[Any, Any, Any]:
    nonpersistent, request = extract_nonpersistent(sd)
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    factories, _ = extract_matching_values(
        request, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    request, _ = extract_sharded_base(request)
    return request, nonpersistent, factories


def _shape(x: Any) -> Any:
    """Containers by type and keys, leaves by identity."""
    if isinstance(x, dict):
        return ("dict", [(k, _shape(v)) for k, v in x.items()])
    if isinstance(x, list):
        return ("list", [_shape(v) for v in x])
    return ("leaf", id(x))


_counter = iter(range(10**9))


def _leaf(kind: str) -> Any:
    n = next(_counter)
    if kind == "tensor":
        return ShardedTensor.from_rank_offsets(f"t{n}", torch.zeros(4))
    if kind == "empty_flat":
        return ShardedTensor.from_rank_offsets_flat(
            f"f{n}", torch.zeros(0), (4,), flattened_range=slice(2, 2)
        )
    if kind == "flat":
        return ShardedTensor.from_rank_offsets_flat(
            f"f{n}", torch.zeros(4), (4,), flattened_range=slice(0, 4)
        )
    if kind == "object":
        return ShardedObject(f"o{n}", n, (1,), (0,))
    if kind == "nonpersistent":
        return LocalNonpersistentObject(n)
    return {"int": n, "str": str(n), "plain": torch.ones(2)}.get(kind, n)


LEAVES = st.sampled_from(
    ["tensor", "tensor", "flat", "empty_flat", "object", "nonpersistent", "int", "str", "plain"]
)
STATE = st.recursive(
    LEAVES.map(_leaf),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text("abc", min_size=1, max_size=2), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(sd=st.dictionaries(st.text("xyz", min_size=1, max_size=2), STATE, max_size=5))
def test_save_preprocess_matches_every_step(sd: dict[str, Any]) -> None:
    expected = _all_save_steps(sd)
    got = save_preprocess(sd, validate_access_integrity=False)
    assert _shape(got[0]) == _shape(expected[0])
    assert _shape(got[1]) == _shape(expected[1])


@settings(max_examples=200, deadline=None)
@given(sd=st.dictionaries(st.text("xyz", min_size=1, max_size=2), STATE, max_size=5))
def test_load_preprocess_matches_every_step(sd: dict[str, Any]) -> None:
    request, nonpersistent, factories = _all_load_steps(sd)
    got = load_preprocess(sd)
    assert _shape(got[0]) == _shape(request)
    assert _shape(got[1]) == _shape(nonpersistent)
    assert _shape(got[2]) == _shape(factories)


def test_factories_still_take_every_step() -> None:
    built = ShardedTensor.from_rank_offsets("w", torch.zeros(4))
    factory = ShardedTensorFactory(
        "w",
        torch.zeros(4),
        lambda key, data, replica_id, flattened_range: {"a": built},
        lambda parts: parts["a"],
        (0, 0, 0),
    )
    sd = {"w": factory, "np": LocalNonpersistentObject(3), "c": 1}
    request, nonpersistent, factories = load_preprocess(sd)
    assert request == {"w": {"a": built}}
    assert nonpersistent == {"np": 3}
    assert factories == {"w": factory}
