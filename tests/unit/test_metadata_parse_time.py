"""A crafted ``.metadata`` cannot keep the loader busy: dict keys (or set items) whose
hashes collide make unpickling quadratic inside one opcode, so a large file is parsed
first in a forked child under a CPU-time limit (safety/cpu_bounded.py) and a small one
passes the opcode scan. Each crafted file below would take 40 s to minutes to parse."""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dist_checkpointing._torch_compat import StorageInfo
from dist_checkpointing.engine.safety import cpu_bounded, load_metadata
from dist_checkpointing.engine.safety import metadata as metadata_module
from dist_checkpointing.errors import CorruptCheckpointError
from tests.support.crafted_pickles import (
    MERSENNE,
    colliding_ints,
    colliding_pairs,
    compact_index_dict_op,
    dict_op,
    int_op,
    metadata_with,
    reduce_op,
    tuple_op,
)

pytestmark = pytest.mark.timeout(120)

SOURCE = "ckpt/.metadata"
CPU_REFUSAL = r"ckpt/\.metadata: parsing it takes more than 1 CPU-second .*collide"


@pytest.fixture
def one_second(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIST_CKPT_METADATA_PARSE_CPU_S", "1")
    monkeypatch.setenv("DIST_CKPT_METADATA_PARSE_CPU_S_PER_MIB", "0")


def _ints(count: int) -> list[bytes]:
    return [int_op(k) for k in colliding_ints(count)]


CRAFTED: dict[str, Callable[[], bytes]] = {
    # (a) one SETITEMS of int keys k * (2**61 - 1) + c in a field
    "int_keys": lambda: metadata_with({"planner_data": dict_op(_ints(60_000))}),
    # (b) 2-tuples of ints below 2**61, solved for one tuple hash
    "tuple_keys": lambda: metadata_with(
        {"planner_data": dict_op([tuple_op(p) for p in colliding_pairs(40_000)])}
    ),
    # (c) storage_data keyed by MetadataIndex("w", offset) with colliding offsets
    "index_keys": lambda: metadata_with(
        {"storage_data": compact_index_dict_op("w", colliding_pairs(20_000))}
    ),
    # (d) frozenset and set built by REDUCE from one list
    "frozenset_of_list": lambda: metadata_with(
        {"planner_data": reduce_op("builtins", "frozenset", _ints(60_000))}
    ),
    "set_of_list": lambda: metadata_with(
        {"planner_data": reduce_op("builtins", "set", _ints(60_000))}
    ),
}


def test_the_crafted_keys_collide() -> None:
    assert len({hash(k) for k in colliding_ints(1000)}) == 1
    assert colliding_ints(1)[0] % MERSENNE == 7
    pairs = colliding_pairs(1000)
    assert len({hash(p) for p in pairs}) == 1 and len(set(pairs)) == 1000
    assert max(abs(v) for p in pairs for v in p) < MERSENNE
    assert len({hash(MetadataIndex("w", torch.Size(p))) for p in pairs[:100]}) == 1


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_collisions_are_refused_within_the_budget(one_second: None, case: str) -> None:
    raw = CRAFTED[case]()
    assert len(raw) >= metadata_module.FORK_MIN_BYTES
    start = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match=CPU_REFUSAL):
        load_metadata(io.BytesIO(raw), source=SOURCE)
    assert time.perf_counter() - start < 15


