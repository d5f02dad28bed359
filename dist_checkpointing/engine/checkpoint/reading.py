"""The load side of the commit protocol (:mod:`.commit`): :func:`open_for_read`.

A load reads the commit record (if any), reads the staged files of a commit cut short
after its commit point where they are, and checks what it reads against the record.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from ...errors import ForeignFileError, IncompleteCheckpointError
from ..storage.checksums import FileEntry
from ..storage.item_checksums import ItemChecksum
from ..storage.location import CheckpointDir
from .record import COMMIT_RECORD, CommitRecord


def read_record(ckpt: CheckpointDir) -> CommitRecord | None:
    """The checkpoint's commit record (None for checkpoints written without one)."""
    if not ckpt.has(COMMIT_RECORD):
        return None
    return CommitRecord.from_bytes(ckpt.read_unchecked(COMMIT_RECORD), ckpt.path(COMMIT_RECORD))


def open_for_read(ckpt: CheckpointDir, verify: bool = True) -> CommitRecord | None:
    """Set up a load: read the record (if any), read staged files of an interrupted
    commit in place, and (with ``verify``) check every whole file and data item
    read through the handle against the record.

    Raises:
        IncompleteCheckpointError: the record names a file that is missing.
        CorruptCheckpointError: the record is damaged.
    """
    record = ckpt.memo(COMMIT_RECORD, lambda: read_record(ckpt))
    ctx = ckpt.context
    if record is None:
        return None
    ctx.aliases = {final: staged for final, staged in record.install.items() if ckpt.has(staged)}
    missing = [n for n in record.files if not ckpt.has(n)]
    if missing:
        hint = " (saved with verify_integrity=True)" if "integrity.json" in missing else ""
        raise IncompleteCheckpointError(
            f"{ckpt}: the commit record of save {record.save_id} names "
            f"{', '.join(sorted(missing))}, which is missing{hint}"
        )
    ctx.attachments["record"] = record
    if verify:
        ctx.on_read = _file_verifier(ckpt, record)
        if record.data_checksums:
            ctx.item_checksum = _item_lookup(record)
            ctx.block_bytes = record.block_bytes
    return record


def _file_verifier(ckpt: CheckpointDir, record: CommitRecord) -> Callable[[str, bytes], None]:
    # The handle is held weakly: it holds this function (its context's on_read), and a
    # cycle would keep the handle's parsed metadata alive until a garbage collection.
    handle = weakref.ref(ckpt)

    def check(name: str, data: bytes) -> None:
        entry = record.files.get(name)
        if entry is None:
            return
        if FileEntry.of(data, record.block_bytes) != entry:
            owner = handle()
            raise ForeignFileError(
                f"{owner.path(name) if owner else name} does not match the commit record of save "
                f"{record.save_id} ({len(data)} bytes, recorded {entry.size}; checksums "
                f"differ): it was modified or comes from another save"
            )

    return check


def _item_lookup(record: CommitRecord) -> Callable[[str, int], ItemChecksum | None]:
    def lookup(relative_path: str, offset: int) -> ItemChecksum | None:
        entry = record.data_files.get(relative_path)
        return None if entry is None else entry.item_at(offset)

    return lookup


__all__ = ["open_for_read", "read_record"]
