"""``bench/raw_planning_scale.py`` on small simulated worlds: every step prints a row, the
derived index pieces equal real plans (the script asserts it) for either
distributed-optimizer layout, and the narrowed load plan
reads what the plan over the whole index reads (asserted too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.launch import run_bench


@pytest.mark.parametrize("layout", ["every-rank", "buffer"])
def test_raw_planning_scale_prints_every_step(tmp_path: Path, layout: str) -> None:
    args = ["--ranks", "32", "64", "--tensors", "40", "--optimizer", layout, "--no-memory"]
    lines = run_bench("raw_planning_scale.py", args, tmp_path, timeout=120)
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["32"] * 7 + ["64"] * 7, lines
    steps = [" ".join(r[1:3]) for r in rows[:7]]
    assert steps == [
        "plan (rank)",
        "plan cached",
        "unpickle pieces*",
        "merge+encode* (0",
        "parse (load)",
        "plan load",
        "plan load,",
    ], lines
    assert all(float(r[-1]) >= 0 for r in rows), lines
