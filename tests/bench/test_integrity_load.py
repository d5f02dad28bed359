"""``bench/integrity_load.py`` on two ranks with a few MiB: a row per setting."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to python")
def test_integrity_load_prints_both_settings(tmp_path: Path) -> None:
    script = str(ROOT / "bench" / "integrity_load.py")
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", script, "--size-mib", "4"]
    env = dict(os.environ, TMPDIR=str(tmp_path), MASTER_PORT=str(_free_port()))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        cmd + ["--repeat", "2"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "2 rank(s), every rank reads all 4 MiB" in proc.stdout, proc.stdout
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[1:]}
    assert set(rows) == {"plain", "verify_integrity"}, proc.stdout
    assert all(len(v) == 2 and all(float(t) > 0 for t in v) for v in rows.values())
