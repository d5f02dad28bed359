"""Megatron-Core's small helpers: utils debug helpers, fp8 forcing, validation aliases."""

from __future__ import annotations

import logging

import pytest
import torch

from dist_checkpointing import ShardedTensor
from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from dist_checkpointing.utils import (
    debug_msg,
    debug_time,
    force_all_tensors_to_non_fp8,
    logger_stack,
    zip_strict,
)
from dist_checkpointing.validation import (
    adjust_non_strict_load,
    maybe_report_missing_and_unexpected_keys,
    validate_sharded_objects_handling,
)


def test_logger_stack_nests_names_and_loggers() -> None:
    mine = logging.getLogger("test.mine")
    with logger_stack("outer", mine) as (name, log):
        assert (name, log) == ("outer", mine)
        with logger_stack("inner") as (inner_name, inner_log):
            assert (inner_name, inner_log) == ("outer.inner", mine)
    with logger_stack() as (name, log):
        assert name == "" and log is logging.getLogger("dist_checkpointing.utils")


def test_debug_time_logs_the_scope_and_works_as_decorator(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.timing")

    @debug_time("step", log)
    def work() -> int:
        debug_msg("inside")
        return 3

    with caplog.at_level(logging.DEBUG, logger="test.timing"):
        assert work() == 3
    messages = [r.getMessage() for r in caplog.records]
    assert "step inside" in messages
    assert any(m.startswith("step took ") for m in messages)
    caplog.clear()
    with (
        caplog.at_level(logging.DEBUG, logger="test.timing"),
        debug_time("fast", log, threshold=60),
    ):
        pass
    assert not caplog.records  # under the threshold


def test_zip_strict_names_the_lengths() -> None:
    assert list(zip_strict([1, 2], "ab")) == [(1, "a"), (2, "b")]
    with pytest.raises(ValueError, match=r"\[2, 3\]"):
        zip_strict([1, 2], [1, 2, 3])


class _Quantized(torch.Tensor):
    """Stands in for a quantized tensor subclass (e.g. Transformer Engine's FP8)."""

    def dequantize(self) -> torch.Tensor:  # type: ignore[override]
        return torch.full(self.shape, 2.0)


def test_force_all_tensors_to_non_fp8_dequantizes_subclasses_only() -> None:
    quantized = torch.zeros(3).as_subclass(_Quantized)
    plain = torch.zeros(3, dtype=torch.float8_e4m3fn)
    sd = {
        "q": ShardedTensor.from_rank_offsets("q", quantized),
        "p": ShardedTensor.from_rank_offsets("p", plain),
    }
    force_all_tensors_to_non_fp8(sd)
    assert type(sd["q"].data) is torch.Tensor and torch.equal(sd["q"].data, torch.full((3,), 2.0))
    assert sd["p"].data is plain


def test_validation_aliases() -> None:
    sd = {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(1)), "b": 1}
    assert set(adjust_non_strict_load(sd, {"a"})) == {"b"}
    with pytest.raises(CheckpointingException, match="Unexpected keys"):
        maybe_report_missing_and_unexpected_keys(set(), {"x"})
    maybe_report_missing_and_unexpected_keys(set(), {"x"}, raise_error=False)
    validate_sharded_objects_handling(TorchDistLoadShardedStrategy(), TorchCommonLoadStrategy())
    with pytest.raises(CheckpointingException, match="ShardedObjects handling"):
        validate_sharded_objects_handling(TorchCommonLoadStrategy(), TorchCommonLoadStrategy())  # type: ignore[arg-type]
