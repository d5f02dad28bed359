"""Property test: with the raw_bytes layout, any save layout loads into any other, bit-exact.

The same random batches as ``test_resharding_properties`` (grids, distributed-optimizer
flat ranges with uneven and empty pieces, replicas; random owners, shapes and dtypes),
saved with ``get_default_save_sharded_strategy("raw_bytes", 1)`` on 2 ranks and loaded
through ``dist_checkpointing.load``, planned over the whole index or over the entries each
rank's request can meet (``RAW_NARROW_ENTRIES``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from tests.multirank.test_resharding_properties import WORLD_SIZE, _batches
from tests.support.harness import run_distributed
from tests.support.layouts import TensorSpec, load_specs, loaded_mismatches, sharded_state_dict


def _save_and_load(
    ckpt_dir: Path, saved: list[TensorSpec], requested: list[TensorSpec], narrow: bool
) -> bytes:
    # narrow: the load plans over the index entries its request can meet only
    os.environ["DIST_CKPT_RAW_NARROW_ENTRIES"] = "0" if narrow else "65536"
    strategy = get_default_save_sharded_strategy("raw_bytes", 1)
    dc.save(sharded_state_dict(saved, dist.get_rank()), ckpt_dir, strategy)
    return load_specs(ckpt_dir, requested)


@pytest.mark.slow
@settings(
    max_examples=15,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=_batches, narrow=st.booleans())
def test_raw_bytes_any_save_layout_loads_into_any_load_layout(
    batch: tuple[tuple[TensorSpec, TensorSpec], ...], narrow: bool
) -> None:
    saved = [s for s, _ in batch]
    requested = [r for _, r in batch]
    with tempfile.TemporaryDirectory(prefix="dcp-raw-props-") as ckpt_dir:
        results = run_distributed(_save_and_load, WORLD_SIZE, ckpt_dir, saved, requested, narrow)
    problems = loaded_mismatches(results, requested)
    if problems:
        bad = {p.split("'")[1] for p in problems}
        layouts = [f"{s.key} {s.shape} saved as {s.layout}" for s in saved if s.key in bad]
        raise AssertionError("\n".join(problems + layouts))
