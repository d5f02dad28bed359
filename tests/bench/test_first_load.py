"""``bench/first_load.py`` on a few tensors and two ranks: a row per load."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.bench.launch import bench_command, bench_env


def test_first_load_prints_a_row_per_load(tmp_path: Path) -> None:
    args = ["--tensors", "120", "--sizes-kib", "1,3", "--loads", "2", "--root", str(tmp_path / "c")]
    proc = subprocess.run(
        bench_command("first_load.py", args, ranks=2),
        env=bench_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "120 tensors, 2 rank(s)", proc.stdout
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["1", "2"], proc.stdout
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), proc.stdout
