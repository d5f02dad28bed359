"""Adam state of a tensor-parallel model, saved at TP=2 and resumed at TP=2, TP=4 and TP=1.

Complements ``test_optimizer.py`` (whose model computes full-weight gradients, so its
losses match bit for bit): here the row-parallel sum is a real all-reduce, biases and a
replicated parameter (``replica_id``) are included, and every loaded shard of every
parameter and Adam moment is compared byte for byte with the state at save time.

The model is a two-layer MLP split the Megatron way: ``w1``/``b1`` column-parallel
(rows split over the TP ranks), ``w2`` row-parallel (columns split; the partial outputs
are summed with a real gloo all-reduce whose backward is the identity), ``b2``
replicated (``replica_id`` = TP rank). Every rank sees the same batches.

1. TP=2 (2 ranks) trains 3 steps, saves model + optimizer state through
   :mod:`dist_checkpointing.optimizer`, and returns its shards at that point; then it
   trains 3 more steps: the reference losses of an unresharded run.
2. TP=2, TP=4 and TP=1 runs build a fresh model and optimizer, load the checkpoint,
   return their shards as loaded, then train the same 3 steps.
3. The parent builds the full tensors from the TP=2 shards (plain concatenation,
   independent of the library) and checks that every loaded shard of every parameter
   and of ``exp_avg``/``exp_avg_sq`` is bit-exact, and that the losses match.

Tolerance on the losses: resuming at TP=2 must reproduce the reference losses exactly
(same shards, same arithmetic). At TP=4 and TP=1 the row-parallel output is summed in a
different grouping (4 partial sums, or one matmul), which changes float64 results at the
rounding level (relative 1e-16 per step); over 3 Adam steps that stays far below the
relative tolerance of 1e-12 used here, while any wrongly loaded element (a swapped shard,
a missing moment) moves the loss by many orders of magnitude more.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from tests.support.harness import run_distributed
from tests.support.layouts import same_bits

TIMEOUT_S = 120.0
IN, HID, OUT, BATCH = 6, 8, 5, 4  # HID divisible by TP = 1, 2, 4
DTYPE = torch.float64
# name -> (global shape, axis split over TP ranks or None for replicated)
PARAMS: dict[str, tuple[tuple[int, ...], int | None]] = {
    "w1": ((HID, IN), 0),
    "b1": ((HID,), 0),
    "w2": ((OUT, HID), 1),
    "b2": ((OUT,), None),
}
STEPS_BEFORE_SAVE = 3
STEPS_AFTER = 3
MOMENTS = ("exp_avg", "exp_avg_sq")


class _SumOverTP(torch.autograd.Function):
    """All-reduce (sum) of the row-parallel partial outputs; the gradient passes unchanged."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _full_init(name: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100 + list(PARAMS).index(name))
    return torch.randn(PARAMS[name][0], generator=gen, dtype=DTYPE) * 0.5


def _build(tp: int, seed: int) -> tuple[dict[str, torch.nn.Parameter], torch.optim.Adam]:
    """This rank's shards of a model initialized from ``seed``, and its Adam optimizer."""
    rank = dist.get_rank()
    params = {}
    for name, (_, axis) in PARAMS.items():
        full = _full_init(name, seed)
        local = full if axis is None else full.chunk(tp, dim=axis)[rank]
        params[name] = torch.nn.Parameter(local.clone())
    return params, torch.optim.Adam(list(params.values()), lr=0.05)


def _loss(params: dict[str, torch.nn.Parameter], step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, IN, generator=gen, dtype=DTYPE)
    target = torch.randn(BATCH, OUT, generator=gen, dtype=DTYPE)
    hidden = torch.tanh(x @ params["w1"].T + params["b1"])
    y = _SumOverTP.apply(hidden @ params["w2"].T) + params["b2"]
    return ((y - target) ** 2).mean()


def _train(params: dict[str, torch.nn.Parameter], optim: torch.optim.Adam, steps: range) -> list:
    losses = []
    for step in steps:
        optim.zero_grad()
        loss = _loss(params, step)
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def _model_sharded_state_dict(params: dict[str, torch.nn.Parameter], tp: int) -> dict[str, Any]:
    rank = dist.get_rank()
    out = {}
    for name, (_, axis) in PARAMS.items():
        if axis is None:
            out[name] = ShardedTensor.from_rank_offsets(name, params[name], replica_id=rank)
        else:
            out[name] = ShardedTensor.from_rank_offsets(name, params[name], (axis, rank, tp))
    return out


