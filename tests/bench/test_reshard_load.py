"""``bench/reshard_load.py`` on a few small tensors: a row per case, method and load rank
count, each load checked bit for bit by the benchmark itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.launch import run_bench


@pytest.mark.slow
def test_reshard_load_prints_a_row_per_case_method_and_rank_count(tmp_path: Path) -> None:
    args = ["--mib", "2", "--count", "4", "--save-ranks", "2", "--load-ranks", "1,4"]
    args += ["--loads", "1", "--root", str(tmp_path / "c"), "--methods", "torch_dist,raw_bytes"]
    lines = run_bench("reshard_load.py", args, tmp_path)
    assert lines[0].startswith("4 tensors of (1024, 128) float32, 2 MiB, saved by 2"), lines
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (case, method, ranks)
        for case in ("grid", "flat")
        for method in ("torch_dist", "raw_bytes")
        for ranks in ("1", "4")
    ], lines
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows), lines
