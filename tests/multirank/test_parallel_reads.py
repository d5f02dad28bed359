"""Loads that read on several threads (the ``READ_THREADS`` knob), both layouts.

A 2-rank save writes four data files; a one-process load reads them on several threads,
with checksums verified on a pool of hashing threads. The values must be byte-exact, the
files must really be read on more than one thread (one file's reads too, cut into runs
by bytes), and damage in two files, or in two runs of one file, must be reported exactly
as a one-file-at-a-time load reports it (the first damaged item in file order, by key,
file and offset).
"""

from __future__ import annotations

import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.storage import checksums
from dist_checkpointing.engine.storage.local import LocalFileSystem
from dist_checkpointing.errors import ChecksumMismatchError, CorruptCheckpointError
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from tests.support.harness import run_distributed
from tests.support.layouts import same_bits

pytestmark = pytest.mark.timeout(120)

BACKENDS = ("torch_dist", "raw_bytes")
KEYS = [f"layer{i}.weight" for i in range(6)]
SHAPE = (1024, 1024)  # 4 MiB per tensor, 2 MiB per rank
SMALL = (64, 64)  # 16 KiB per tensor


def _full(key: str, shape: tuple[int, int] = SHAPE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(shape, generator=gen)


def _save(ckpt: Path, backend: str, shape: tuple[int, int]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = shape[0] // world
    state = {
        k: ShardedTensor.from_rank_offsets(
            k, _full(k, shape)[rank * rows : (rank + 1) * rows].clone(), (0, rank, world)
        )
        for k in KEYS
    }
    dc.save(state, ckpt, get_default_save_sharded_strategy(backend, 1))


def _saved(tmp_path_factory: pytest.TempPathFactory, backend: str, shape: Any) -> Path:
    ckpt = tmp_path_factory.mktemp(backend) / "ckpt"
    ckpt.mkdir()
    run_distributed(_save, 2, ckpt, backend, shape)
    return ckpt


@pytest.fixture(scope="module", params=BACKENDS)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved(tmp_path_factory, request.param, SHAPE)


def _data_files(ckpt: Path) -> list[Path]:
    files = sorted(p for p in ckpt.iterdir() if p.suffix in (".distcp", ".dcpraw"))
    assert len(files) == 4, files  # 2 ranks x SAVE_THREAD_COUNT 2
    return files


def _load(ckpt: Path, shape: tuple[int, int] = SHAPE) -> dict[str, Any]:
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros(shape)) for k in KEYS}
    return dc.load(request, ckpt)


def _threads_per_file(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int] = SHAPE
) -> list[set[str]]:
    """Load ``ckpt`` (checking every value); for each data file, the threads that opened
    it (each thread opens a file once per run of its reads it takes)."""
    opened: dict[str, set[str]] = {}
    real_open = LocalFileSystem.open_read

    def spy(self: LocalFileSystem, path: str) -> Any:
        opened.setdefault(Path(path).name, set()).add(threading.current_thread().name)
        time.sleep(0.02)  # each run outlasts the submission of the others
        return real_open(self, path)

    monkeypatch.setattr(LocalFileSystem, "open_read", spy)
    out = _load(ckpt, shape)
    monkeypatch.setattr(LocalFileSystem, "open_read", real_open)
    for k in KEYS:
        assert same_bits(out[k], _full(k, shape)), k
    return [opened[p.name] for p in _data_files(ckpt)]


def _reading_threads(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int] = SHAPE
) -> set[str]:
    """Load ``ckpt`` (checking every value); the threads its data files were opened on."""
    return set().union(*_threads_per_file(ckpt, monkeypatch, shape))


@pytest.fixture
def hashing_pool(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Checksums on a pool of three hashing threads (as on a host with cores to spare)."""
    pool = ThreadPoolExecutor(3, thread_name_prefix="test-crc32c")
    monkeypatch.setenv("DIST_CKPT_CHECKSUM_THREAD", "1")
    monkeypatch.setattr(checksums, "_hasher", pool)
    yield pool
    pool.shutdown()


def test_files_are_read_at_once_on_several_threads(
    saved: Path, monkeypatch: pytest.MonkeyPatch, hashing_pool: Any
) -> None:
    monkeypatch.setenv("DIST_CKPT_READ_THREADS", "4")
    assert len(_reading_threads(saved, monkeypatch)) > 1
    monkeypatch.setenv("DIST_CKPT_READ_THREADS", "1")
    assert len(_reading_threads(saved, monkeypatch)) == 1


@pytest.mark.parametrize("threads", ["8", "16"])
def test_the_threads_share_the_bytes_of_one_file(
    saved: Path, monkeypatch: pytest.MonkeyPatch, hashing_pool: Any, threads: str
) -> None:
    """A file's reads are cut into runs of about total / threads bytes (at least
    ``READ_SPAN_BYTES``), each run on whatever thread is free: 24 MiB over 8 threads is
    3 MiB a run (two runs of a 6 MiB file); over 16 threads, 1.5 MiB, which cuts each
    2 MiB raw_bytes item into two reads of a 1 MiB checksum block each."""
    monkeypatch.setenv("DIST_CKPT_READ_SPAN_BYTES", str(1 << 20))
    monkeypatch.setenv("DIST_CKPT_READ_THREADS", threads)
    per_file = _threads_per_file(saved, monkeypatch)
    assert all(len(names) >= 2 for names in per_file), per_file
    monkeypatch.setenv("DIST_CKPT_READ_SPAN_BYTES", str(64 << 20))  # one run per file
    assert all(len(names) == 1 for names in _threads_per_file(saved, monkeypatch))


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_items_are_read_in_parallel_only_by_raw_bytes(
    backend: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch_dist spends a small item's time in Python (its zip framing), which threads
    only take turns at: it reads such files one after another; raw_bytes batches small
    items into one read each and reads the files at once."""
    ckpt = _saved(tmp_path_factory, backend, SMALL)
    monkeypatch.setenv("DIST_CKPT_READ_THREADS", "4")
    threads = _reading_threads(ckpt, monkeypatch, SMALL)
    assert (len(threads) > 1) == (backend == "raw_bytes"), threads


