"""``integrity.json`` is read once per checkpoint handle (a load with
``verify_integrity=True`` checks the metadata files, then the data files, against it), and
a write of it through the handle is seen by the next read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dist_checkpointing.engine.checkpoint.integrity import (
    INTEGRITY_FNAME,
    read_manifest,
    write_manifest,
)
from dist_checkpointing.engine.storage.location import CheckpointDir


def test_the_manifest_is_read_once_per_handle_and_again_after_a_write(
    tmp_path: Path, monkeypatch: Any
) -> None:
    ckpt = CheckpointDir.of(str(tmp_path))
    assert read_manifest(ckpt) is None  # none yet
    write_manifest(ckpt, {"a": "11" * 32})
    reads: list[str] = []
    read_whole = ckpt.fs.read_whole

    def counting(path: str, *args: Any, **kwargs: Any) -> bytes:
        reads.append(Path(path).name)
        return read_whole(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.fs, "read_whole", counting)
    assert read_manifest(ckpt) == {"a": "11" * 32}
    assert read_manifest(ckpt) == {"a": "11" * 32}
    assert reads == [INTEGRITY_FNAME]
    write_manifest(ckpt, {"a": "22" * 32, "b": "33" * 32})
    assert read_manifest(ckpt) == {"a": "22" * 32, "b": "33" * 32}
    assert reads == [INTEGRITY_FNAME, INTEGRITY_FNAME]
    # another handle reads the file itself
    assert read_manifest(CheckpointDir.of(str(tmp_path))) == {"a": "22" * 32, "b": "33" * 32}
