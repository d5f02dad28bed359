"""The registry of default strategies (dist_checkpointing.strategies.base).

Every test runs on a fresh, *empty* registry: ``fresh_registry`` here overrides the
suite-wide autouse fixture of the same name (conftest.py, which only snapshots and
restores). The built-in strategies register themselves again on the first lookup, and
the original registry is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import CheckpointingException, StrategyNotFoundError
from dist_checkpointing.mapping import ShardedStateDict
from dist_checkpointing.strategies.base import (
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
    isolated_registry,
    register_default_strategy,
    registered_strategies,
)
from dist_checkpointing.strategies.common import TorchCommonLoadStrategy, TorchCommonSaveStrategy
from dist_checkpointing.strategies.raw_bytes import RawBytesSaveShardedStrategy
from dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    """An empty registry for the test; the previous content is restored afterwards."""
    with isolated_registry(empty=True):
        yield


class DummySaveStrategy(SaveShardedStrategy):
    """A save strategy that records what it was given and writes nothing."""

    def __init__(self, backend: str = "dummy", version: int = 1, objects: bool = True) -> None:
        super().__init__(backend, version)
        self.objects = objects
        self.saved: list[ShardedStateDict] = []

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.objects

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        self.saved.append(sharded_state_dict)


class CountingLoadStrategy(TorchDistLoadShardedStrategy):
    """The torch_dist load strategy, counting its loads."""

    def __init__(self) -> None:
        super().__init__()
        self.loads = 0

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> Any:
        self.loads += 1
        return super().load(sharded_state_dict, checkpoint_dir)


def test_fixture_gives_an_empty_registry() -> None:
    assert dict(registered_strategies(load_builtins=False)) == {}


def test_builtin_strategies_register_on_lookup() -> None:
    assert isinstance(
        get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1),
        TorchDistLoadShardedStrategy,
    )
    assert isinstance(
        get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1),
        TorchDistSaveShardedStrategy,
    )
    assert isinstance(
        get_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1), TorchCommonLoadStrategy
    )
    assert isinstance(
        get_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1), TorchCommonSaveStrategy
    )
    assert isinstance(
        get_default_strategy(StrategyAction.SAVE_SHARDED, "raw_bytes", 1),
        RawBytesSaveShardedStrategy,
    )
    assert set(registered_strategies()) == {
        ("load_sharded", "torch_dist", 1),
        ("save_sharded", "torch_dist", 1),
        ("load_sharded", "raw_bytes", 1),
        ("save_sharded", "raw_bytes", 1),
        ("load_common", "torch", 1),
        ("save_common", "torch", 1),
    }
    # Lookups are stable: the same default object every time.
    first = get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1)
    assert get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1) is first


def test_register_and_lookup() -> None:
    strategy = DummySaveStrategy("dummy", 3)
    register_default_strategy(StrategyAction.SAVE_SHARDED, "dummy", 3, strategy)
    assert get_default_strategy(StrategyAction.SAVE_SHARDED, "dummy", 3) is strategy
    assert registered_strategies()[("save_sharded", "dummy", 3)] is strategy
    # Registered for one action only.
    with pytest.raises(StrategyNotFoundError):
        get_default_strategy(StrategyAction.LOAD_SHARDED, "dummy", 3)
    with pytest.raises(StrategyNotFoundError):
        get_default_strategy(StrategyAction.SAVE_SHARDED, "dummy", 2)


def test_registering_another_strategy_needs_clobber() -> None:
    first, second = DummySaveStrategy(), DummySaveStrategy()
    register_default_strategy(StrategyAction.SAVE_SHARDED, "dummy", 1, first)
    with pytest.raises(CheckpointingException) as info:
        register_default_strategy(StrategyAction.SAVE_SHARDED, "dummy", 1, second)
    msg = str(info.value)
    assert "dummy" in msg and "clobber=True" in msg
    assert get_default_strategy(StrategyAction.SAVE_SHARDED, "dummy", 1) is first

    # Registering the same object again is not a conflict.
    register_default_strategy(StrategyAction.SAVE_SHARDED, "dummy", 1, first)

    register_default_strategy(StrategyAction.SAVE_SHARDED, "dummy", 1, second, clobber=True)
    assert get_default_strategy(StrategyAction.SAVE_SHARDED, "dummy", 1) is second


def test_clobbering_a_builtin_survives_builtin_registration() -> None:
    builtin = get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1)
    custom = TorchDistSaveShardedStrategy(thread_count=1)
    with pytest.raises(CheckpointingException):
        register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, custom)
    assert get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1) is builtin
    register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, custom, clobber=True)
    assert get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1) is custom
    assert dcp.get_default_save_sharded_strategy() is custom


def test_registration_before_first_lookup_is_kept() -> None:
    custom = CountingLoadStrategy()
    register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, custom)
    assert get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1) is custom


def test_load_dispatches_through_the_registry(tmp_path: Path) -> None:
    data = torch.arange(12.0).reshape(3, 4)
    dcp.save({"t": ShardedTensor.from_rank_offsets("t", data.clone())}, tmp_path)
    custom = CountingLoadStrategy()
    register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, custom, clobber=True)
    out = dcp.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(3, 4))}, tmp_path)
    assert isinstance(out, dict)
    assert custom.loads == 1 and torch.equal(out["t"], data)
    assert dcp.get_default_load_sharded_strategy(tmp_path) is custom


def test_save_with_registered_backend_tuple(tmp_path: Path) -> None:
    dummy = DummySaveStrategy("dummy", 2)
    register_default_strategy(StrategyAction.SAVE_SHARDED, "dummy", 2, dummy)
    sh = ShardedTensor.from_rank_offsets("t", torch.ones(2))
    dcp.save({"t": sh}, tmp_path, sharded_strategy=("dummy", 2))
    assert len(dummy.saved) == 1 and dummy.saved[0]["t"] is sh
    config = dcp.core.maybe_load_config(tmp_path)
    assert config is not None and (config.sharded_backend, config.sharded_backend_version) == (
        "dummy",
        2,
    )
    # Loading it needs a registered loader: the error lists what is registered.
    with pytest.raises(StrategyNotFoundError) as info:
        dcp.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(2))}, tmp_path)
    assert "'dummy' version 2" in str(info.value) and "torch_dist v1" in str(info.value)


def test_save_with_strategy_that_does_not_handle_objects(tmp_path: Path) -> None:
    dummy = DummySaveStrategy("dummy", 2, objects=False)
    sh = ShardedTensor.from_rank_offsets("t", torch.ones(2))
    dcp.save({"t": sh}, tmp_path, sharded_strategy=dummy)  # no ShardedObject in it
    assert len(dummy.saved) == 1 and dummy.saved[0]["t"] is sh


def test_registered_strategies_is_a_read_only_live_view() -> None:
    view = registered_strategies()
    key = ("save_sharded", "torch_dist", 1)
    with pytest.raises(TypeError):
        view[key] = DummySaveStrategy()  # type: ignore[index]
    with pytest.raises(TypeError):
        del view[key]  # type: ignore[attr-defined]
    assert not hasattr(view, "clear") and not hasattr(view, "update")
    # It shows later registrations.
    dummy = DummySaveStrategy()
    register_default_strategy(StrategyAction.SAVE_SHARDED, "dummy", 1, dummy)
    assert view[("save_sharded", "dummy", 1)] is dummy


def test_unknown_pair_lists_registered_strategies_of_that_action() -> None:
    register_default_strategy(StrategyAction.LOAD_SHARDED, "mine", 4, CountingLoadStrategy())
    register_default_strategy(StrategyAction.SAVE_SHARDED, "save_only", 1, DummySaveStrategy())
    with pytest.raises(StrategyNotFoundError) as info:
        get_default_strategy(StrategyAction.LOAD_SHARDED, "nope", 9)
    msg = str(info.value)
    assert "'nope' version 9" in msg and "load_sharded" in msg
    assert "torch_dist v1" in msg and "mine v4" in msg
    assert "save_only" not in msg  # other actions are not listed
    assert isinstance(info.value, KeyError)
    assert not msg.startswith(("'", '"'))  # not quoted like a plain KeyError


def test_known_unavailable_backend_says_how() -> None:
    with pytest.raises(StrategyNotFoundError) as info:
        get_default_strategy(StrategyAction.LOAD_SHARDED, "zarr", 1)
    msg = str(info.value)
    assert "zarr" in msg and "pip install" in msg and "torch_dist v1" in msg
