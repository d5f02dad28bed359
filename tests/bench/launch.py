"""Running a benchmark script from a test: its command (plain python, or torchrun with
``ranks`` processes) and an environment with a free port and a private temp dir."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def bench_command(script: str, args: list[str], ranks: int = 1) -> list[str]:
    """``python bench/<script> args``; with ``ranks`` > 1 (or 0: torchrun with one
    process), ``torchrun --standalone --nproc_per_node=ranks``."""
    path = str(ROOT / "bench" / script)
    if ranks == 1:
        return [sys.executable, path, *args]
    return [str(TORCHRUN), "--standalone", f"--nproc_per_node={max(ranks, 1)}", path, *args]


def bench_env(tmp_path: Path) -> dict[str, str]:
    """This environment with ``TMPDIR`` in ``tmp_path``, a free ``MASTER_PORT`` and the
    repository on ``PYTHONPATH``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = dict(os.environ, TMPDIR=str(tmp_path), MASTER_PORT=str(port))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_bench(
    script: str, args: list[str], tmp_path: Path, ranks: int = 1, timeout: float = 300
) -> list[str]:
    """Run ``bench/<script>`` (see :func:`bench_command`) in :func:`bench_env`; assert it
    succeeded and return its output lines."""
    proc = subprocess.run(
        bench_command(script, args, ranks),
        env=bench_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout.splitlines()
