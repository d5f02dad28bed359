"""Loading a checkpoint never executes code stored in it (end to end through ``load``).

Each malicious payload would create a marker file when unpickled; every test checks that
the load is refused with an UnsafeCheckpointError naming the offending global, and that
the marker never appears. Control cases load the same payloads with ``trusted=True`` and
see the marker appear, which proves the payloads are live.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.engine.storage.reader import FileSystemReader
from dist_checkpointing.errors import CheckpointingException, UnsafeCheckpointError
from dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from tests.support.harness import run_distributed

pytestmark = pytest.mark.timeout(120)

SHAPE = (4, 6)
EXEC_GLOBAL = "builtins.exec"
SYSTEM_GLOBAL = f"{os.system.__module__}.system"  # posix.system on Linux


class ExecOnUnpickle:
    """Harmless to build and to pickle; *unpickling* it runs ``code`` with builtins.exec."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (self.code,))


class SystemOnUnpickle:
    """Harmless to build and to pickle; *unpickling* it runs ``command`` with os.system."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def _exec_payload(marker: Path) -> ExecOnUnpickle:
    return ExecOnUnpickle(f"open({str(marker)!r}, 'w').close()")


def _system_payload(marker: Path) -> SystemOnUnpickle:
    return SystemOnUnpickle(f"touch {shlex.quote(str(marker))}")


PAYLOADS = {
    "exec": (_exec_payload, EXEC_GLOBAL),
    "system": (_system_payload, SYSTEM_GLOBAL),
}


def _ref() -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).reshape(SHAPE)


def _request() -> dict[str, Any]:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(SHAPE))}


def _save(ckpt_dir: Path, **extra: Any) -> None:
    dcp.save({"w": ShardedTensor.from_rank_offsets("w", _ref()), **extra}, ckpt_dir)


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    _save(d, step=3)
    return d


# ----------------------------------------------------------------------------- .metadata


def _malicious_metadata(ckpt_dir: Path, payload: Any, how: str, protocol: int) -> None:
    if how == "bare":
        raw = pickle.dumps(payload, protocol=protocol)
    else:
        # Hidden inside an otherwise valid Metadata object.
        metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
        metadata.planner_data = {"w": payload}
        raw = pickle.dumps(metadata, protocol=protocol)
    (ckpt_dir / ".metadata").write_bytes(raw)
    _drop_commit_record(ckpt_dir)


def _drop_commit_record(ckpt_dir: Path) -> None:
    """An attacker who plants a file also deletes the commit record, whose checksums
    would refuse it before anything is unpickled (see test_planted_file_is_refused_
    before_unpickling): what remains to stop them is the restricted unpickler."""
    (ckpt_dir / "commit.json").unlink(missing_ok=True)


METADATA_READERS = {
    "load": lambda d: dcp.load(_request(), d),
    "load_tensors_metadata": dcp.load_tensors_metadata,
    "load_sharded_metadata": dcp.load_sharded_metadata,
    "load_plain_tensors": dcp.load_plain_tensors,
    "remove_sharded_tensors": lambda d: dcp.remove_sharded_tensors(d, "w"),
}


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
@pytest.mark.parametrize("how", ["bare", "inside_metadata"])
@pytest.mark.parametrize("kind", list(PAYLOADS))
def test_malicious_dot_metadata_is_refused(
    ckpt: Path, marker: Path, kind: str, how: str, protocol: int
) -> None:
    make, global_name = PAYLOADS[kind]
    _malicious_metadata(ckpt, make(marker), how, protocol)
    with pytest.raises(UnsafeCheckpointError) as info:
        dcp.load(_request(), ckpt)
    msg = str(info.value)
    assert global_name in msg and ".metadata" in msg
    assert not marker.exists()


@pytest.mark.parametrize("entry", list(METADATA_READERS))
def test_every_entry_point_reads_dot_metadata_safely(ckpt: Path, marker: Path, entry: str) -> None:
    _malicious_metadata(ckpt, _exec_payload(marker), "inside_metadata", 2)
    before = (ckpt / ".metadata").read_bytes()
    with pytest.raises(UnsafeCheckpointError) as info:
        METADATA_READERS[entry](ckpt)
    assert EXEC_GLOBAL in str(info.value)
    assert not marker.exists()
    assert (ckpt / ".metadata").read_bytes() == before  # nothing was rewritten


@pytest.mark.parametrize("name", [".metadata", "common.pt"])
def test_planted_file_is_refused_before_unpickling(ckpt: Path, marker: Path, name: str) -> None:
    """With the commit record in place, a planted file fails its checksums first."""
    from dist_checkpointing.errors import ForeignFileError

    record = (ckpt / "commit.json").read_bytes()
    if name == ".metadata":
        _malicious_metadata(ckpt, _exec_payload(marker), "inside_metadata", 2)
    else:
        _malicious_common(ckpt, _exec_payload(marker))
    (ckpt / "commit.json").write_bytes(record)
    with pytest.raises(ForeignFileError, match=re.escape(name)):
        dcp.load(_request(), ckpt)
    assert not marker.exists()


def test_malicious_metadata_payload_is_live(ckpt: Path, marker: Path) -> None:
    """Control: plain pickle does run the payload used above."""
    _malicious_metadata(ckpt, _exec_payload(marker), "inside_metadata", 2)
    pickle.loads((ckpt / ".metadata").read_bytes())
    assert marker.exists()


def _class_mutating_metadata(ckpt_dir: Path) -> bytes:
    """A valid Metadata pickle preceded by ops that set ``Metadata.__eq__`` for the process."""
    valid = pickle.dumps(FileSystemReader(str(ckpt_dir)).read_metadata(), protocol=2)
    name = b"__eq__"
    mutate = (
        b"ctorch.distributed.checkpoint.metadata\nMetadata\n"
        + b"N}X"
        + len(name).to_bytes(4, "little")
        + name
        + b"cbuiltins\nset\ns\x86b0"  # BUILD with slot state on the class, then POP
    )
    return b"\x80\x02" + mutate + valid[2:]


def test_dot_metadata_cannot_change_a_class_for_the_process(ckpt: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    eq_before = vars(Metadata)["__eq__"]
    (ckpt / ".metadata").write_bytes(_class_mutating_metadata(ckpt))
    _drop_commit_record(ckpt)
    with pytest.raises(UnsafeCheckpointError) as info:
        dcp.load(_request(), ckpt)
    msg = str(info.value)
    assert "setting the state of class" in msg and "Metadata" in msg and ".metadata" in msg
    assert vars(Metadata)["__eq__"] is eq_before


def test_class_mutating_metadata_payload_is_live(ckpt: Path) -> None:
    """Control: plain pickle does change the class (restored afterwards)."""
    from torch.distributed.checkpoint.metadata import Metadata

    eq_before = vars(Metadata)["__eq__"]
    try:
        pickle.loads(_class_mutating_metadata(ckpt))
        assert vars(Metadata)["__eq__"] is set
    finally:
        Metadata.__eq__ = eq_before  # type: ignore[method-assign]
    assert vars(Metadata)["__eq__"] is eq_before


# ----------------------------------------------------------------------------- common.pt


def _malicious_common(ckpt_dir: Path, payload: Any) -> None:
    buf = io.BytesIO()
    torch.save({"step": 3, "hook": payload}, buf)
    (ckpt_dir / "common.pt").write_bytes(buf.getvalue())
    _drop_commit_record(ckpt_dir)


@pytest.mark.parametrize("kind", list(PAYLOADS))
@pytest.mark.parametrize("entry", ["load", "load_common_state_dict", "load_content_metadata"])
def test_malicious_common_pt_is_refused(ckpt: Path, marker: Path, kind: str, entry: str) -> None:
    make, global_name = PAYLOADS[kind]
    _malicious_common(ckpt, make(marker))
    readers = {
        "load": lambda: dcp.load(_request(), ckpt),
        "load_common_state_dict": lambda: dcp.load_common_state_dict(ckpt),
        "load_content_metadata": lambda: dcp.load_content_metadata(ckpt),
    }
    with pytest.raises(UnsafeCheckpointError) as info:
        readers[entry]()
    msg = str(info.value)
    assert global_name in msg and "common.pt" in msg
    assert not marker.exists()


def test_malicious_common_pt_refused_even_with_other_allowed_types(
    ckpt: Path, marker: Path
) -> None:
    _malicious_common(ckpt, _exec_payload(marker))
    strategy = TorchCommonLoadStrategy(allowed_types=[argparse.Namespace])
    with pytest.raises(UnsafeCheckpointError):
        dcp.load(_request(), ckpt, common_strategy=strategy)
    assert not marker.exists()


def test_malicious_common_pt_payload_is_live(ckpt: Path, marker: Path) -> None:
    """Control: a trusted load runs it (so the refusals above are meaningful)."""
    _malicious_common(ckpt, _exec_payload(marker))
    dcp.load_common_state_dict(ckpt, common_strategy=TorchCommonLoadStrategy(trusted=True))
    assert marker.exists()


# ----------------------------------------------------------------------------- ShardedObject


def _object_request() -> dict[str, Any]:
    return {**_request(), "rng": ShardedObject("rng", None, (1,), (0,))}


def test_malicious_sharded_object_is_refused(tmp_path: Path, marker: Path) -> None:
    _save(tmp_path, rng=ShardedObject("rng", _exec_payload(marker), (1,), (0,)))
    assert not marker.exists()  # saving executes nothing
    with pytest.raises(UnsafeCheckpointError) as info:
        dcp.load(_object_request(), tmp_path)
    msg = str(info.value)
    assert EXEC_GLOBAL in msg and "rng" in msg
    assert not marker.exists()
    # Allowing an unrelated type does not allow the payload.
    strategy = TorchDistLoadShardedStrategy(allowed_types=[argparse.Namespace])
    with pytest.raises(UnsafeCheckpointError):
        dcp.load(_object_request(), tmp_path, sharded_strategy=strategy)
    assert not marker.exists()
    # Control: a trusted load runs it.
    dcp.load(
        _object_request(), tmp_path, sharded_strategy=TorchDistLoadShardedStrategy(trusted=True)
    )
    assert marker.exists()


def test_refusal_of_a_function_global_does_not_suggest_allowing_it(
    tmp_path: Path, marker: Path
) -> None:
    _save(tmp_path, rng=ShardedObject("rng", _exec_payload(marker), (1,), (0,)))
    with pytest.raises(UnsafeCheckpointError) as info:
        dcp.load(_object_request(), tmp_path)
    assert f"allowed_types=[{EXEC_GLOBAL}]" not in str(info.value)


def _rank_malicious_object(ckpt_dir: str, marker: str) -> tuple[str, str]:
    """Rank 1's shard of the object grid is malicious, rank 0's is benign."""
    rank, world = dist.get_rank(), dist.get_world_size()
    payload: Any = {"rank": 0} if rank == 0 else _exec_payload(Path(marker))
    w = ShardedTensor.from_rank_offsets("w", _ref().chunk(world)[rank].clone(), (0, rank, world))
    dcp.save({"w": w, "rng": ShardedObject("rng", payload, (world,), (rank,))}, ckpt_dir)
    request = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 6), (0, rank, world)),
        "rng": ShardedObject("rng", None, (world,), (rank,)),
    }
    try:
        dcp.load(request, ckpt_dir)
    except CheckpointingException as e:
        return type(e).__name__, str(e)
    return "ok", ""


def test_malicious_sharded_object_on_one_rank_fails_every_rank(
    tmp_path: Path, marker: Path
) -> None:
    results = run_distributed(_rank_malicious_object, 2, str(tmp_path), str(marker), timeout=60)
    assert results[1][0] == "UnsafeCheckpointError" and EXEC_GLOBAL in results[1][1]
    assert "rng/shard_1_2" in results[1][1]
    # The other rank learns which rank failed and why.
    assert results[0][0] == "RankFailureError"
    assert "rank 1" in results[0][1] and "UnsafeCheckpointError" in results[0][1]
    assert not marker.exists()


# ----------------------------------------------------------------------------- argparse.Namespace

ARGS = argparse.Namespace(lr=0.5, name="run", layers=[1, 2])


def test_namespace_in_common_state_needs_explicit_permission(tmp_path: Path) -> None:
    _save(tmp_path, args=ARGS)
    for attempt in (
        lambda: dcp.load(_request(), tmp_path),
        lambda: dcp.load_common_state_dict(tmp_path),
    ):
        with pytest.raises(UnsafeCheckpointError) as info:
            attempt()
        msg = str(info.value)
        assert "argparse.Namespace" in msg and "common.pt" in msg
        assert "allowed_types=[argparse.Namespace]" in msg and "trusted=True" in msg

    for strategy in (
        TorchCommonLoadStrategy(allowed_types=[argparse.Namespace]),
        TorchCommonLoadStrategy(trusted=True),
    ):
        out = dcp.load(_request(), tmp_path, common_strategy=strategy)
        assert isinstance(out, dict)
        assert out["args"] == ARGS and torch.equal(out["w"], _ref())
        common = dcp.load_common_state_dict(tmp_path, common_strategy=strategy)
        assert common["args"] == ARGS

    # The permission was for those calls only: it does not leak into later loads.
    with pytest.raises(UnsafeCheckpointError):
        dcp.load_common_state_dict(tmp_path)


def test_namespace_in_sharded_object_needs_explicit_permission(tmp_path: Path) -> None:
    _save(tmp_path, rng=ShardedObject("rng", ARGS, (1,), (0,)))
    with pytest.raises(UnsafeCheckpointError) as info:
        dcp.load(_object_request(), tmp_path)
    assert "argparse.Namespace" in str(info.value) and "rng" in str(info.value)
    for strategy in (
        TorchDistLoadShardedStrategy(allowed_types=[argparse.Namespace]),
        TorchDistLoadShardedStrategy(trusted=True),
    ):
        out = dcp.load(_object_request(), tmp_path, sharded_strategy=strategy)
        assert isinstance(out, dict) and out["rng"] == ARGS


def test_allowed_types_on_load_directly(tmp_path: Path) -> None:
    """The unsafe-type message names ``load(..., allowed_types=[...])``, and that works."""
    _save(tmp_path, args=ARGS, rng=ShardedObject("rng", ARGS, (1,), (0,)))
    with pytest.raises(UnsafeCheckpointError) as info:
        dcp.load(_request(), tmp_path)
    assert "dist_checkpointing.load(..., allowed_types=[argparse.Namespace])" in str(info.value)
    out = dcp.load(
        {**_request(), **_object_request()}, tmp_path, allowed_types=[argparse.Namespace]
    )
    assert isinstance(out, dict) and out["args"] == ARGS and out["rng"] == ARGS
    common = dcp.load_common_state_dict(tmp_path, allowed_types=[argparse.Namespace])
    assert common["args"] == ARGS
    with pytest.raises(UnsafeCheckpointError):  # for that call only
        dcp.load_common_state_dict(tmp_path)
