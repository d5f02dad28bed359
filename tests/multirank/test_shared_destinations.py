"""One destination's memory requested under two keys whose stored values differ (a
model with tied weights loading a checkpoint saved untied, or two overlapping views).

Reads verify the bytes where they landed: a second read into the same memory (on
another reading thread, or before the first is verified) changed the bytes the first
one's checksums were computed on, and a valid checkpoint failed with
``ChecksumMismatchError``. The planners now give every destination that overlaps
another a buffer of its own; what is left in the shared memory is one of the values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from tests.support.harness import run_distributed


def _load_shared(root: str, backend: str, n: int) -> list[str]:
    a, b = torch.arange(float(n)), -torch.arange(float(n)) - 1
    strategy = dc.get_default_save_sharded_strategy(backend, 1)
    dc.save(
        {k: ShardedTensor.from_rank_offsets(k, v) for k, v in (("a", a), ("b", b))}, root, strategy
    )
    problems = []
    # The same tensor under both keys.
    same = torch.zeros(n)
    dc.load({k: ShardedTensor.from_rank_offsets(k, same) for k in "ab"}, root)
    if not (torch.equal(same, a) or torch.equal(same, b)):
        problems.append("same tensor: neither value")
    # Two views that overlap by half.
    buf = torch.zeros(n + n // 2)
    views = {"a": buf[:n], "b": buf[n // 2 :]}
    dc.load({k: ShardedTensor.from_rank_offsets(k, v) for k, v in views.items()}, root)
    if not torch.equal(buf[: n // 2], a[: n // 2]) or not torch.equal(buf[n:], b[n // 2 :]):
        problems.append("overlapping views: the parts only one key covers differ")
    middle = buf[n // 2 : n]
    if not (torch.equal(middle, a[n // 2 :]) or torch.equal(middle, b[: n - n // 2])):
        problems.append("overlapping views: the shared part holds neither value")
    return problems


@pytest.mark.parametrize("backend", ["torch_dist", "raw_bytes"])
@pytest.mark.parametrize("n", [1024, 8 << 20], ids=["4KiB", "32MiB"])
def test_one_memory_under_two_keys_loads_one_of_the_values(
    tmp_path: Path, backend: str, n: int
) -> None:
    (problems,) = run_distributed(_load_shared, 1, str(tmp_path), backend, n, timeout=180.0)
    assert problems == []
