"""Property test: a tensor saved in any layout loads into any other layout, bit-exact.

Hypothesis draws, per example, a batch of tensors (random shape of 1-3 axes of sizes
1..12, random dtype) each with a random save layout and a random load layout among:

- a regular grid (random per-axis fragmentations, blocks owned by random ranks),
- distributed-optimizer flat ranges over the blocks of a grid (random uneven boundaries,
  empty ranges included, pieces owned by random ranks),
- the whole tensor on every rank (``replica_id = rank``).

The whole batch is saved and loaded by one ``run_distributed`` call on 2 ranks (one
checkpoint per example, which keeps the test fast), and every loaded shard must equal
the corresponding slice of its reference tensor.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.support.harness import run_distributed
from tests.support.layouts import (
    Layout,
    TensorSpec,
    deal,
    flat_shards,
    grid_shards,
    load_specs,
    loaded_mismatches,
    replicated_layout,
    save_specs,
)

WORLD_SIZE = 2
TENSORS_PER_EXAMPLE = 20
MAX_BLOCKS = 16  # per layout, so that a batch stays a few hundred shards
MAX_CUTS = 3  # flat range boundaries per block
DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _fragmentations(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[int, ...]:
    fragm: list[int] = []
    for size in shape:
        budget = MAX_BLOCKS // math.prod(fragm)
        fragm.append(draw(st.sampled_from([d for d in _divisors(size) if d <= budget])))
    return tuple(fragm)


@st.composite
def _layouts(draw: st.DrawFn, shape: tuple[int, ...]) -> Layout:
    kind = draw(st.sampled_from(["grid", "flat", "replicated"]))
    if kind == "replicated":
        return replicated_layout(len(shape), WORLD_SIZE)
    fragm = draw(_fragmentations(shape))
    if kind == "grid":
        shards = grid_shards(fragm)
    else:
        block_numel = math.prod(s // f for s, f in zip(shape, fragm))
        cuts = st.lists(st.integers(0, block_numel), max_size=MAX_CUTS).map(sorted)
        shards = flat_shards(shape, fragm, [draw(cuts) for _ in range(math.prod(fragm))])
    owner = st.integers(0, WORLD_SIZE - 1)
    owners = draw(st.lists(owner, min_size=len(shards), max_size=len(shards)))
    return deal(shards, WORLD_SIZE, owners)


@st.composite
def _tensor(draw: st.DrawFn, key: str) -> tuple[TensorSpec, TensorSpec]:
    """The same tensor in its save layout and in its load layout."""
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    saved, loaded = draw(_layouts(shape)), draw(_layouts(shape))
    return TensorSpec(key, shape, dtype, saved), TensorSpec(key, shape, dtype, loaded)


_batches = st.tuples(*(_tensor(f"t{i}") for i in range(TENSORS_PER_EXAMPLE)))


def _save_and_load(ckpt_dir: Path, saved: list[TensorSpec], requested: list[TensorSpec]) -> bytes:
    save_specs(ckpt_dir, saved)
    return load_specs(ckpt_dir, requested)


@pytest.mark.slow
@settings(
    max_examples=20,
    deadline=None,
    # Shrinking re-runs multi-process examples for minutes; the failure report below
    # already names each failing tensor with both its layouts.
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=_batches)
def test_any_save_layout_loads_into_any_load_layout(
    batch: tuple[tuple[TensorSpec, TensorSpec], ...],
) -> None:
    saved = [s for s, _ in batch]
    requested = [r for _, r in batch]
    with tempfile.TemporaryDirectory(prefix="dcp-props-") as ckpt_dir:
        results = run_distributed(_save_and_load, WORLD_SIZE, ckpt_dir, saved, requested)
    problems = loaded_mismatches(results, requested)
    if problems:
        bad = {p.split("'")[1] for p in problems}
        saved_layouts = [f"{s.key} {s.shape} saved as {s.layout}" for s in saved if s.key in bad]
        raise AssertionError("\n".join(problems + saved_layouts))
