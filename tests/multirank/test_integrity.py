"""``verify_integrity``: sha256 digests of the data files written at save
(``integrity.json``) and checked at load."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.checkpoint.integrity import INTEGRITY_FNAME
from dist_checkpointing.engine.storage.reader import FileSystemReader
from dist_checkpointing.errors import (
    CheckpointingException,
    ChecksumMismatchError,
    CorruptCheckpointError,
)
from tests.support.harness import run_distributed

pytestmark = pytest.mark.timeout(120)

SHAPE = (16, 4)


def _ref(key: str) -> torch.Tensor:
    base = {"a": 1000, "b": 5000}[key]
    return (torch.arange(64, dtype=torch.float32) + base).reshape(SHAPE)


def _request() -> dict[str, ShardedTensor]:
    return {k: ShardedTensor.from_rank_offsets(k, torch.zeros(SHAPE)) for k in ("a", "b")}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """One rank; 'a' and 'b' in two data files (thread_count=2 by default)."""
    sd = {k: ShardedTensor.from_rank_offsets(k, _ref(k)) for k in ("a", "b")}
    sd["step"] = 9  # type: ignore[assignment]
    dcp.save(sd, tmp_path, verify_integrity=True)
    return tmp_path


def _file_of(ckpt_dir: Path, key: str) -> Path:
    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    (name,) = {i.relative_path for idx, i in metadata.storage_data.items() if idx.fqn == key}
    return ckpt_dir / name


def _flip_byte_in(path: Path, needle: bytes) -> None:
    """Flip one byte inside the first occurrence of ``needle`` (e.g. a tensor's raw bytes)."""
    data = bytearray(path.read_bytes())
    pos = data.find(needle)
    assert pos >= 0, f"{needle[:8]!r}... not found in {path}"
    data[pos + len(needle) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_records_every_written_file(ckpt: Path) -> None:
    manifest = json.loads((ckpt / INTEGRITY_FNAME).read_text())
    assert manifest["algorithm"] == "sha256"
    names = sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp")) + [
        "common.pt",
        ".metadata",
        ".metadata_index.json",
    ]
    assert sorted(manifest["files"]) == sorted(names)
    for name in names:
        assert manifest["files"][name] == _sha256(ckpt / name), name


def test_load_with_verification(ckpt: Path) -> None:
    out = dcp.load(_request(), ckpt, verify_integrity=True, verify_checksums=False)
    assert isinstance(out, dict)
    assert torch.equal(out["a"], _ref("a")) and torch.equal(out["b"], _ref("b"))
    assert out["step"] == 9


def test_flipped_byte_is_detected_and_names_the_file(ckpt: Path) -> None:
    b_file = _file_of(ckpt, "b")
    assert _file_of(ckpt, "a") != b_file
    _flip_byte_in(b_file, _ref("b").numpy().tobytes())
    # The default load catches it with the checksums recorded at save ...
    with pytest.raises(ChecksumMismatchError, match=b_file.name):
        dcp.load(_request(), ckpt)
    # ... without any verification the damage goes unnoticed ...
    unverified = dcp.load(_request(), ckpt, verify_checksums=False)
    assert isinstance(unverified, dict) and not torch.equal(unverified["b"], _ref("b"))
    # ... with it, the load fails before reading, naming the file.
    with pytest.raises(CorruptCheckpointError) as info:
        dcp.load(_request(), ckpt, verify_integrity=True, verify_checksums=False)
    msg = str(info.value)
    assert b_file.name in msg and "sha256" in msg
    assert _file_of(ckpt, "a").name not in msg
    # Only the files a load reads are checked: 'a' alone still loads.
    request = {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(SHAPE))}
    out = dcp.load(request, ckpt, verify_integrity=True, verify_checksums=False)
    assert isinstance(out, dict) and torch.equal(out["a"], _ref("a"))


def test_missing_manifest_is_a_clear_error(ckpt: Path) -> None:
    (ckpt / INTEGRITY_FNAME).unlink()
    with pytest.raises(CheckpointingException) as info:
        dcp.load(_request(), ckpt, verify_integrity=True, verify_checksums=False)
    msg = str(info.value)
    assert INTEGRITY_FNAME in msg and "verify_integrity" in msg and str(ckpt) in msg


def test_checkpoint_saved_without_verification_has_no_manifest(tmp_path: Path) -> None:
    dcp.save({"a": ShardedTensor.from_rank_offsets("a", _ref("a"))}, tmp_path)
    assert not (tmp_path / INTEGRITY_FNAME).exists()
    request = {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(SHAPE))}
    with pytest.raises(CheckpointingException, match=INTEGRITY_FNAME):
        dcp.load(request, tmp_path, verify_integrity=True, verify_checksums=False)


