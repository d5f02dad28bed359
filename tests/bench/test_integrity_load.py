"""``bench/integrity_load.py`` on two ranks with a few MiB: a row per setting."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.bench.launch import TORCHRUN, bench_command, bench_env


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to python")
def test_integrity_load_prints_both_settings(tmp_path: Path) -> None:
    args = ["--size-mib", "4", "--repeat", "2"]
    cmd, env = bench_command("integrity_load.py", args, 2), bench_env(tmp_path)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "2 rank(s), every rank reads all 4 MiB" in proc.stdout, proc.stdout
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[1:]}
    assert set(rows) == {"plain", "verify_integrity"}, proc.stdout
    assert all(len(v) == 2 and all(float(t) > 0 for t in v) for v in rows.values())
