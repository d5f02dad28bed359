"""The forked persistent worker does not share the trainer's large CPU tensors."""

from __future__ import annotations

import os
import struct
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from dist_checkpointing.engine.fork_memory import tensor_ranges, tensors_wiped_on_fork

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")

MIB = 1 << 20


def _child_reads(t: torch.Tensor, indexes: list[int]) -> list[float]:
    """Values of ``t`` at ``indexes`` as a forked child sees them."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: read, report, leave at once
        try:
            os.write(write_end, struct.pack(f"{len(indexes)}d", *(float(t[i]) for i in indexes)))
        finally:
            os._exit(0)
    os.close(write_end)
    data = b""
    while len(data) < 8 * len(indexes):
        chunk = os.read(read_end, 4096)
        assert chunk, "the child died"
        data += chunk
    os.close(read_end)
    os.waitpid(pid, 0)
    return list(struct.unpack(f"{len(indexes)}d", data))


def test_a_fork_inside_gets_zeros_for_large_tensors_and_the_parent_keeps_its_values() -> None:
    t = torch.arange(4 * MIB // 4, dtype=torch.float32) + 1  # 4 MiB, no zero anywhere
    small = torch.ones(1000)
    middle, last = t.numel() // 2, t.numel() - 1
    with tensors_wiped_on_fork() as wiped:
        assert wiped >= 3 * MIB
        seen = _child_reads(t, [middle])
        seen_small = _child_reads(small, [5])
    assert seen == [0.0]  # the inside of the storage: a fresh zero page in the child
    assert seen_small == [1.0]  # below the size limit: shared as always
    assert float(t[middle]) == middle + 1 and float(t[last]) == last + 1
    # Outside the block a fork shares the pages again.
    assert _child_reads(t, [middle]) == [middle + 1]
    with tensors_wiped_on_fork(enabled=False) as wiped:
        assert wiped == 0
        assert _child_reads(t, [middle]) == [middle + 1]


def test_ranges_are_page_aligned_insides_of_each_storage_once() -> None:
    t = torch.zeros(3 * MIB // 4)
    view = t[10:]  # the same storage through another tensor
    ranges, storages = tensor_ranges()
    ptr, end = t.data_ptr(), t.data_ptr() + t.nbytes
    mine = [(a, n) for a, n in ranges if ptr <= a < end]
    assert len(mine) == 1 and view.untyped_storage().data_ptr() == ptr
    a, n = mine[0]
    assert a % os.sysconf("SC_PAGE_SIZE") == 0 and n % os.sysconf("SC_PAGE_SIZE") == 0
    assert ptr <= a and a + n <= end and n >= t.nbytes - 2 * os.sysconf("SC_PAGE_SIZE")
    assert any(s.data_ptr() == ptr for s in storages)


def _worker_growth(monkeypatch: pytest.MonkeyPatch, wipe: str, state: torch.Tensor) -> int:
    """How much memory only the persistent worker holds (its USS) grows while the trainer
    writes every byte of ``state`` once."""
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    monkeypatch.setenv("DIST_CKPT_ASYNC_WORKER_FORK", "1")
    monkeypatch.setenv("DIST_CKPT_WIPE_TENSORS_ON_FORK", wipe)
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    queue = AsyncCallsQueue(persistent=True)
    try:
        deadline = time.monotonic() + 30
        while not (workers := [p for p in me.children() if p.pid not in before]):
            assert time.monotonic() < deadline, "no worker process"
            time.sleep(0.05)
        time.sleep(0.5)
        start = workers[0].memory_full_info().uss
        state.add_(1)  # the trainer writes every page (an optimizer step)
        return int(workers[0].memory_full_info().uss - start)
    finally:
        queue.close()


@pytest.mark.parametrize("wipe", ["1", "0"], ids=["wiped", "shared"])
def test_the_worker_does_not_keep_copies_of_what_the_trainer_writes(
    monkeypatch: pytest.MonkeyPatch, wipe: str
) -> None:
    state = torch.full((128 * MIB // 4,), 2.0)  # 128 MiB of CPU state, resident
    growth = _worker_growth(monkeypatch, wipe, state)
    if wipe == "1":
        assert growth < 16 * MIB
    else:  # the kernel's copy-on-write, which the knob exists to avoid
        assert growth > 64 * MIB


@pytest.mark.parametrize(("wipe", "seen"), [("1", "0.0"), ("0", "3.0")])
def test_the_metadata_parse_check_forks_without_sharing_large_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wipe: str, seen: str
) -> None:
    """The forked parse check of a ``.metadata`` never reads the loader's tensors: it gets
    zero pages for them, so the load that follows writes into pages of its own."""
    from dist_checkpointing.engine.safety.cpu_bounded import run_cpu_bounded

    monkeypatch.setenv("DIST_CKPT_WIPE_TENSORS_ON_FORK", wipe)
    t = torch.full((4 * MIB // 4,), 3.0)
    out = tmp_path / "seen"

    def parse() -> None:  # runs in the forked child
        out.write_text(str(float(t[t.numel() // 2])))

    assert run_cpu_bounded(parse, cpu_s=10.0, source="test", hint="")
    assert out.read_text() == seen and float(t[t.numel() // 2]) == 3.0
