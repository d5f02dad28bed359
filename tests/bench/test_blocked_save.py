"""``bench/blocked_save.py`` with a few tensors: a row per cache setting and a time per
save, on one rank (plain python) and on two (torchrun)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.bench.launch import TORCHRUN, bench_command, bench_env


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to python")
@pytest.mark.parametrize("ranks,persistent", [(1, False), (2, False), (1, True)])
def test_blocked_save_prints_a_time_per_save(ranks: int, persistent: bool, tmp_path: Path) -> None:
    args = ["--tensors", "30", "--saves", "3"] + (["--persistent"] if persistent else [])
    cmd, env = bench_command("blocked_save.py", args, ranks), bench_env(tmp_path)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert f"{ranks} rank(s)" in proc.stdout
    rows = {}
    for line in proc.stdout.splitlines():
        words = line.split()
        if words[:2] == ["no", "cache"]:
            rows["plain"] = words[2:]
        elif words[:1] == ["cached_metadata"]:
            rows["cached"] = words[1:]
        elif words[:3] == ["schedule,", "no", "cache"]:
            rows["schedule plain"] = words[3:]
        elif words[:2] == ["schedule,", "cached_metadata"]:
            rows["schedule cached"] = words[2:]
    assert ("persistent worker" if persistent else "temporal caller") in proc.stdout
    assert set(rows) == {"plain", "cached", "schedule plain", "schedule cached"}, proc.stdout
    assert all(len(times) == 3 for times in rows.values()), proc.stdout
    assert all(float(t) > 0 for times in rows.values() for t in times)
