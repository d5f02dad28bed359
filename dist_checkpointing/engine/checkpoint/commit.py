"""The commit protocol: a save never destroys the last complete checkpoint.

A checkpoint is *committed* when its commit record (``commit.json``, see
:mod:`.record`) names it; Megatron-Core and plain DCP see the same files
(``metadata.json``, ``.metadata``, ``common.pt``, ``*.distcp``) they always did.

Call sequence of one save (every rank calls each step; "C" is the coordinator):

1. :func:`begin`, after the save was validated: C takes the save lock
   (:mod:`.lock`; a second job gets ``ConcurrentSaveError`` on every rank),
   finishes an interrupted commit of the previous save (roll forward), deletes
   the leftovers of crashed saves, and draws the save id; every rank learns it.
   The handle's context then *stages* the fixed-name files: ``.metadata``,
   ``common.pt``, ``metadata.json`` and ``integrity.json`` are written as
   ``<name>.<tag>.pending``; where the directory already holds checkpoint files,
   data files get the tag in their names (``__<rank>_<n>.<tag>.distcp``; a fresh
   directory keeps Megatron-Core's ``__<rank>_<n>.distcp``). Nothing of the
   previous checkpoint is touched.
2. The strategies write data files (each item checksummed as it is written),
   the common state and ``.metadata``; C receives every item's checksums.
3. :func:`commit`: C writes ``metadata.json`` (staged), makes sure every staged
   file is durable, then writes ``commit.json`` atomically and fsyncs the
   directory: **this is the commit point**. C then renames the staged files to
   their final names, rewrites the record without its ``install`` list, deletes
   the previous checkpoint's files that the new one does not use, and releases
   the lock. Every rank learns the outcome (an error is raised on every rank).

A crash before the commit point leaves the previous checkpoint exactly as it
was; the next save deletes the leftovers (``*.pending`` files, data files no
committed checkpoint names) under the lock. A crash after it leaves a record
whose ``install`` list names files still under their staged names: a load reads
them there (:func:`open_for_read`), and the next save finishes the renames.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ...errors import (
    CheckpointWriteError,
    ConcurrentSaveError,
    ForeignFileError,
    IncompleteCheckpointError,
)
from .. import knobs
from ..collectives import RankGroup, describe_error
from ..storage.checksums import FileEntry, block_size
from ..storage.item_checksums import DataFileEntry, ItemChecksum
from ..storage.location import CheckpointDir
from . import lock
from .record import COMMIT_RECORD, CommitRecord

logger = logging.getLogger(__name__)

COMMIT_MARKER = "metadata.json"
PENDING_SUFFIX = ".pending"


@dataclass
class SaveSession:
    """The state of one save through the protocol (what C records for the record)."""

    save_id: str
    block_bytes: int
    files: dict[str, FileEntry] = field(default_factory=dict)
    data_files: dict[str, DataFileEntry] = field(default_factory=dict)
    owns_file: Callable[[str], bool] = field(default=lambda name: False, repr=False)
    data_tag: str = ""  # in data file names ("" in a directory without checkpoint files)

    @property
    def tag(self) -> str:
        return self.save_id[:12]

    def staged_name(self, name: str) -> str:
        return f"{name}.{self.tag}{PENDING_SUFFIX}"


def _session(ckpt: CheckpointDir) -> SaveSession | None:
    session = ckpt.context.attachments.get("session")
    return session if isinstance(session, SaveSession) else None


def _attach(ckpt: CheckpointDir, session: SaveSession, digest_data_files: bool) -> None:
    ctx = ckpt.context
    ctx.stage = session.staged_name
    ctx.save_tag = session.data_tag
    ctx.block_bytes = session.block_bytes if knobs.WRITE_CHECKSUMS.get() else 0
    ctx.attachments["session"] = session
    ctx.attachments["save_id"] = session.save_id
    ctx.digest_data_files = digest_data_files
    ctx.file_digests = {}

    def on_write(name: str, data: bytes | bytearray) -> None:
        session.files[name] = FileEntry.of(data, session.block_bytes)

    ctx.on_write = on_write
    ctx.on_data_files = session.data_files.update


def _detach(ckpt: CheckpointDir) -> None:
    ctx = ckpt.context
    ctx.stage = None
    ctx.aliases = {}
    ctx.save_tag = ""
    ctx.on_write = None
    ctx.on_data_files = None
    ctx.digest_data_files = False
    ctx.file_digests = {}
    ctx.attachments.pop("session", None)


# --------------------------------------------------------------------------- save


def begin(
    ckpt: CheckpointDir,
    group: RankGroup,
    owns_file: Callable[[str], bool],
    digest_data_files: bool = False,
) -> SaveSession:
    """Step 1 (collective): lock, recover, clean up, agree on the save id.

    ``owns_file(name)`` says which files of the directory belong to checkpoints
    (the strategies' files and the protocol's): only those are ever deleted.
    ``digest_data_files``: the save records an integrity manifest, so its data file
    writers compute each file's sha256 as they write it (``ckpt.context``).
    """
    outcome: tuple[str, str] = ("ok", "")
    error: BaseException | None = None
    session: SaveSession | None = None
    if group.is_coordinator:
        session = SaveSession(secrets.token_hex(16), block_size(), owns_file=owns_file)
        save_id = session.save_id
        try:
            lock.acquire(ckpt, save_id, session)
            try:
                _, names = _recover(ckpt, owns_file)
                # Data files need names of their own only where they could collide
                # with a checkpoint's (a fresh directory keeps Megatron-Core's names).
                if any(owns_file(n) for n in names):
                    session.data_tag = session.tag
            except BaseException:
                lock.release(ckpt, save_id)
                raise
            outcome = ("ok", f"{save_id}:{session.data_tag}")
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
            outcome = ("error", describe_error(exc))
    status, value = group.broadcast(outcome)
    if status == "error":
        if error is not None:
            raise error
        kind = ConcurrentSaveError if "ConcurrentSaveError" in value else CheckpointWriteError
        raise kind(f"{ckpt}: the save could not start on the coordinator: {value}")
    if session is None:
        save_id, data_tag = value.split(":")
        session = SaveSession(save_id, block_size(), owns_file=owns_file, data_tag=data_tag)
    _attach(ckpt, session, digest_data_files)
    return session


def commit(ckpt: CheckpointDir, group: RankGroup, marker: bytes) -> None:
    """Step 3 (collective): C writes the marker and the record, installs; all learn."""
    session = _session(ckpt)
    outcome: tuple[str, str] = ("ok", "")
    error: BaseException | None = None
    if group.is_coordinator:
        assert session is not None, "commit() without begin()"
        try:
            ckpt.atomic_write(COMMIT_MARKER, marker)
            _write_record_and_install(ckpt, session, group.world)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
            outcome = ("error", describe_error(exc))
        finally:
            lock.release(ckpt, session.save_id)
    status, message = group.broadcast(outcome)
    _detach(ckpt)
    if status == "error":
        if error is not None:
            raise error
        raise CheckpointWriteError(f"{ckpt}: the commit failed on the coordinator: {message}")


def abort(ckpt: CheckpointDir, group: RankGroup) -> None:
    """After a failed save (every rank that saw the failure): C releases the lock.

    The failed save's files stay until the next save deletes them; the previous
    checkpoint is untouched. Never raises.
    """
    session = _session(ckpt)
    if session is not None and group.is_coordinator:
        lock.release(ckpt, session.save_id)
    _detach(ckpt)


def _write_record_and_install(ckpt: CheckpointDir, session: SaveSession, world: int) -> None:
    staged = {n: session.staged_name(n) for n in session.files}
    record = CommitRecord(
        save_id=session.save_id,
        world_size=world,
        block_bytes=session.block_bytes,
        files=dict(session.files),
        data_files=dict(session.data_files),
        install=staged,
        data_checksums=bool(ckpt.context.block_bytes),
    )
    _write_record(ckpt, record)
    # --- committed: everything below may be redone by the next save or load.
    _install(ckpt, record)
    for key in (COMMIT_RECORD, *record.files):
        ckpt.forget(key)
    if session.data_tag:  # a fresh directory held nothing of ours: nothing to clean up
        cleanup(ckpt, record, session.owns_file)


def _write_record(ckpt: CheckpointDir, record: CommitRecord) -> None:
    ckpt.fs.atomic_write(ckpt.fs.join(ckpt.root, COMMIT_RECORD), record.to_bytes())


def _install(ckpt: CheckpointDir, record: CommitRecord) -> None:
    """Rename the record's staged files to their final names, then rewrite it without
    its install list (idempotent: an install cut short is redone)."""

    def install(pair: tuple[str, str]) -> None:
        final, staged = pair
        src = ckpt.fs.join(ckpt.root, staged)
        if ckpt.fs.exists(src):
            ckpt.fs.rename(src, ckpt.fs.join(ckpt.root, final))

    pairs = list(record.install.items())
    threads = min(len(pairs), ckpt.fs.parallel_reads())
    if threads > 1:  # object stores: each rename is requests, overlap them
        with ThreadPoolExecutor(threads, thread_name_prefix="dist-ckpt-install") as pool:
            list(pool.map(install, pairs))
    else:
        for pair in pairs:
            install(pair)
    record.install = {}
    _write_record(ckpt, record)


def read_record(ckpt: CheckpointDir) -> CommitRecord | None:
    """The checkpoint's commit record (None for checkpoints written without one)."""
    if not ckpt.has(COMMIT_RECORD):
        return None
    return CommitRecord.from_bytes(ckpt.read_unchecked(COMMIT_RECORD), ckpt.path(COMMIT_RECORD))


