"""Optimizer state sharded like the model (dist_checkpointing.optimizer), resharded.

A two-layer MLP is trained with Adam at tensor-parallel size 2 (the first weight
split by rows, the second by columns), saved with its optimizer state, and
resumed at TP=4 and TP=1. Each step computes the gradient of the full weights
(gathered, identical on every rank) and keeps the local slice, so the training
is mathematically the same at every TP size; Adam's update is elementwise. The
resumed runs must therefore reproduce the uninterrupted TP=2 run's losses bit for
bit (tolerance 0), which also proves the optimizer state was restored exactly.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import MappingError
from dist_checkpointing.optimizer import (
    get_optim_param_to_id_map,
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)
from tests.support.harness import run_distributed

TIMEOUT_S = 120.0
IN, HID, OUT = 8, 16, 4
STEPS_BEFORE, STEPS_AFTER = 3, 3


def _full_weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(HID, IN, generator=g) * 0.3, torch.randn(OUT, HID, generator=g) * 0.3


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(32, IN, generator=g), torch.randn(32, OUT, generator=g)


class TPModel:
    """``w1`` split by rows (column parallel), ``w2`` by columns (row parallel)."""

    def __init__(self, tp: int, rank: int, fill: float | None = None) -> None:
        w1, w2 = _full_weights()
        self.tp, self.rank = tp, rank
        self.rows = slice(rank * HID // tp, (rank + 1) * HID // tp)
        self.w1 = torch.nn.Parameter(w1[self.rows].clone())
        self.w2 = torch.nn.Parameter(w2[:, self.rows].clone())
        if fill is not None:  # a model that must get everything from the checkpoint
            with torch.no_grad():
                self.w1.fill_(fill)
                self.w2.fill_(fill)
        self.optim = torch.optim.Adam([self.w1, self.w2], lr=0.05)

    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        return {
            "w1": ShardedTensor.from_rank_offsets("w1", self.w1, (0, self.rank, self.tp)),
            "w2": ShardedTensor.from_rank_offsets("w2", self.w2, (1, self.rank, self.tp)),
        }

    def _gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp == 1:
            return local.detach().clone()
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local.detach().contiguous())
        return torch.cat(parts, dim=dim)

    def train_step(self, step: int) -> float:
        w1 = self._gather(self.w1, 0).requires_grad_()
        w2 = self._gather(self.w2, 1).requires_grad_()
        x, y = _batch(step)
        loss = F.mse_loss(F.relu(x @ w1.T) @ w2.T, y)
        loss.backward()
        assert w1.grad is not None and w2.grad is not None
        self.w1.grad = w1.grad[self.rows].clone()
        self.w2.grad = w2.grad[:, self.rows].clone()
        self.optim.step()
        self.optim.zero_grad()
        return float(loss)

    def checkpoint_state(self) -> dict[str, Any]:
        """Model and optimizer state, sharded; Adam's scalar step saved as common state."""
        model_sd = self.sharded_state_dict()
        params = itertools.chain.from_iterable(g["params"] for g in self.optim.param_groups)
        id_to_param = get_param_id_to_sharded_param_map(model_sd, params)
        optim_sd = self.optim.state_dict()
        steps = {pid: float(state["step"]) for pid, state in optim_sd["state"].items()}
        optim_state_to_sharding_state(optim_sd, id_to_param, exclude_keys=("step",))
        return {"model": model_sd, "optimizer": optim_sd, "adam_steps": steps}

    def init_optimizer_state(self) -> None:
        """Empty Adam state (what a load fills in)."""
        for p in (self.w1, self.w2):
            self.optim.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }

    def restore(self, loaded: dict[str, Any]) -> None:
        optim_sd = loaded["optimizer"]
        for pid, state in optim_sd["state"].items():
            state["step"] = torch.tensor(loaded["adam_steps"][pid])
        self.optim.load_state_dict(optim_sd)


def _train_save_continue(ckpt: str) -> list[float]:
    model = TPModel(2, dist.get_rank())
    for step in range(STEPS_BEFORE):
        model.train_step(step)
    dcp.save(model.checkpoint_state(), ckpt)
    return [model.train_step(STEPS_BEFORE + i) for i in range(STEPS_AFTER)]


def _resume(ckpt: str, tp: int) -> list[float]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = TPModel(tp, rank, fill=7.0)
    model.init_optimizer_state()
    loaded = dcp.load(model.checkpoint_state(), ckpt)
    assert isinstance(loaded, dict)
    model.restore(loaded)
    return [model.train_step(STEPS_BEFORE + i) for i in range(STEPS_AFTER)]


def test_adam_state_reshards_and_training_continues_identically(tmp_path: Path) -> None:
    reference = run_distributed(_train_save_continue, 2, str(tmp_path), timeout=TIMEOUT_S)
    assert reference[0] == reference[1]  # every TP rank computes the same loss
    for tp in (4, 1):
        resumed = run_distributed(_resume, tp, str(tmp_path), tp, timeout=TIMEOUT_S)
        for losses in resumed:
            assert losses == reference[0], (tp, losses, reference[0])


# ----------------------------------------------------------------------------- helpers


def test_param_ids_follow_the_optimizer_order_and_skip_untracked() -> None:
    model = TPModel(1, 0)
    extra = torch.nn.Parameter(torch.zeros(3))
    sd: dict[str, Any] = model.sharded_state_dict()
    sd["extra"] = ShardedTensor.from_rank_offsets("extra", extra)
    assert get_optim_param_to_id_map([model.w2, model.w1, model.w2]) == {
        id(model.w2): 0,
        id(model.w1): 1,
    }
    mapping = get_param_id_to_sharded_param_map(sd, [model.w1, model.w2])
    assert {i: sh.key for i, sh in mapping.items()} == {0: "w1", 1: "w2"}


def test_optimizer_tensor_takes_the_parameter_sharding() -> None:
    model = TPModel(2, 1)
    sh = model.sharded_state_dict()["w2"]
    state = torch.ones(OUT, HID // 2, dtype=torch.float64)
    optim = make_sharded_optimizer_tensor(sh, state, "optimizer.state.exp_avg")
    assert isinstance(optim, ShardedTensor)
    assert optim.key == "optimizer.state.exp_avg.w2"
    assert (optim.global_shape, optim.global_offset) == (sh.global_shape, sh.global_offset)
    assert optim.dtype == torch.float64 and optim.data is state
    with pytest.raises(MappingError, match="'optimizer.state.exp_avg.w2' has shape"):
        make_sharded_optimizer_tensor(sh, torch.ones(3), "optimizer.state.exp_avg")


def test_state_of_an_unknown_parameter_is_refused() -> None:
    with pytest.raises(MappingError, match="Param id 7 does not match any model sharded param"):
        optim_state_to_sharding_state(
            {"state": {7: {"exp_avg": torch.zeros(1)}}, "param_groups": []}, {}
        )
