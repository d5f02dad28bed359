"""``bench/metadata_read.py`` with a few tensors: a row per step and stage count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_metadata_read_prints_every_step() -> None:
    script = str(ROOT / "bench" / "metadata_read.py")
    cmd = [sys.executable, script, "--tensors", "200", "--stages", "1", "4", "--repeat", "2"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows = {line[:22].strip(): line[22:].split() for line in proc.stdout.splitlines()[2:]}
    assert set(rows) == {"index, whole", "index, 1/1", "index, 1/4", "record", "record + one file"}
    assert all(len(v) == 2 and 0 <= float(v[0]) <= float(v[1]) for v in rows.values()), proc.stdout