def recover(ckpt: CheckpointDir, owns_file: Callable[[str], bool]) -> CommitRecord | None:
    """(C, under the lock) Finish an interrupted commit, then delete leftovers:
    staged files and data files that the committed checkpoint does not name.
    Returns the committed record (None: the checkpoint has none)."""
    return _recover(ckpt, owns_file)[0]


def _recover(
    ckpt: CheckpointDir, owns_file: Callable[[str], bool]
) -> tuple[CommitRecord | None, list[str]]:
    """:func:`recover`; also the names the directory holds afterwards."""
    names: list[str] | None = ckpt.listdir()  # first: on object stores it answers has()
    record = read_record(ckpt)
    if record is not None and record.install:
        logger.warning("%s: finishing the interrupted commit of save %s", ckpt, record.save_id)
        _install(ckpt, record)
        names = None  # renamed: list again
    return record, cleanup(ckpt, record, owns_file, names)


def cleanup(
    ckpt: CheckpointDir,
    record: CommitRecord | None,
    owns_file: Callable[[str], bool],
    names: list[str] | None = None,
) -> list[str]:
    """Delete the files of ours that the committed checkpoint does not use; return the
    names left. ``names``: the directory's entries, if just listed."""
    keep = record.names() if record is not None else None
    left = []
    for name in ckpt.listdir() if names is None else names:
        leftover = name.endswith(PENDING_SUFFIX) or name.endswith(".tmp") and owns_file(name[:-4])
        if not leftover and keep is not None and owns_file(name):
            leftover = name not in keep
        if (
            not leftover
            and keep is None
            and (".distcp" in name or owns_file(name))
            and _tagged(name)
        ):
            leftover = True  # tagged data files of a save that never committed
        if leftover:
            logger.info("%s: removing %s (not part of the committed checkpoint)", ckpt, name)
            _remove_quietly(ckpt, name)
        else:
            left.append(name)
    return left


