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
from typing import Any

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
    "RSS +MiB",
    "state MiB",
    "files",
)
MCORE_BENCH_RELEASE = "0.16.1"  # MCORE_BENCH_VERSION in the Makefile
TINY = ["--big-mib", "1", "--big-count", "4", "--mid-count", "20", "--small-count", "40"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [[], ["--rounds"]], ids=["method-by-method", "rounds"])
def test_quick_table_has_every_row_and_column(tmp_path: Path, mode: list[str]) -> None:
    """With Megatron-Core in ``.mcore-site`` (``make test`` installs it), its row is
    measured too, as ``make bench`` measures it."""
    env = dict(os.environ)
    mcore = ROOT / ".mcore-site" / MCORE_BENCH_RELEASE
    with_mcore = (mcore / "megatron" / "core").is_dir()
    paths = [str(ROOT), str(mcore) if with_mcore else "", env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    results = tmp_path / "results.json"
    cmd = [sys.executable, str(ROOT / "bench" / "table.py"), "--ranks", "1,2", "--quick"]
    cmd += ["--json", str(results), "--dir", str(tmp_path), *TINY, *mode]
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
                    assert not (method == "megatron" and with_mcore), cells
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
    assert any(line.startswith("mid, 2 rank(s): fully_parallel peak RSS") for line in lines)


def test_a_method_over_its_time_budget_is_skipped_with_the_estimate() -> None:
    import argparse

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from table_run import over_budget
    finally:
        sys.path.remove(str(ROOT / "bench"))

    def case(tensors: int, nbytes: int, seconds: float) -> dict[str, Any]:
        run = {"status": "ok", "save_s": seconds / 2, "load_s": seconds / 2}
        return {"tensors": tensors, "bytes": nbytes, "methods": {"dcp": run}}

    def budget(seconds: float) -> argparse.Namespace:
        return argparse.Namespace(method_budget_s=seconds, repeat=1)

    gib = 1 << 30
    # One case of few large tensors: the time is in the bytes; 10,000 small tensors of
    # 248 MB are not extrapolated per tensor (that would give 200 s).
    big_only = {"cases": {"big": case(200, gib, 4.0)}}
    assert over_budget(big_only, "dcp", 10_000, 248 << 20, budget(150)) == ""
    # Two cases: seconds per tensor and per byte are fitted (here 1 ms per tensor and
    # 1 s per GiB), and 100,000 tensors of 1 KiB are estimated at about 100 s.
    both = {"cases": {"big": case(200, gib, 1.2), "mid": case(10_000, gib // 4, 10.25)}}
    assert over_budget(both, "dcp", 100_000, 100 << 20, budget(150)) == ""
    reason = over_budget(both, "dcp", 100_000, 100 << 20, budget(60))
    assert reason.startswith("n/a (skipped: ~100 s estimated"), reason
    assert over_budget(both, "ours", 100_000, 100 << 20, budget(60)) == ""  # never measured
    assert over_budget(both, "dcp", 100_000, 100 << 20, budget(0)) == ""  # no limit


def test_the_raw_baseline_uses_memory_like_the_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The baseline's buffers come from torch's allocator, as every method's tensors do (a
    bytearray's small pages made its page-cache reads up to 2.7x slower), and hold the
    tensors' bytes in order."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import common

    tensors = [torch.arange(5, dtype=torch.float32), torch.arange(3, dtype=torch.int64)]
    blob = common.raw_blob(tensors)
    assert not isinstance(blob, bytearray)
    assert bytes(blob) == b"".join(t.numpy().tobytes() for t in tensors)
    assert isinstance(blob.base, torch.Tensor)  # a view of torch-allocated memory
    buf = common.host_buffer(1 << 20)
    assert len(memoryview(buf)) == 1 << 20 and not memoryview(buf).readonly


def test_megatrons_stand_ins_apply_only_while_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without CUDA the megatron row gives Megatron-Core's two CUDA calls CPU stand-ins
    (and ``numpy.product`` under NumPy 2), only inside its save and load, and puts the
    originals back after (also when the call raises)."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import mcore_compat
    import numpy as np

    if torch.cuda.is_available():
        pytest.skip("with CUDA the stand-ins are not used")
    sync, current = torch.cuda.synchronize, torch.cuda.current_device
    had_product = hasattr(np, "product")
    with mcore_compat.stand_ins():
        assert np.product([2, 3]) == 6  # NumPy 2 removed it; Megatron-Core 0.13 calls it
        torch.cuda.synchronize()  # torch's own raises without CUDA
        flag = torch.tensor([1], device=torch.cuda.current_device())
        assert flag.device.type == "cpu"
    assert (torch.cuda.synchronize, torch.cuda.current_device) == (sync, current)
    with pytest.raises(KeyError), mcore_compat.stand_ins():
        raise KeyError("x")
    assert (torch.cuda.synchronize, torch.cuda.current_device) == (sync, current)
    assert hasattr(np, "product") == had_product
