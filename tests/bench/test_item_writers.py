"""``bench/item_writers.py`` on a few tensors: a row per writer, raw's ratio 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_item_writers_prints_a_row_per_writer() -> None:
    script = str(ROOT / "bench" / "item_writers.py")
    cmd = [sys.executable, script, "--tensors", "200", "--sizes-kib", "1,70", "--repeat", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("200 tensors"), lines
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[2:]}
    assert set(rows) == {"torch_dist", "raw_bytes", "raw"}, proc.stdout
    assert all(values[0] > 0 for values in rows.values()), proc.stdout
    assert rows["raw"][-1] == 1.0