def _large_metadata(tensors: int) -> Metadata:
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    for i in range(tensors):
        chunks = [ChunkStorageMetadata(torch.Size((r * 4, 0)), torch.Size((4, 8))) for r in (0, 1)]
        entries[f"layer.{i}"] = TensorStorageMetadata(
            TensorProperties(torch.float32), torch.Size((8, 8)), chunks
        )
        for r, chunk in enumerate(chunks):
            index = MetadataIndex(f"layer.{i}", chunk.offsets)
            storage[index] = StorageInfo(f"__{r}_0.distcp", 128 * i, 128)
    return Metadata(entries, storage_data=storage)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Budgets of the forked checks that load_metadata runs from now on."""
    budgets: list[float] = []
    real = cpu_bounded.run_cpu_bounded

    def counted(fn: Callable[[], object], *, cpu_s: float, source: str, hint: str) -> bool:
        budgets.append(cpu_s)
        return real(fn, cpu_s=cpu_s, source=source, hint=hint)

    monkeypatch.setattr(metadata_module, "run_cpu_bounded", counted)
    return budgets


def test_a_large_legitimate_metadata_loads_with_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    metadata = _large_metadata(5000)
    raw = pickle.dumps(metadata)
    budgets = _counting(monkeypatch)
    loaded = load_metadata(io.BytesIO(raw), source=SOURCE)
    assert loaded.state_dict_metadata == metadata.state_dict_metadata
    assert loaded.storage_data == metadata.storage_data
    assert budgets == [pytest.approx(5.0 + len(raw) / 2**20)]  # the defaults: 5 s + 1 s/MiB


def test_a_small_metadata_is_scanned_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    budgets = _counting(monkeypatch)
    raw = pickle.dumps(_large_metadata(10))
    assert len(raw) < metadata_module.FORK_MIN_BYTES
    load_metadata(io.BytesIO(raw), source=SOURCE)
    # At most ~500 colliding keys fit: a fraction of a second, no fork needed.
    small = metadata_with({"planner_data": dict_op(_ints(1000))})
    assert len(small) < metadata_module.FORK_MIN_BYTES
    assert len(load_metadata(io.BytesIO(small), source=SOURCE).planner_data) == 1000
    assert budgets == []

    # A key of tuples shared through the memo: a few hundred bytes, 2**60 steps to hash.
    def memo(i: int) -> bytes:  # LONG_BINGET/PUT index, above any pickle.dumps uses here
        return (1000 + i).to_bytes(4, "little")

    shared = b"K\x01\x85r" + memo(0)
    for i in range(60):
        shared += b"0j" + memo(i) + b"j" + memo(i) + b"\x86r" + memo(i + 1)
    crafted = metadata_with({"planner_data": shared + b"0}j" + memo(60) + b"Ns"})
    with pytest.raises(CorruptCheckpointError, match="ckpt/.metadata: .*steps to hash"):
        load_metadata(io.BytesIO(crafted), source=SOURCE)


@pytest.mark.slow
def test_the_guard_can_be_turned_off(one_second: None, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = metadata_with({"planner_data": dict_op(_ints(20_000))})  # ~5 CPU-seconds
    with pytest.raises(CorruptCheckpointError, match=CPU_REFUSAL):
        load_metadata(io.BytesIO(raw), source=SOURCE)
    monkeypatch.setenv("DIST_CKPT_METADATA_PARSE_GUARD", "0")
    budgets = _counting(monkeypatch)
    assert len(load_metadata(io.BytesIO(raw), source=SOURCE).planner_data) == 20_000
    assert budgets == []


def test_the_allowance_per_mib_is_larger_without_the_fast_unpickler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copyreg extension code in the process rules out the fast unpickler: the checked
    one parses about 0.85 s/MiB (the fast one 0.13-0.21), so 4 s/MiB instead of 1."""
    metadata = _large_metadata(1000)
    raw = pickle.dumps(metadata)
    budgets = _counting(monkeypatch)
    copyreg.add_extension("tests.unit.test_metadata_parse_time", "Unused", 0x7FFFFFF0)
    try:
        loaded = load_metadata(io.BytesIO(raw), source=SOURCE)
    finally:
        copyreg.remove_extension("tests.unit.test_metadata_parse_time", "Unused", 0x7FFFFFF0)
    assert loaded.storage_data == metadata.storage_data
    assert budgets == [pytest.approx(5.0 + 4 * len(raw) / 2**20)]


# ----------------------------------------------------------------------------- the child


def _spin() -> None:
    while True:
        pass


def test_the_child_is_stopped_at_its_cpu_limit() -> None:
    start = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match="f: parsing it takes more than 1 CPU"):
        cpu_bounded.run_cpu_bounded(_spin, cpu_s=0.5, source="f", hint="")
    assert time.perf_counter() - start < 15


def test_a_child_that_makes_no_progress_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_bounded, "WALL_FACTOR", 0)
    monkeypatch.setattr(cpu_bounded, "WALL_MARGIN_S", 0.5)
    with pytest.raises(CorruptCheckpointError, match="f: parsing it did not finish within"):
        cpu_bounded.run_cpu_bounded(lambda: time.sleep(60), cpu_s=5, source="f", hint=" (H)")


def test_an_ordinary_error_lets_the_caller_parse() -> None:
    def fail() -> None:
        raise ValueError("bad bytes")

    assert cpu_bounded.run_cpu_bounded(fail, cpu_s=5, source="f", hint="")


def test_a_crashed_child_is_a_refusal() -> None:
    with pytest.raises(CorruptCheckpointError, match="f: the forked check .*SIGSEGV.*(H)"):
        cpu_bounded.run_cpu_bounded(
            lambda: os.kill(os.getpid(), signal.SIGSEGV), cpu_s=5, source="f", hint=" (H)"
        )


def test_the_child_runs_no_python_signal_handler_and_holds_no_inherited_fd(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "handler-ran"
    old = signal.signal(signal.SIGTERM, lambda *_: marker.touch())
    try:
        with pytest.raises(CorruptCheckpointError, match="SIGTERM"):
            cpu_bounded.run_cpu_bounded(
                lambda: os.kill(os.getpid(), signal.SIGTERM), cpu_s=5, source="f", hint=""
            )
    finally:
        signal.signal(signal.SIGTERM, old)
    assert not marker.exists()
    with open(tmp_path / "open", "wb") as held:

        def still_open() -> None:
            os.fstat(held.fileno())  # raises OSError (EBADF) in the child: "error"
            os.kill(os.getpid(), signal.SIGSEGV)

        assert cpu_bounded.run_cpu_bounded(still_open, cpu_s=5, source="f", hint="")


def test_without_fork_or_resource_the_parse_is_not_bounded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_bounded, "resource", None)
    with caplog.at_level("DEBUG", logger=cpu_bounded.__name__):
        assert not cpu_bounded.run_cpu_bounded(_spin, cpu_s=1, source="f", hint="")
    assert "f: parsed without a CPU-time bound (resource.RLIMIT_CPU" in caplog.text


def test_an_exit_status_collected_elsewhere_leaves_the_report_to_decide() -> None:
    """With SIGCHLD ignored the kernel reaps the child itself: a report still counts,
    and no report (the child was stopped) is still a refusal."""
    old = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        assert cpu_bounded.run_cpu_bounded(lambda: None, cpu_s=5, source="f", hint="")
        with pytest.raises(CorruptCheckpointError, match="f: .*ended without reporting"):
            cpu_bounded.run_cpu_bounded(_spin, cpu_s=0.5, source="f", hint="")
    finally:
        signal.signal(signal.SIGCHLD, old)
