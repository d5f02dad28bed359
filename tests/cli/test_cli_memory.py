"""Conversion memory is bounded by the largest tensor, not the checkpoint: the anonymous
memory (RssAnon) of a process converting 8 tensors of 16 MiB grows by far less than 128 MiB
(one tensor, 16 MiB, is what the safetensors writer holds; the torch.save path holds none)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_checkpointing
from dist_checkpointing import ShardedTensor

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20

PROBE = """
import sys, threading, time
from dist_checkpointing.cli import main

def anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0

base = anon()
peak = [base]
stop = False
def sample():
    while not stop:
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)
t = threading.Thread(target=sample, daemon=True)
t.start()
code = main(sys.argv[1:])
stop = True
t.join()
print(code, peak[0] - base)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_convert_memory_is_bounded_by_the_largest_tensor(tmp_path: Path, to: str) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    sd = {
        f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((4 * MIB,), float(i)))
        for i in range(8)
    }
    dist_checkpointing.save(sd, ckpt)
    dst = tmp_path / ("model.pt" if to == "torch" else "hf")
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "convert", str(ckpt), str(dst), "--to", to],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        # A fixed mmap threshold: glibc returns every freed tensor to the kernel at once
        # (its dynamic threshold would otherwise keep some on the heap, by timing).
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)},
    )
    assert proc.returncode == 0, proc.stderr
    code, growth = (int(x) for x in proc.stdout.split()[-2:])
    assert code == 0
    assert growth < 48 * MIB, f"anonymous memory grew by {growth / MIB:.0f} MiB"
    assert not list(tmp_path.glob("*.buf"))