def is_protocol_file(name: str) -> bool:
    """Whether ``name`` is a file of the protocol itself (lock, record, staged file)."""
    return name in (lock.LOCK_NAME, COMMIT_RECORD) or name.endswith(PENDING_SUFFIX)


def _tagged(name: str) -> bool:
    parts = name.split(".")
    return (
        len(parts) >= 3 and len(parts[-2]) == 12 and all(c in "0123456789abcdef" for c in parts[-2])
    )


# --------------------------------------------------------------------------- rewrite


def replace_files(ckpt: CheckpointDir, new_files: dict[str, bytes], delete: Iterable[str]) -> None:
    """Replace whole files and delete data files of a committed checkpoint, crash-safely
    (one process; e.g. ``remove_sharded_tensors``).

    Under the save lock: the new files are staged, the new record (the commit
    point) names them and no longer names ``delete``; then they are installed and
    ``delete`` removed. Without a record (a checkpoint Megatron-Core wrote) each new
    file is replaced atomically before anything is deleted.
    """
    doomed = sorted(set(delete))
    record = read_record(ckpt)
    if record is None:
        for name, data in new_files.items():
            ckpt.atomic_write(name, data)
        for name in doomed:
            _remove_quietly(ckpt, name)
        return
    session = SaveSession(secrets.token_hex(16), record.block_bytes)
    lock.acquire(ckpt, session.save_id, session)
    try:
        record = recover(ckpt, lambda name: False)
        assert record is not None
        for name, data in new_files.items():
            ckpt.fs.atomic_write(ckpt.fs.join(ckpt.root, session.staged_name(name)), data)
            record.files[name] = FileEntry.of(data, record.block_bytes)
            record.install[name] = session.staged_name(name)
        for name in doomed:
            record.data_files.pop(name, None)
        _write_record(ckpt, record)
        # --- committed
        _install(ckpt, record)
        for name in doomed:
            _remove_quietly(ckpt, name)
    finally:
        lock.release(ckpt, session.save_id)
        for key in (COMMIT_RECORD, *new_files):
            ckpt.forget(key)
    if ckpt.context.attachments.get("record") is not None:  # a load set up this handle
        open_for_read(ckpt, verify=ckpt.context.on_read is not None)


def _remove_quietly(ckpt: CheckpointDir, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        ckpt.fs.remove(ckpt.fs.join(ckpt.root, name))


# --------------------------------------------------------------------------- load


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


__all__ = [
    "COMMIT_MARKER",
    "SaveSession",
    "abort",
    "begin",
    "cleanup",
    "commit",
    "is_protocol_file",
    "open_for_read",
    "read_record",
    "recover",
    "replace_files",
]
