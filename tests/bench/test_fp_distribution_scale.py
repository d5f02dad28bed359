"""``bench/fp_distribution_scale.py`` on small simulated groups: every step prints a row,
and the script's own check (the owners' assignment equals the gathered greedy's) holds."""

from __future__ import annotations

from pathlib import Path

from tests.bench.launch import run_bench


def test_fp_distribution_scale_prints_every_step(tmp_path: Path) -> None:
    args = ["--ranks", "16", "64", "--tensors", "40", "--optimizer", "--no-memory"]
    lines = run_bench("fp_distribution_scale.py", args, tmp_path, timeout=120)
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["16"] * 5 + ["64"] * 5, lines
    steps = [r[1] for r in rows[:5]]
    assert steps == ["rows", "owner", "combine", "=", "gathered"], lines
    assert all(float(r[-1]) >= 0 for r in rows), lines
