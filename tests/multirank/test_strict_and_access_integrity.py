"""Unexpected keys under every ``StrictHandling`` mode, with and without
``validate_access_integrity``, as Megatron-Core's ``load`` handles them.

Megatron-Core's order (``serialization.load`` then
``validation.validate_integrity_and_strict_load``): the request's metadata is taken
first (Megatron-Core gathers it from every rank; this library sends each record to the
owner of its key); strict handling then compares it with the checkpoint and drops
unexpected keys from the request (per mode: raise, log, return or ignore); finally,
with ``validate_access_integrity``, the sharding check runs on the records taken
*before* the drop. So an unexpected key whose request does not cover its global shape
still fails the sharding check when it is on, in every mode, and is simply dropped
when it is off.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor, StrictHandling
from dist_checkpointing import errors as E

S = StrictHandling
EXTRA = "not_in_ckpt"
DROPPING_MODES = [S.LOG_UNEXPECTED, S.LOG_ALL, S.RETURN_UNEXPECTED, S.RETURN_ALL, S.IGNORE_ALL]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    dcp.save(
        {"a": ShardedTensor.from_rank_offsets("a", torch.arange(12.0).reshape(3, 4))}, tmp_path
    )
    return tmp_path


def _request(partial_extra: bool) -> dict[str, Any]:
    extra = torch.zeros(2, 4)
    if partial_extra:  # rows 0..1 of a (4, 4) tensor: the request does not cover it
        sh = ShardedTensor.from_rank_offsets(EXTRA, extra, (0, 0, 2))
    else:
        sh = ShardedTensor.from_rank_offsets(EXTRA, extra)
    return {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(3, 4)), "x": sh}


def _loaded(out: Any) -> dict[str, Any]:
    sd = out[0] if isinstance(out, tuple) else out
    assert torch.equal(sd["a"], torch.arange(12.0).reshape(3, 4))
    assert "x" not in sd
    return dict(sd)


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "no_validate"])
@pytest.mark.parametrize("mode", DROPPING_MODES, ids=[m.value for m in DROPPING_MODES])
def test_unexpected_key_is_dropped(ckpt: Path, mode: StrictHandling, validate: bool) -> None:
    out = dcp.load(_request(False), ckpt, validate_access_integrity=validate, strict=mode)
    _loaded(out)
    if mode in (S.RETURN_UNEXPECTED, S.RETURN_ALL):
        assert isinstance(out, tuple) and out[2] == {EXTRA}


@pytest.mark.parametrize("mode", DROPPING_MODES, ids=[m.value for m in DROPPING_MODES])
def test_incomplete_unexpected_key_fails_the_sharding_check(
    ckpt: Path, mode: StrictHandling
) -> None:
    with pytest.raises(E.ShardingError) as info:
        dcp.load(_request(True), ckpt, validate_access_integrity=True, strict=mode)
    assert EXTRA in str(info.value)


@pytest.mark.parametrize("mode", DROPPING_MODES, ids=[m.value for m in DROPPING_MODES])
def test_incomplete_unexpected_key_without_the_check_is_dropped(
    ckpt: Path, mode: StrictHandling, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dist_checkpointing")
    _loaded(dcp.load(_request(True), ckpt, validate_access_integrity=False, strict=mode))


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "no_validate"])
@pytest.mark.parametrize("mode", [S.ASSUME_OK_UNEXPECTED, S.RAISE_UNEXPECTED, S.RAISE_ALL])
def test_unexpected_key_raises(ckpt: Path, mode: StrictHandling, validate: bool) -> None:
    with pytest.raises(E.KeyMismatchError) as info:
        dcp.load(_request(False), ckpt, validate_access_integrity=validate, strict=mode)
    assert EXTRA in str(info.value)
    if mode is not S.ASSUME_OK_UNEXPECTED:
        assert "Unexpected keys" in str(info.value)  # Megatron-Core's wording
