"""``bench/planning_scale.py`` on small simulated worlds, with each distributed-optimizer
layout: every step prints a row, and the simulated records are the library's own for
real ShardedTensors, their flat ranges covering each block once (the script asserts it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.launch import run_bench

STEPS = [
    "records+bin (rank)",
    "check (owner,",
    "digest (rank)",
    "common digest (rank)",
    "metadata* (",
    "cached metadata*",
    "cached metadata, later*",
    "unpickle (load)",
    "index (load,",
    "= first save*",
    "= cached save*",
    "= later cached saves*",
]


@pytest.mark.parametrize("optimizer", [[], ["--optimizer"], ["--optimizer", "buffer"]])
def test_planning_scale_prints_every_step(tmp_path: Path, optimizer: list[str]) -> None:
    args = ["--ranks", "32", "64", "--tensors", "40", "--skip-old", "--no-memory", *optimizer]
    lines = run_bench("planning_scale.py", args, tmp_path, timeout=120)
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["32"] * len(STEPS) + ["64"] * len(STEPS), lines
    steps = [" ".join(r[1:-1]) for r in rows[: len(STEPS)]]
    assert all(s.startswith(e) for s, e in zip(steps, STEPS)), lines
    assert all(float(r[-1]) >= 0 for r in rows), lines
