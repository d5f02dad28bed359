"""File names in a checkpoint someone else made: every path stays inside the directory.

An attacker with write access to a checkpoint directory (shared scratch space, a
downloaded checkpoint) controls ``.metadata`` (its ``relative_path`` fields) and the
directory entries. Loading must never read, and ``remove_sharded_tensors`` never delete,
anything outside the directory or a non-data file inside it; saving must never write
through a planted link; a FIFO must not block; no message may reveal whether a path
outside the checkpoint exists or its size.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.storage.location import CheckpointDir
from dist_checkpointing.engine.storage.names import safe_name
from dist_checkpointing.engine.storage.reader import FileSystemReader
from dist_checkpointing.errors import CheckpointingException, UnsafeCheckpointError

pytestmark = pytest.mark.timeout(60)

SHAPE = (4, 6)
DATA = "__0_0.distcp"


def _ref(seed: int = 0) -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).reshape(SHAPE) + seed


def _state(*keys: str) -> dict[str, Any]:
    return {k: ShardedTensor.from_rank_offsets(k, _ref(i)) for i, k in enumerate(keys)}


def _request(*keys: str) -> dict[str, Any]:
    return {k: ShardedTensor.from_rank_offsets(k, torch.zeros(SHAPE)) for k in keys}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    dcp.save(_state("w", "v"), d)
    assert (d / DATA).is_file()
    return d


def _rename_files(ckpt_dir: Path, new_name: str, fqn: str | None = None) -> None:
    """Rewrite ``.metadata`` so that the items (of ``fqn``, or all) name ``new_name``."""
    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    assert metadata.storage_data is not None
    for index, info in list(metadata.storage_data.items()):
        if fqn is None or index.fqn == fqn:
            metadata.storage_data[index] = dataclasses.replace(info, relative_path=new_name)
    metadata.storage_meta = None
    (ckpt_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    # A crafted file comes with the commit record deleted (it would refuse the file first).
    (ckpt_dir / "commit.json").unlink(missing_ok=True)


# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    "name",
    ["../x", "/etc/passwd", "a/../../x", "sub/__0_0.distcp", "..", ".", "", "a\x00b", "a\\..\\b"],
)
def test_safe_name_refuses_names_outside_the_directory(name: str) -> None:
    with pytest.raises(UnsafeCheckpointError, match="ckpt/.metadata"):
        safe_name(name, source="ckpt/.metadata")


def test_safe_name_makes_equivalent_spellings_one_name() -> None:
    assert safe_name("./__0_0.distcp", source="s") == DATA
    assert safe_name(".//__0_0.distcp", source="s") == DATA
    with pytest.raises(CheckpointingException, match="must be a string"):
        safe_name(3, source="s")


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_load_never_reads_a_file_outside_the_checkpoint(
    ckpt: Path, tmp_path: Path, how: str
) -> None:
    outside = tmp_path / "secret.distcp"
    outside.write_bytes((ckpt / DATA).read_bytes())  # a valid data file, readable
    name = "../secret.distcp" if how == "dotdot" else str(outside)
    _rename_files(ckpt, name)
    with pytest.raises(UnsafeCheckpointError) as info:
        dcp.load(_request("w", "v"), ckpt)
    assert ".metadata" in str(info.value) and "refusing file name" in str(info.value)


def test_refusal_does_not_reveal_whether_an_outside_path_exists(ckpt: Path, tmp_path: Path) -> None:
    present = tmp_path / "present"
    present.write_bytes(b"x" * 631)
    messages = []
    for target in (present, tmp_path / "absent"):
        _rename_files(ckpt, str(target))
        with pytest.raises(CheckpointingException) as info:
            dcp.load(_request("w", "v"), ckpt)
        messages.append(str(info.value).replace(target.name, "TARGET"))
    assert messages[0] == messages[1]
    assert "631" not in messages[0]


def test_symlinked_data_file_is_refused(ckpt: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.distcp"
    (ckpt / DATA).rename(outside)
    (ckpt / DATA).symlink_to(outside)
    with pytest.raises(UnsafeCheckpointError, match=f"{DATA} is a symbolic link"):
        dcp.load(_request("w", "v"), ckpt)


def test_symlinked_metadata_and_common_state_are_refused(ckpt: Path, tmp_path: Path) -> None:
    for name in (".metadata", "common.pt"):
        outside = tmp_path / name.lstrip(".")
        (ckpt / name).rename(outside)
        (ckpt / name).symlink_to(outside)
        with pytest.raises(UnsafeCheckpointError, match=f"{name} is a symbolic link"):
            dcp.load(_request("w", "v"), ckpt)
        (ckpt / name).unlink()
        outside.rename(ckpt / name)


def _load_in_thread(ckpt: Path) -> BaseException | None:
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            dcp.load(_request("w", "v"), ckpt)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():  # unblock it: open a writer on the FIFO, then fail
        fd = os.open(ckpt / DATA, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        thread.join(5)
        pytest.fail("load blocked on a FIFO")
    return outcome[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_fifo_named_like_a_data_file_does_not_block(ckpt: Path) -> None:
    (ckpt / DATA).unlink()
    os.mkfifo(ckpt / DATA)
    exc = _load_in_thread(ckpt)
    assert isinstance(exc, UnsafeCheckpointError), exc
    assert f"{DATA} is a FIFO" in str(exc)


# ----------------------------------------------------------------------------- remove


@pytest.mark.parametrize("name", ["../victim.distcp", "ABSOLUTE", "common.pt", ".metadata"])
def test_remove_sharded_tensors_deletes_nothing_outside_the_data_files(
    ckpt: Path, tmp_path: Path, name: str
) -> None:
    victim = tmp_path / "victim.distcp"
    victim.write_bytes(b"precious")
    if name == "ABSOLUTE":
        name = str(victim)
    _rename_files(ckpt, name, fqn="w")
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata"):
        dcp.remove_sharded_tensors(ckpt, "w")
    assert victim.read_bytes() == b"precious"
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before  # nothing changed


def test_remove_sharded_tensors_keeps_a_file_spelled_two_ways(ckpt: Path) -> None:
    _rename_files(ckpt, f"./{DATA}", fqn="w")  # "v" still names it DATA
    dcp.remove_sharded_tensors(ckpt, "w")
    assert (ckpt / DATA).is_file()
    loaded = dcp.load(_request("v"), ckpt)
    assert torch.equal(loaded["v"], _ref(1))


# ----------------------------------------------------------------------------- save


def test_save_does_not_follow_symlinks_planted_in_the_target(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    victims = {}
    for name in (DATA, ".metadata", "common.pt", "metadata.json", ".metadata.tmp"):
        victim = tmp_path / f"victim{len(victims)}"
        victim.write_bytes(b"precious")
        (target / name).symlink_to(victim)
        victims[name] = victim
    dcp.save(_state("w", "v"), target)
    for victim in victims.values():
        assert victim.read_bytes() == b"precious"
    for name in (DATA, ".metadata", "common.pt", "metadata.json"):
        assert not (target / name).is_symlink()
    loaded = dcp.load(_request("w", "v"), target)
    assert torch.equal(loaded["w"], _ref(0)) and torch.equal(loaded["v"], _ref(1))


def test_hard_link_planted_in_the_target_is_not_written_through(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.link(victim, target / DATA)
    dcp.save(_state("w"), target)
    assert victim.read_bytes() == b"precious"


def test_checkpoint_dir_entry_is_the_one_helper(ckpt: Path) -> None:
    handle = CheckpointDir.of(ckpt)
    assert handle.entry(f"./{DATA}", source="x") == DATA
    with pytest.raises(UnsafeCheckpointError):
        handle.entry("../x", source="x")


def test_writers_target_names_pass_the_same_check() -> None:
    from dist_checkpointing.engine.storage.bucketing import data_file_name

    assert data_file_name("__0_", 2, "optimizer.") == "optimizer.__0_2.distcp"
    for hint in ("../evil.", "/tmp/evil.", "sub/"):
        with pytest.raises(UnsafeCheckpointError, match="save: refusing file name"):
            data_file_name("__0_", 0, hint)