def _rewrite_manifest(ckpt_dir: Path, fmt: str) -> None:
    files = json.loads((ckpt_dir / INTEGRITY_FNAME).read_text())["files"]
    body: dict[str, Any]
    if fmt == "nested":
        body = {"files": {name: {"sha256": digest} for name, digest in files.items()}}
    else:  # names at the top level
        body = dict(files)
    (ckpt_dir / INTEGRITY_FNAME).write_text(json.dumps(body))


@pytest.mark.parametrize("fmt", ["nested", "top_level"])
def test_tolerant_manifest_formats(ckpt: Path, fmt: str) -> None:
    _rewrite_manifest(ckpt, fmt)
    out = dcp.load(_request(), ckpt, verify_integrity=True, verify_checksums=False)
    assert isinstance(out, dict) and torch.equal(out["b"], _ref("b"))
    # The digests are really compared in that format too.
    b_file = _file_of(ckpt, "b")
    _flip_byte_in(b_file, _ref("b").numpy().tobytes())
    with pytest.raises(CorruptCheckpointError, match=b_file.name):
        dcp.load(_request(), ckpt, verify_integrity=True, verify_checksums=False)


def test_file_missing_from_manifest(ckpt: Path) -> None:
    a_file = _file_of(ckpt, "a")
    manifest = json.loads((ckpt / INTEGRITY_FNAME).read_text())
    del manifest["files"][a_file.name]
    (ckpt / INTEGRITY_FNAME).write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError) as info:
        dcp.load(_request(), ckpt, verify_integrity=True, verify_checksums=False)
    assert a_file.name in str(info.value) and "not listed" in str(info.value)


@pytest.mark.parametrize(
    ("content", "expected"),
    [("{broken json", "unreadable"), (json.dumps({"algorithm": "md5", "files": {}}), "md5")],
    ids=["garbage", "unknown_algorithm"],
)
def test_bad_manifest(ckpt: Path, content: str, expected: str) -> None:
    (ckpt / INTEGRITY_FNAME).write_text(content)
    with pytest.raises(CorruptCheckpointError) as info:
        dcp.load(_request(), ckpt, verify_integrity=True, verify_checksums=False)
    assert INTEGRITY_FNAME in str(info.value) and expected in str(info.value)


def test_modified_common_state_is_detected(tmp_path: Path) -> None:
    marker = torch.arange(32, dtype=torch.int64) + 777
    dcp.save(
        {"a": ShardedTensor.from_rank_offsets("a", _ref("a")), "marker": marker},
        tmp_path,
        verify_integrity=True,
    )
    _flip_byte_in(tmp_path / "common.pt", marker.numpy().tobytes())
    request = {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(SHAPE))}
    with pytest.raises(CorruptCheckpointError, match="common.pt"):
        dcp.load(request, tmp_path, verify_integrity=True, verify_checksums=False)


# ----------------------------------------------------------------------------- several ranks


def _rank_save_and_verify(ckpt_dir: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = {
        k: ShardedTensor.from_rank_offsets(k, _ref(k).chunk(world)[rank].clone(), (0, rank, world))
        for k in ("a", "b")
    }
    dcp.save(sd, ckpt_dir, verify_integrity=True)
    # Load the other rank's rows: each rank verifies files another rank wrote.
    other = (rank + 1) % world
    request = {
        k: ShardedTensor.from_rank_offsets(k, torch.zeros(SHAPE[0] // world, 4), (0, other, world))
        for k in ("a", "b")
    }
    out = dcp.load(request, ckpt_dir, verify_integrity=True, verify_checksums=False)
    assert isinstance(out, dict)
    return {k: torch.equal(out[k], _ref(k).chunk(world)[other]) for k in ("a", "b")}


def test_every_rank_digests_its_files(tmp_path: Path) -> None:
    results = run_distributed(_rank_save_and_verify, 2, str(tmp_path), timeout=60)
    assert results == [{"a": True, "b": True}] * 2
    files = json.loads((tmp_path / INTEGRITY_FNAME).read_text())["files"]
    data_files = sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp"))
    assert {n[:3] for n in data_files} == {"__0", "__1"}  # both ranks wrote files
    assert sorted(files) == sorted(data_files + ["common.pt", ".metadata", ".metadata_index.json"])
    for name in files:
        assert files[name] == _sha256(tmp_path / name), name


def test_integrity_manifest_is_replaced_on_overwrite(ckpt: Path) -> None:
    """Overwriting a verified checkpoint without verification drops the stale manifest."""
    dcp.save({"a": ShardedTensor.from_rank_offsets("a", _ref("b"))}, ckpt)
    assert not (ckpt / INTEGRITY_FNAME).exists()
    request = {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(SHAPE))}
    out = dcp.load(request, ckpt)
    assert isinstance(out, dict) and torch.equal(out["a"], _ref("b"))
