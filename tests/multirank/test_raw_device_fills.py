"""``raw_bytes`` fills of accelerator tensors through the staging pool, several at once.

:func:`~dist_checkpointing.engine.raw.load.fill_devices` streams each whole entry bound
for an accelerator tensor through the pool, one tensor per reading thread (at most one
per pool buffer). The pool and :func:`fill_from_host` work the same with CPU targets (no
stream to copy on), so the threads, the pool's bounds and the reports of damage are
checked here without a GPU; ``tests/multirank/test_cuda_paths.py`` checks the CUDA
streams where there is one. The values must be byte-exact, the tensors must really be
filled on several threads, and damage must be reported as a fill on one thread reports it.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.checkpoint import reading
from dist_checkpointing.engine.raw import load as raw_load
from dist_checkpointing.engine.raw.reader import RawReader
from dist_checkpointing.engine.raw.reshard_plan import LoadPlan
from dist_checkpointing.engine.storage.location import CheckpointDir
from dist_checkpointing.engine.storage.staging_pool import StagingPool
from dist_checkpointing.errors import ChecksumMismatchError
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from tests.support.faults import file_property, flip_byte
from tests.support.layouts import same_bits

pytestmark = pytest.mark.timeout(300)

BLOCK = 64 << 10
# Entries of 640 KiB to 2.5 MiB (float32 rows of 256 KiB... see _full).
ROWS = {"a": 640, "b": 1024, "c": 1536, "d": 2048, "e": 2560, "f": 768}
COLS = 256


def _full(key: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(ord(key))
    return torch.randn(ROWS[key], COLS, generator=gen)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("fills") / "ckpt"
    ckpt.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIST_CKPT_CHECKSUM_BLOCK_BYTES", str(BLOCK))
        state = {k: ShardedTensor.from_rank_offsets(k, _full(k)) for k in ROWS}
        dc.save(state, ckpt, get_default_save_sharded_strategy("raw_bytes", 1))
    return ckpt


def _fill(ckpt: Path, pool: StagingPool) -> dict[str, torch.Tensor]:
    """Every entry streamed through ``pool`` into a CPU tensor, verified."""
    location = CheckpointDir.of(ckpt)
    assert reading.open_for_read(location) is not None  # checksums from the record
    index = raw_load.read_index(location)
    targets = {k: torch.zeros(ROWS[k], COLS) for k in ROWS}
    plan = LoadPlan(pool=pool)
    plan.device_fills = [(index.rows_by_key[k][0], t) for k, t in targets.items()]
    raw_load.fill_devices(RawReader(location, index, verify=True), plan)
    return targets


def _fill_threads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The threads the tensors are filled on (filled in as fills run)."""
    names: set[str] = set()
    real = raw_load.fill_from_host

    def spy(target: torch.Tensor, read: Any, pool: StagingPool) -> None:
        names.add(threading.current_thread().name)
        time.sleep(0.02)  # each fill outlasts the submission of the others
        real(target, read, pool)

    monkeypatch.setattr(raw_load, "fill_from_host", spy)
    return names


def _pool(buffers: int, buffer_bytes: int = 4 * BLOCK) -> StagingPool:
    return StagingPool(budget_bytes=buffers * buffer_bytes, buffer_bytes=buffer_bytes, pinned=False)


def test_tensors_are_filled_on_several_threads(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = _fill_threads(monkeypatch)
    monkeypatch.setenv("DIST_CKPT_READ_THREADS", "4")
    pool = _pool(8)
    out = _fill(saved, pool)
    assert all(same_bits(out[k], _full(k)) for k in ROWS)
    assert len(names) >= 2 and all(n.startswith("dist-ckpt-fill") for n in names), names
    assert pool.stats.peak_in_use <= pool.capacity and pool.in_use == 0


@pytest.mark.parametrize(("buffers", "threads"), [(1, "4"), (8, "1")])
def test_one_buffer_or_one_thread_fills_one_tensor_at_a_time(
    saved: Path, monkeypatch: pytest.MonkeyPatch, buffers: int, threads: str
) -> None:
    """A fill holds a buffer while its copy runs: a pool of one buffer (or one thread)
    fills the tensors one after another, on the caller's thread."""
    names = _fill_threads(monkeypatch)
    monkeypatch.setenv("DIST_CKPT_READ_THREADS", threads)
    out = _fill(saved, _pool(buffers))
    assert all(same_bits(out[k], _full(k)) for k in ROWS)
    assert names == {threading.current_thread().name}


def _outcome(ckpt: Path, pool: StagingPool) -> tuple[Any, ...]:
    try:
        out = _fill(ckpt, pool)
    except ChecksumMismatchError as err:
        return ("mismatch", err.key, Path(err.file or "").name, err.offset)
    assert pool.in_use == 0  # every buffer given back, also after a failure
    return ("ok",) if all(same_bits(out[k], _full(k)) for k in ROWS) else ("wrong values",)


@file_property(25)
@given(
    threads=st.integers(2, 8),
    buffers=st.integers(1, 6),
    blocks_per_buffer=st.sampled_from([1, 3, 8]),
    damage=st.lists(st.tuples(st.integers(0, 1), st.floats(0.0, 0.9999)), max_size=2),
)
def test_any_threads_and_pool_fill_as_one_thread_does(
    saved: Path,
    monkeypatch: pytest.MonkeyPatch,
    threads: int,
    buffers: int,
    blocks_per_buffer: int,
    damage: list[tuple[int, float]],
) -> None:
    """Whatever the threads and the pool, and wherever bytes are damaged, the fills
    return the values, or raise the error (key, file, offset), of fills on one thread."""
    with tempfile.TemporaryDirectory(prefix="dcp-fills-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        shutil.copytree(saved, ckpt)
        files = sorted(p for p in ckpt.iterdir() if p.suffix == ".dcpraw")
        for f, where in damage:
            path = files[f % len(files)]
            flip_byte(path, int(path.stat().st_size * where))
        outcomes = []
        for n in ("1", str(threads)):
            monkeypatch.setenv("DIST_CKPT_READ_THREADS", n)
            outcomes.append(_outcome(ckpt, _pool(buffers, blocks_per_buffer * BLOCK)))
        assert outcomes[0] == outcomes[1]
    if not damage:
        assert outcomes[0] == ("ok",)
