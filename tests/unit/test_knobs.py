"""Tunables: explicit argument, then environment, then default; bad values are refused."""

from __future__ import annotations

import pytest

from dist_checkpointing.engine import knobs
from dist_checkpointing.errors import InvalidArgumentError
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy


def test_default_when_nothing_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DIST_CKPT_SAVE_THREAD_COUNT", raising=False)
    assert knobs.SAVE_THREAD_COUNT.get() == 2


def test_environment_overrides_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIST_CKPT_SAVE_THREAD_COUNT", "5")
    monkeypatch.setenv("DIST_CKPT_RESULTS_TIMEOUT_S", "2.5")
    assert knobs.SAVE_THREAD_COUNT.get() == 5
    assert knobs.RESULTS_TIMEOUT_S.get() == 2.5
    assert TorchDistSaveShardedStrategy().thread_count == 5


def test_explicit_argument_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIST_CKPT_SAVE_THREAD_COUNT", "5")
    assert knobs.SAVE_THREAD_COUNT.get(3) == 3
    assert TorchDistSaveShardedStrategy(thread_count=1).thread_count == 1


@pytest.mark.parametrize("raw", ["two", "1.5"])
def test_malformed_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("DIST_CKPT_SAVE_THREAD_COUNT", raw)
    with pytest.raises(InvalidArgumentError, match="DIST_CKPT_SAVE_THREAD_COUNT"):
        knobs.SAVE_THREAD_COUNT.get()


def test_value_below_minimum_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIST_CKPT_SAVE_THREAD_COUNT", "0")
    with pytest.raises(InvalidArgumentError, match="below the minimum 1"):
        knobs.SAVE_THREAD_COUNT.get()


def test_every_knob_is_documented_in_the_module_table() -> None:
    assert knobs.__doc__ is not None
    for knob in knobs.ALL_KNOBS:
        assert knob.name in knobs.__doc__, knob.name
        assert knob.default >= knob.minimum, knob.name
