"""The benchmark table driver (``bench/table.py``) in quick mode, with tiny cases.

It must print one row per case, rank count and method, with every column filled for
the methods that ran and "n/a (...)" for those that cannot run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = ("big", "mid", "small")
METHODS = ("ours", "raw_bytes", "fully_parallel", "dcp", "megatron", "raw")
COLUMNS = (
    "save GB/s",
    "load GB/s",
    "save us/t",
    "load us/t",
    "plan 1st s",
    "plan cached s",
    "peak RSS MiB",
    "state MiB",
    "files",
)
TINY = ["--big-mib", "1", "--big-count", "4", "--mid-count", "20", "--small-count", "40"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_table_has_every_row_and_column(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    results = tmp_path / "results.json"
    cmd = [sys.executable, str(ROOT / "bench" / "table.py"), "--ranks", "1,2", "--quick"]
    cmd += ["--json", str(results), "--dir", str(tmp_path), *TINY]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    header = lines[0]
    for column in ("case", "ranks", "method", *COLUMNS):
        assert column in header, column
    table = {tuple(line.split()[:3]): line.split()[3:] for line in lines[1:] if line.strip()}
    for case in CASES:
        for ranks in ("1", "2"):
            for method in METHODS:
                cells = table.get((case, ranks, method))
                assert cells is not None, (case, ranks, method, proc.stdout)
                if cells[0] == "n/a":
                    assert method in ("raw_bytes", "megatron"), (case, ranks, method, cells)
                    continue
                assert len(cells) == len(COLUMNS), (case, ranks, method, cells)
                plans = method in ("ours", "raw_bytes")
                for name, cell in zip(COLUMNS, cells):
                    if name.startswith("plan") and not plans:
                        assert cell == "-", (case, ranks, method, name)
                    else:
                        assert float(cell) >= 0, (case, ranks, method, name, cell)
    merged = json.loads(results.read_text())
    assert [r["ranks"] for r in merged] == [1, 2]
    assert any(line.startswith("big, 1 rank(s): ours save at") for line in lines)
    assert any(line.startswith("mid, 2 rank(s): ours load") for line in lines)


def test_a_method_over_its_time_budget_is_skipped_with_the_estimate() -> None:
    import argparse

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from table_run import over_budget
    finally:
        sys.path.remove(str(ROOT / "bench"))
    mid = {"status": "ok", "save_s": 6.0, "load_s": 4.0}  # 1 ms per tensor
    result = {"cases": {"mid": {"tensors": 10_000, "methods": {"dcp": mid}}}}
    args = argparse.Namespace(method_budget_s=300.0, repeat=3)
    assert over_budget(result, "dcp", 100_000, args) == ""  # 100 s x 3 runs: within 300 s
    tight = argparse.Namespace(method_budget_s=299.0, repeat=3)
    reason = over_budget(result, "dcp", 100_000, tight)
    assert reason.startswith("n/a (skipped") and "~300 s estimated" in reason
    assert over_budget(result, "ours", 100_000, args) == ""  # nothing measured yet: run
    assert (
        over_budget(result, "dcp", 100_000, argparse.Namespace(method_budget_s=0, repeat=3)) == ""
    )
