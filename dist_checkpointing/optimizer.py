"""Sharding for optimizer state, derived from the sharding of the model parameters.

Megatron-Core's ``dist_checkpointing.optimizer`` module path. An optimizer keeps
one state tensor per parameter and per kind (``exp_avg``, ``exp_avg_sq`` for
Adam), shaped like the parameter's local shard: each gets the parameter's
sharding under its own key (``optimizer.state.<kind>.<param key>``), so optimizer
state reshards with the model.

Typical use (every rank)::

    model_sd = model.sharded_state_dict()  # ShardedTensors wrapping the parameters
    id_to_param = get_param_id_to_sharded_param_map(
        model_sd, itertools.chain.from_iterable(g["params"] for g in optim.param_groups)
    )
    optim_sd = optim.state_dict()
    optim_state_to_sharding_state(optim_sd, id_to_param, exclude_keys=("step",))
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from .dict_utils import nested_values
from .errors import MappingError
from .mapping import (
    LocalNonpersistentObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)
from .utils import extract_sharded_tensors_and_factories

logger = logging.getLogger(__name__)

KEEP_VARS_HINT = (
    " Make sure state dict contains original torch.nn.Parameters (not pure torch.Tensors)"
    " by passing `keep_vars=True` to `.state_dict()`. If any transformation of the original"
    " parameter is needed, use a ShardedTensorFactory."
)

ShardedParam = ShardedTensor | ShardedTensorFactory


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.nn.Parameter]) -> dict[int, int]:
    """``id(parameter) -> index`` in the optimizer's parameter order (first occurrence)."""
    ids: dict[int, int] = {}
    for index, param in enumerate(optim_params_iter):
        ids.setdefault(id(_local(param)), index)
    return ids


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.nn.Parameter]
) -> dict[int, ShardedParam]:
    """``optimizer parameter index -> the model's ShardedTensor (or factory)`` for it.

    Args:
        model_sharded_state_dict: the model's sharded state dict, whose leaves wrap
            the parameters themselves (``state_dict(keep_vars=True)``).
        optim_params_iter: the parameters in the optimizer's order.
    """
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    param_ids = get_optim_param_to_id_map(optim_params_iter)
    mapping: dict[int, ShardedParam] = {}
    for leaf in nested_values(sharded):
        if id(leaf.data) in param_ids:
            mapping[param_ids[id(leaf.data)]] = leaf
        else:
            logger.debug("%s is not tracked by the optimizer", leaf)
    if not mapping:
        logger.warning(
            "Sharded parameters mapping is empty. It means tensors in model state dict do not "
            "correspond to tensors in optimizer parameters map.%s",
            KEEP_VARS_HINT,
        )
    return mapping


def make_sharded_optimizer_tensor(
    model_param: ShardedParam, optim_param: torch.Tensor, prefix: str
) -> ShardedParam:
    """``optim_param`` sharded like ``model_param``, under the key ``<prefix>.<model key>``.

    Raises:
        MappingError: ``optim_param`` is not shaped like the parameter's local shard.
    """
    optim_param = _local(optim_param)
    key = f"{prefix}.{model_param.key}"
    if isinstance(model_param, ShardedTensorFactory):
        return dataclasses.replace(model_param, key=key, data=optim_param)
    data = model_param.data
    expected = tuple(data.shape) if data is not None else model_param.local_shape
    if tuple(optim_param.shape) != expected:
        raise MappingError(
            f"optimizer state '{key}' has shape {tuple(optim_param.shape)}, but the parameter "
            f"'{model_param.key}' has local shape {expected}"
        )
    return dataclasses.replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype)


def _sharded_state_entry(
    model_param: ShardedParam, param_id: int, kind: str, value: object
) -> ShardedParam:
    """One optimizer state tensor with its parameter's sharding (scalars are refused)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        raise MappingError(
            f"optimizer state {kind!r} of param id {param_id} ('{model_param.key}') is a "
            "scalar, not a tensor shaped like its parameter; exclude it with "
            f"exclude_keys=({kind!r},) and keep it in the common state"
        )
    return make_sharded_optimizer_tensor(model_param, value, f"optimizer.state.{kind}")


def optim_state_to_sharding_state(
    optim_state_dict: StateDict,
    id_to_sharded_param_map: dict[int, ShardedParam],
    exclude_keys: tuple[str, ...] | str = (),
) -> None:
    """Turn an optimizer state dict into a sharded one, in place.

    Every ``state[param_id][kind]`` becomes a ShardedTensor sharded like the
    parameter, keyed ``optimizer.state.<kind>.<param key>``; kinds in
    ``exclude_keys`` (e.g. Adam's scalar ``step``) are dropped. The parameter lists
    of ``param_groups`` become LocalNonpersistentObjects (the other
    hyperparameters are saved as common state).

    Raises:
        MappingError: a parameter id of the optimizer has no sharded parameter, or
            a state entry is a scalar (naming the id, the kind and the parameter key).
    """
    excluded = (exclude_keys,) if isinstance(exclude_keys, str) else tuple(exclude_keys)
    sharded_state: dict[int, dict[str, ShardedParam]] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        kinds = {k: v for k, v in param_state.items() if k not in excluded}
        model_param = id_to_sharded_param_map.get(param_id)
        if model_param is None:
            if kinds:
                raise MappingError(
                    f"Param id {param_id} does not match any model sharded param (optimizer "
                    f"state {sorted(kinds)}).{KEEP_VARS_HINT}"
                )
            sharded_state[param_id] = {}
            continue
        sharded_state[param_id] = {
            kind: _sharded_state_entry(model_param, param_id, kind, value)
            for kind, value in kinds.items()
        }
    optim_state_dict["param_groups"] = copy.deepcopy(optim_state_dict["param_groups"])
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])
    optim_state_dict["state"] = sharded_state


__all__ = [
    "KEEP_VARS_HINT",
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
]
