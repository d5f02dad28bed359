"""``bench/first_load.py`` on a few tensors and two ranks: a row per load."""

from __future__ import annotations

from pathlib import Path

from tests.bench.launch import run_bench


def test_first_load_prints_a_row_per_load(tmp_path: Path) -> None:
    args = ["--tensors", "120", "--sizes-kib", "1,3", "--loads", "2", "--root", str(tmp_path / "c")]
    lines = run_bench("first_load.py", args, tmp_path, ranks=2, timeout=180)
    assert lines[0] == "120 tensors, 2 rank(s)", lines
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["1", "2"], lines
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), lines
