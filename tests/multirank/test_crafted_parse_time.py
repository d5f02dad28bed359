"""End to end: a checkpoint whose ``.metadata`` or ``common.pt`` holds dict keys (or set
items) with colliding hashes is refused in bounded time, with an error naming the file,
by every public entry point and on every rank. Parsed as they are, these files would
keep a loader busy for 40 s to minutes; the parse-time budget is set to 1 CPU-second."""

from __future__ import annotations

import io
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.storage.reader import FileSystemReader
from dist_checkpointing.errors import CheckpointingException, CorruptCheckpointError
from tests.support.crafted_pickles import (
    colliding_ints,
    colliding_pairs,
    dict_op,
    index_op,
    int_op,
    metadata_with,
    reduce_op,
    saved,
    tuple_op,
)
from tests.support.harness import run_distributed

pytestmark = pytest.mark.timeout(180)

SHAPE = (4, 6)
CPU_REFUSAL = r"\.metadata: parsing it takes more than 1 CPU-second .*collide"


@pytest.fixture(autouse=True)
def one_second(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIST_CKPT_METADATA_PARSE_CPU_S", "1")
    monkeypatch.setenv("DIST_CKPT_METADATA_PARSE_CPU_S_PER_MIB", "0")


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    dcp.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(SHAPE)), "step": 3}, d)
    return d


def _ints() -> list[bytes]:
    return [int_op(k) for k in colliding_ints(60_000)]


KINDS: dict[str, Callable[[], dict[str, bytes]]] = {
    "int_keys": lambda: {"planner_data": dict_op(_ints())},
    "tuple_keys": lambda: {"planner_data": dict_op([tuple_op(p) for p in colliding_pairs(40_000)])},
    "index_keys": lambda: {
        "storage_data": dict_op([index_op("w", p) for p in colliding_pairs(20_000)])
    },
    "frozenset_of_list": lambda: {"planner_data": reduce_op("builtins", "frozenset", _ints())},
}


def _craft(ckpt_dir: Path, kind: str) -> None:
    """Swap fields of the checkpoint's own ``.metadata`` for colliding keys."""
    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    metadata.storage_meta = None
    (ckpt_dir / ".metadata").write_bytes(metadata_with(KINDS[kind](), base=metadata))
    # A crafted file comes with the commit record deleted (it would refuse the file first).
    (ckpt_dir / "commit.json").unlink(missing_ok=True)


def _request() -> dict[str, Any]:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(SHAPE))}


def _refused_in_time(call: Callable[[], object], match: str) -> None:
    start = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match=match):
        call()
    assert time.perf_counter() - start < 30


@pytest.mark.parametrize("kind", list(KINDS))
def test_crafted_metadata_is_refused_by_load(ckpt: Path, kind: str) -> None:
    _craft(ckpt, kind)
    _refused_in_time(lambda: dcp.load(_request(), ckpt), f"{ckpt}/{CPU_REFUSAL}")


READERS: dict[str, Callable[[Path], object]] = {
    "load_tensors_metadata": dcp.load_tensors_metadata,
    "load_sharded_metadata": dcp.load_sharded_metadata,
    "load_plain_tensors": dcp.load_plain_tensors,
    "remove_sharded_tensors": lambda d: dcp.remove_sharded_tensors(d, "w"),
}


@pytest.mark.slow
@pytest.mark.parametrize("entry", list(READERS))
def test_every_entry_point_bounds_the_metadata_parse(ckpt: Path, entry: str) -> None:
    _craft(ckpt, "int_keys")
    before = (ckpt / ".metadata").read_bytes()
    _refused_in_time(lambda: READERS[entry](ckpt), f"{ckpt}/{CPU_REFUSAL}")
    assert (ckpt / ".metadata").read_bytes() == before  # nothing was rewritten


def test_the_checkpoint_loads_again_with_its_own_metadata(ckpt: Path) -> None:
    """Control: the crafted fields are what is refused, not the checkpoint."""
    good = (ckpt / ".metadata").read_bytes()
    _craft(ckpt, "int_keys")
    (ckpt / ".metadata").write_bytes(good)
    out = dcp.load(_request(), ckpt)
    assert torch.equal(out["w"], torch.ones(SHAPE)) and out["step"] == 3


def _with_pickle(archive: bytes, pickled: bytes) -> bytes:
    """``archive`` (a torch.save zip) with its data.pkl replaced by ``pickled``."""
    src = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, pickled if info.filename.endswith("data.pkl") else src.read(info))
    return out.getvalue()


@pytest.mark.parametrize("entry", ["load", "load_common_state_dict"])
def test_common_pt_with_a_colliding_set_is_refused(ckpt: Path, entry: str) -> None:
    """common.pt: a set built by one REDUCE from a list counts for the opcode scan."""
    items = [int_op(k) for k in colliding_ints(5000)]
    crafted = b"\x80\x02" + reduce_op("__builtin__", "set", items) + b"."
    (ckpt / "common.pt").write_bytes(_with_pickle(saved({"step": 3}), crafted))
    (ckpt / "commit.json").unlink(missing_ok=True)
    call = {
        "load": lambda: dcp.load(_request(), ckpt),
        "load_common_state_dict": lambda: dcp.load_common_state_dict(ckpt),
    }[entry]
    _refused_in_time(call, r"common\.pt: refusing to unpickle: .*collide")


def _load_on_rank(ckpt_dir: str) -> tuple[str, str, float]:
    """Every rank loads the crafted checkpoint: (error type, message, seconds)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = SHAPE[0] // world
    request = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(rows, SHAPE[1]), (0, rank, world))
    }
    start = time.perf_counter()
    try:
        dcp.load(request, ckpt_dir)
    except CheckpointingException as exc:
        return type(exc).__name__, str(exc), time.perf_counter() - start
    return "ok", "", time.perf_counter() - start


@pytest.mark.slow
def test_crafted_metadata_is_refused_on_every_rank(ckpt: Path) -> None:
    _craft(ckpt, "index_keys")
    results = run_distributed(_load_on_rank, 2, str(ckpt), timeout=120)
    for name, message, seconds in results:
        assert name in ("CorruptCheckpointError", "RankFailureError"), (name, message)
        assert ".metadata" in message and "CPU-second" in message, message
        assert seconds < 30
    assert any(name == "CorruptCheckpointError" for name, _, _ in results)