def _sharded_state_dict(
    params: dict[str, torch.nn.Parameter], optim: torch.optim.Adam, tp: int
) -> dict[str, Any]:
    """Model and optimizer state as a sharded state dict; Adam's ``step`` (a scalar per
    parameter, equal for all) goes to the common state, as Megatron-Core does."""
    model_sd = _model_sharded_state_dict(params, tp)
    optim_sd = optim.state_dict()
    if not optim_sd["state"]:  # a fresh optimizer: templates to load into
        optim_sd["state"] = {
            i: {m: torch.empty_like(p.detach()) for m in MOMENTS} | {"step": torch.tensor(0.0)}
            for i, p in enumerate(params.values())
        }
    steps = {float(s["step"]) for s in optim_sd["state"].values()}
    params_iter = itertools.chain.from_iterable(g["params"] for g in optim.param_groups)
    id_to_param = get_param_id_to_sharded_param_map(model_sd, params_iter)
    optim_state_to_sharding_state(optim_sd, id_to_param, exclude_keys=("step",))
    return {"model": model_sd, "optimizer": optim_sd, "adam_step": steps.pop()}


def _local_state(params: dict[str, torch.nn.Parameter], optim: torch.optim.Adam) -> dict:
    out = {}
    for name, p in params.items():
        out[name] = p.detach().clone()
        for moment in MOMENTS:
            out[f"{moment}.{name}"] = optim.state[p][moment].clone()
    return out


def _train_and_save(ckpt_dir: Path) -> dict[str, Any]:
    params, optim = _build(tp=2, seed=1)
    _train(params, optim, range(STEPS_BEFORE_SAVE))
    dcp.save(_sharded_state_dict(params, optim, tp=2), ckpt_dir)
    saved = _local_state(params, optim)
    losses = _train(params, optim, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER))
    return {"saved": saved, "losses": losses}


def _resume(ckpt_dir: Path, tp: int) -> dict[str, Any]:
    params, optim = _build(tp=tp, seed=2)  # different values: the load must overwrite them
    loaded = dcp.load(_sharded_state_dict(params, optim, tp=tp), ckpt_dir)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(loaded["model"][name])
    optim_sd = loaded["optimizer"]
    for state in optim_sd["state"].values():
        state["step"] = torch.tensor(loaded["adam_step"])
    optim.load_state_dict(optim_sd)
    state = _local_state(params, optim)
    losses = _train(params, optim, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER))
    return {"loaded": state, "losses": losses, "step": loaded["adam_step"]}


def _full_tensors(saved_by_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The global tensors at save time, from the TP=2 shards (no library code)."""
    full = {}
    for key in saved_by_rank[0]:
        axis = PARAMS[key.split(".")[-1]][1]
        parts = [saved[key] for saved in saved_by_rank]
        if axis is None:
            assert same_bits(parts[0], parts[1]), f"replicated {key} differs between ranks"
            full[key] = parts[0]
        else:
            full[key] = torch.cat(parts, dim=axis)
    return full


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list]:
    ckpt = tmp_path_factory.mktemp("optim")
    results = run_distributed(_train_and_save, 2, ckpt, timeout=TIMEOUT_S)
    assert results[0]["losses"] == results[1]["losses"]
    return ckpt, _full_tensors([r["saved"] for r in results]), results[0]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4, 1])
def test_adam_state_reshards_and_training_continues(saved_run: tuple, tp: int) -> None:
    ckpt, full, reference_losses = saved_run
    results = run_distributed(_resume, tp, ckpt, tp, timeout=TIMEOUT_S)
    for rank, result in enumerate(results):
        assert result["step"] == STEPS_BEFORE_SAVE
        for key, tensor in result["loaded"].items():
            axis = PARAMS[key.split(".")[-1]][1]
            expected = full[key] if axis is None else full[key].chunk(tp, dim=axis)[rank]
            assert same_bits(tensor, expected), f"TP={tp} rank {rank}: {key} differs"
        if tp == 2:
            assert result["losses"] == reference_losses
        else:
            assert result["losses"] == pytest.approx(reference_losses, rel=1e-12, abs=0)


def _tracked_state_keys(ckpt_dir: Path) -> list[str]:
    return sorted(dcp.load_tensors_metadata(ckpt_dir))


def test_checkpoint_holds_one_tensor_per_parameter_and_moment(saved_run: tuple) -> None:
    ckpt, _, _ = saved_run
    keys = run_distributed(_tracked_state_keys, 1, ckpt, timeout=TIMEOUT_S)[0]
    expected = list(PARAMS) + [f"optimizer.state.{m}.{n}" for m in MOMENTS for n in PARAMS]
    assert keys == sorted(expected)
