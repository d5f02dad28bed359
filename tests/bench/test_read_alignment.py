"""``bench/read_alignment.py`` on a small file: a row per remainder, best >= median > 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_read_alignment_prints_every_remainder() -> None:
    script = str(ROOT / "bench" / "read_alignment.py")
    cmd = [sys.executable, script, "--size-mib", "8", "--item-mib", "0.5", "--repeat", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("15 reads of 0.5 MiB"), lines
    rows = {int(line.split()[0]): [float(v) for v in line.split()[1:]] for line in lines[2:]}
    assert set(rows) == {0, 1, 8, 16, 32, 48}
    assert all(best >= median > 0 for best, median in rows.values()), proc.stdout
