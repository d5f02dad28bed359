"""MCoreTensorAwareStateDict in one process: conversion to and from the sharded state dict,
popping and inserting tensors, device bookkeeping, errors, and the module without
nvidia-resiliency-ext (checked in a subprocess that cannot import it).

The multi-rank behaviour (fully parallel distribution and exchange, nvidia-resiliency-ext's
LocalCheckpointManager) is in ``tests/multirank/test_tensor_aware_state_dict.py``.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_checkpointing import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from dist_checkpointing.dict_utils import nested_values
from dist_checkpointing.errors import (
    CheckpointingException,
    InvalidArgumentError,
    KeyMismatchError,
)
from dist_checkpointing.tensor_aware_state_dict import HAVE_NVRX, MCoreTensorAwareStateDict
from tests.support.layouts import poison, reference_tensor, same_bits

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"a": (6, 4), "b": (10,), "c.0": (3, 2), "c.1": (3, 2)}

needs_nvrx = pytest.mark.skipif(not HAVE_NVRX, reason="nvidia-resiliency-ext is not installed")


def _split_build(key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any) -> list:
    return [
        ShardedTensor.from_rank_offsets(f"{key}.{i}", half) for i, half in enumerate(t.chunk(2))
    ]


def _split_merge(halves: list) -> torch.Tensor:
    return torch.cat(halves)


def _state(poisoned: bool = False) -> dict[str, Any]:
    def tensor(key: str) -> torch.Tensor:
        t = reference_tensor(key, SHAPES[key], torch.float32)
        return poison(t) if poisoned else t.clone()

    c = torch.cat([tensor("c.0"), tensor("c.1")])
    return {
        "a": ShardedTensor.from_rank_offsets("a", tensor("a")),
        "nested": {"b": ShardedTensor.from_rank_offsets("b", tensor("b")), "step": 3},
        "c": ShardedTensorFactory("c", c, _split_build, _split_merge),
        "obj": ShardedObject("obj", None if poisoned else {"rng": [1, 2]}, (1,), (0,)),
        "local": LocalNonpersistentObject("kept"),
        "config": {"lr": 0.1},
    }


def _check_loaded(loaded: dict[str, Any]) -> None:
    assert same_bits(loaded["a"], reference_tensor("a", SHAPES["a"], torch.float32))
    assert same_bits(loaded["nested"]["b"], reference_tensor("b", SHAPES["b"], torch.float32))
    c = torch.cat([reference_tensor(k, SHAPES[k], torch.float32) for k in ("c.0", "c.1")])
    assert same_bits(loaded["c"], c)
    assert loaded["obj"] == {"rng": [1, 2]}
    assert loaded["nested"]["step"] == 3 and loaded["config"] == {"lr": 0.1}
    assert loaded["local"] == "kept"


@needs_nvrx
@pytest.mark.parametrize("algo", ["atomic", "fully_parallel"])
def test_round_trip_through_a_hollow_pickle(algo: str) -> None:
    tasd, distribution = MCoreTensorAwareStateDict.from_state_dict(_state(), algo=algo)
    assert distribution is None  # one process: nothing to distribute
    tensors = tasd.pop_tensors()
    assert tasd.is_hollow and len(tensors) == 4  # a, b, and the factory's two halves
    hollow = pickle.loads(pickle.dumps(tasd))
    assert all(v is None for v in _tensor_data(hollow))
    hollow.insert_tensors(tensors)
    assert not hollow.is_hollow
    _check_loaded(hollow.to_state_dict(_state(poisoned=True)))


def _tensor_data(tasd: MCoreTensorAwareStateDict) -> list[Any]:
    return [
        sh.data for sh in nested_values(tasd.sharded_state_dict) if isinstance(sh, ShardedTensor)
    ]


@needs_nvrx
def test_from_state_dict_leaves_the_callers_data_and_splits_common_state() -> None:
    state = _state()
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(state, algo="atomic")
    tasd.pop_tensors()
    assert state["a"].data is not None and state["nested"]["b"].data is not None
    assert tasd.common_state_dict == {"nested": {"step": 3}, "config": {"lr": 0.1}}
    assert "local" not in tasd.common_state_dict


@needs_nvrx
def test_init_tensors_allocates_like_the_popped_ones() -> None:
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_state(), algo="atomic")
    popped = tasd.pop_tensors()
    tasd.init_tensors()
    fresh = list(tasd.tensors)
    assert [(t.shape, t.dtype, t.device) for t in fresh] == [
        (t.shape, t.dtype, t.device) for t in popped
    ]
    for new, old in zip(fresh, popped):
        new.copy_(old)
    _check_loaded(tasd.to_state_dict(_state(poisoned=True)))


@needs_nvrx
def test_copy_tensors_to_cpu_snapshots_cpu_tensors() -> None:
    state = _state()
    original = state["a"].data
    expected = original.clone()
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(state, algo="atomic")
    tasd.copy_tensors_to_cpu()
    original.add_(1)  # training goes on: the snapshot must not change
    tasd.restore_tensor_device()  # nothing was moved: a no-op
    loaded = tasd.to_state_dict(_state(poisoned=True))
    assert same_bits(loaded["a"], expected)


def test_a_tensor_inserted_on_another_device_goes_back_on_restore() -> None:
    # The meta device stands in for an accelerator: popped from "meta", inserted on the CPU.
    sh = ShardedTensor.from_rank_offsets("m", torch.empty(4, 2, device="meta"))
    tasd = MCoreTensorAwareStateDict(common={}, sharded_state_dict={"m": sh})
    (popped,) = tasd.pop_tensors()
    tasd.insert_tensors([torch.zeros(4, 2)])
    assert next(iter(tasd.tensors)).device.type == "cpu"
    tasd.restore_tensor_device()
    assert next(iter(tasd.tensors)).device.type == "meta"
    # An insert on the same device leaves nothing to restore.
    tasd.insert_tensors(tasd.pop_tensors())
    tasd.restore_tensor_device()
    assert next(iter(tasd.tensors)).device.type == "meta"


def test_hollow_state_is_checked() -> None:
    sh = ShardedTensor.from_rank_offsets("x", torch.zeros(2))
    tasd = MCoreTensorAwareStateDict(common={}, sharded_state_dict={"x": sh})
    with pytest.raises(CheckpointingException, match="insert_tensors: it is not hollow"):
        tasd.insert_tensors([])
    with pytest.raises(CheckpointingException, match="init_tensors: it is not hollow"):
        tasd.init_tensors()
    tasd.pop_tensors()
    for call in (
        lambda: tasd.pop_tensors(),
        lambda: tasd.tensors,
        lambda: tasd.copy_tensors_to_cpu(),
        lambda: tasd.restore_tensor_device(),
        lambda: tasd.to_state_dict({}),
    ):
        with pytest.raises(CheckpointingException, match="it is hollow"):
            call()
    with pytest.raises(InvalidArgumentError, match="got 2 tensors for 1 popped"):
        tasd.insert_tensors([torch.zeros(2), torch.zeros(2)])


@needs_nvrx
def test_unknown_algorithm() -> None:
    with pytest.raises(InvalidArgumentError, match="'two_stage'"):
        MCoreTensorAwareStateDict.from_state_dict(_state(), algo="two_stage")
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_state(), algo="atomic")
    with pytest.raises(InvalidArgumentError, match="'two_stage'"):
        tasd.to_state_dict(_state(poisoned=True), algo="two_stage")


@needs_nvrx
def test_requested_key_absent_from_the_local_checkpoint() -> None:
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_state(), algo="atomic")
    request = _state(poisoned=True)
    request["extra"] = ShardedTensor.from_rank_offsets("extra", torch.zeros(3))
    with pytest.raises(KeyMismatchError, match="no data for the requested 'extra'"):
        tasd.to_state_dict(request)
    with pytest.raises(KeyMismatchError, match="Unexpected keys.*extra"):
        tasd.to_state_dict(_with_extra(), strict="raise_unexpected")
    loaded, missing, unexpected = tasd.to_state_dict(
        _with_extra(), strict="return_unexpected", return_mismatch_keys=True
    )
    assert unexpected == {"extra"} and missing == set() and "extra" not in loaded
    _check_loaded(loaded)


def _with_extra() -> dict[str, Any]:
    request = _state(poisoned=True)
    request["extra"] = ShardedTensor.from_rank_offsets("extra", torch.zeros(3))
    return request


@needs_nvrx
def test_empty_request_returns_the_common_state() -> None:
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_state(), algo="atomic")
    assert tasd.to_state_dict({}) == {"nested": {"step": 3}, "config": {"lr": 0.1}}
    assert tasd.to_state_dict({}, return_mismatch_keys=True)[1:] == (set(), set())


@needs_nvrx
def test_the_base_class_is_nvrx_when_installed() -> None:
    from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict

    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_state(), algo="atomic")
    assert isinstance(tasd, TensorAwareStateDict)
    assert list(tasd.values())[:2] == [tasd.common, tasd.sharded_state_dict]


_WITHOUT_NVRX = textwrap.dedent(
    """
    import sys
    sys.modules["nvidia_resiliency_ext"] = None  # any import of it raises ImportError
    import torch
    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.errors import MissingDependencyError, UnsupportedFeatureError
    from dist_checkpointing import tensor_aware_state_dict as tasd_module
    from dist_checkpointing._tensor_aware_base import TensorAwareStateDictBase

    assert not tasd_module.HAVE_NVRX
    assert tasd_module.TensorAwareStateDict is TensorAwareStateDictBase
    sh = ShardedTensor.from_rank_offsets("x", torch.arange(4.0))
    try:
        tasd_module.MCoreTensorAwareStateDict.from_state_dict({"x": sh})
    except MissingDependencyError as e:
        assert isinstance(e, ImportError) and isinstance(e, UnsupportedFeatureError)
        print(e)
    else:
        raise AssertionError("from_state_dict worked without nvidia-resiliency-ext")
    tasd = tasd_module.MCoreTensorAwareStateDict(common={}, sharded_state_dict={"x": sh})
    tasd.insert_tensors(tasd.pop_tensors())
    assert torch.equal(next(iter(tasd.tensors)), torch.arange(4.0))
    """
)


def test_without_nvrx_the_module_imports_and_says_what_to_install() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_NVRX],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert 'pip install "dist_checkpointing[nvrx]"' in result.stdout
    assert "pip install nvidia-resiliency-ext" in result.stdout
