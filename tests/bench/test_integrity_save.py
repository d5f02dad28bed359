"""``bench/integrity_save.py`` on two ranks with a few MiB: a row per step and setting."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.bench.launch import TORCHRUN, bench_command, bench_env


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to python")
@pytest.mark.parametrize("layout", ["torch_dist", "raw_bytes"])
def test_integrity_save_prints_each_step_and_setting(tmp_path: Path, layout: str) -> None:
    args = ["--size-mib", "4", "--repeat", "2", "--layout", layout]
    cmd, env = bench_command("integrity_save.py", args, 2), bench_env(tmp_path)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert f"2 rank(s), {layout}, 4 MiB" in proc.stdout, proc.stdout
    rows = {" ".join(line.split()[:2]): line.split()[2:] for line in proc.stdout.splitlines()[1:]}
    expected = {f"{s} {v}" for s in ("sync", "finalize") for v in ("plain", "verify_integrity")}
    assert set(rows) == expected, proc.stdout
    assert all(len(v) == 2 and all(float(t) > 0 for t in v) for v in rows.values())