def _damage(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x20
    path.write_bytes(bytes(data))


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _failure(ckpt: Path, monkeypatch: pytest.MonkeyPatch, threads: str) -> tuple[Any, ...]:
    monkeypatch.setenv("DIST_CKPT_READ_THREADS", threads)
    with pytest.raises(ChecksumMismatchError) as info:
        _load(ckpt)
    err = info.value
    assert err.key in KEYS and err.key in str(err)
    assert err.file is not None and Path(err.file).name in str(err)
    return err.key, Path(err.file).name, err.offset


def test_damage_in_two_files_is_reported_as_a_serial_load_reports_it(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashing_pool: Any
) -> None:
    ckpt = _copy(saved, tmp_path / "damaged")
    files = _data_files(ckpt)
    for path in (files[1], files[3]):  # past the first item's zip header (torch_dist)
        _damage(path, path.stat().st_size // 2)
    serial = _failure(ckpt, monkeypatch, "1")
    assert serial[1] in (files[1].name, files[3].name)
    for _ in range(3):  # the threads finish in any order; the report does not change
        assert _failure(ckpt, monkeypatch, "4") == serial


@pytest.mark.parametrize("threads", ["8", "16"])
def test_damage_in_two_runs_of_one_file_is_reported_as_a_serial_load_reports_it(
    saved: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hashing_pool: Any,
    threads: str,
) -> None:
    """Damage early and late in one file, read as several runs (with 16 threads a
    raw_bytes item is cut in two): the first damaged item of the file is named, with
    the offset of its damaged block, whichever run finishes first."""
    ckpt = _copy(saved, tmp_path / "damaged")
    path = _data_files(ckpt)[2]
    size = path.stat().st_size
    for at in (size // 3, size * 5 // 6):
        _damage(path, at)
    monkeypatch.setenv("DIST_CKPT_READ_SPAN_BYTES", str(1 << 20))
    serial = _failure(ckpt, monkeypatch, "1")
    assert serial[1] == path.name
    for _ in range(3):
        assert _failure(ckpt, monkeypatch, threads) == serial


@pytest.mark.slow
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    threads=st.integers(min_value=2, max_value=16),
    span_kib=st.sampled_from([256, 1024, 1536, 4096]),
    damage=st.lists(st.tuples(st.integers(0, 3), st.floats(0.0, 0.999)), min_size=0, max_size=3),
)
def test_any_split_of_the_reads_loads_as_a_serial_load_does(
    saved: Path,
    monkeypatch: pytest.MonkeyPatch,
    hashing_pool: Any,
    threads: int,
    span_kib: int,
    damage: list[tuple[int, float]],
) -> None:
    """Whatever the threads and the size of a run, and wherever bytes are damaged, a
    load returns the same values as a load on one thread, or raises the same error
    (same key, file and offset)."""
    with tempfile.TemporaryDirectory(prefix="dcp-split-") as tmp:
        ckpt = _copy(saved, Path(tmp) / "ckpt")
        files = _data_files(ckpt)
        for f, where in damage:
            _damage(files[f], int(files[f].stat().st_size * where))
        monkeypatch.setenv("DIST_CKPT_READ_SPAN_BYTES", str(span_kib << 10))
        outcomes = []
        for n in ("1", str(threads)):
            monkeypatch.setenv("DIST_CKPT_READ_THREADS", n)
            try:
                out = _load(ckpt)
            except ChecksumMismatchError as err:
                outcomes.append(("error", err.key, Path(err.file or "").name, err.offset))
            except CorruptCheckpointError as err:  # damage in a zip header or pickle
                outcomes.append(("corrupt", str(err)))
            else:
                assert all(same_bits(out[k], _full(k)) for k in KEYS)
                outcomes.append(("ok",))
        assert outcomes[0] == outcomes[1]
