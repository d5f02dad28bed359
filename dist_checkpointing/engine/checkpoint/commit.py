"""The commit protocol: a save never destroys the last complete checkpoint.

A checkpoint is *committed* when its commit record (``commit.json``, see
:mod:`.record`) names it; Megatron-Core and plain DCP see the same files
(``metadata.json``, ``.metadata``, ``common.pt``, ``*.distcp``) they always did.

Call sequence of one save (every rank calls each step; "C" is the coordinator):

1. :class:`Opening`, carried by the save's first vote (its sharding check's
   all-reduce): C takes the save lock (:mod:`.lock`; a second job gets
   ``ConcurrentSaveError`` on every rank), finishes an interrupted commit of the
   previous save (roll forward), deletes the leftovers of crashed saves, and
   draws the save id; every rank learns it.
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
them there (:func:`.reading.open_for_read`), and the next save finishes the renames.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ...errors import (
    CheckpointWriteError,
    ConcurrentSaveError,
    RankFailureError,
)
from .. import knobs
from ..collectives import RankGroup, describe_error
from ..storage.checksums import FileEntry, block_size
from ..storage.item_checksums import DataFileEntry
from ..storage.location import CheckpointDir
from . import lock
from .reading import open_for_read, read_record
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


class Opening:
    """Step 1 (module docstring), without a collective of its own: carried by the
    save's first vote.

    Call sequence (every rank calls each step):

    1. :meth:`ballot`, before the vote: C takes the save lock (:mod:`.lock`; a second
       job gets ``ConcurrentSaveError`` on every rank), finishes an interrupted commit
       of the previous save, deletes the leftovers of crashed saves, draws the save id
       and attaches the session; then makes its ``first_writes`` (staged, as every
       write of the save). Returns the save id as :data:`WIDTH` non-negative ints; the
       other ranks return zeros. Raises what C's step raised (the vote then fails on
       every rank).
    2. the caller's vote: one all-reduce (``MAX``) of every rank's ballot, which also
       tells every rank whether any rank failed (:meth:`.RankGroup.fail_together`);
    3. :meth:`join` with the reduced ballot (the vote passed): every rank attaches the
       session, the others with C's save id; or :meth:`failed` with the exception the
       vote raised (it failed): C releases the lock; returns what to raise.
    """

    WIDTH = 5  # the save id's 128 bits as four 32-bit ints, then "data files tagged"

    def __init__(
        self,
        ckpt: CheckpointDir | None,
        group: RankGroup,
        owns_file: Callable[[str], bool],
        digest_data_files: bool = False,
        first_writes: Callable[[Any], None] | None = None,
    ) -> None:
        self.ckpt = ckpt
        self.group = group
        self.owns_file = owns_file
        self.digest_data_files = digest_data_files
        self.first_writes = first_writes  # C's, given what ballot() is given
        self.session: SaveSession | None = None  # C's, once it holds the lock

    def ballot(self, state: Any = None) -> list[int]:
        if not self.group.is_coordinator or self.ckpt is None:
            return [0] * self.WIDTH
        ckpt, owns_file = self.ckpt, self.owns_file
        session = SaveSession(secrets.token_hex(16), block_size(), owns_file=owns_file)
        lock.acquire(ckpt, session.save_id, session)
        try:
            _, names = _recover(ckpt, owns_file)
        except BaseException:
            lock.release(ckpt, session.save_id)
            raise
        # Data files need names of their own only where they could collide with a
        # checkpoint's (a fresh directory keeps Megatron-Core's names).
        if any(owns_file(n) for n in names):
            session.data_tag = session.tag
        self.session = session
        _attach(ckpt, session, self.digest_data_files)
        if self.first_writes is not None:
            self.first_writes(state)
        words = [int(session.save_id[i : i + 8], 16) for i in range(0, 32, 8)]
        return [*words, int(bool(session.data_tag))]

    def join(self, agreed: Sequence[int]) -> SaveSession:
        assert self.ckpt is not None, "join() after a failed ballot"
        if self.session is not None:  # C: attached by ballot()
            return self.session
        save_id = "".join(f"{w:08x}" for w in agreed[:4])
        session = SaveSession(save_id, block_size(), owns_file=self.owns_file)
        session.data_tag = session.tag if agreed[4] else ""
        _attach(self.ckpt, session, self.digest_data_files)
        return session

    def failed(self, exc: BaseException) -> BaseException:
        """C deletes what its first writes staged and releases the lock (a save that
        fails its first vote leaves the directory as it found it); returns ``exc``
        (what the vote raised), or, on the other ranks where C could not take the
        lock, :class:`ConcurrentSaveError`."""
        session, ckpt = self.session, self.ckpt
        if session is not None and ckpt is not None:
            for name in session.files:
                with contextlib.suppress(OSError):
                    _remove_quietly(ckpt, session.staged_name(name))
            lock.release(ckpt, session.save_id)
            _detach(ckpt)
            self.session = None
        if self.ckpt is not None and isinstance(exc, RankFailureError):
            cause = exc.failures.get(self.group.coordinator_global_rank, "")
            if cause.startswith(ConcurrentSaveError.__name__):
                return ConcurrentSaveError(
                    f"{self.ckpt}: the save could not start on the coordinator: {cause}"
                )
        return exc


def commit(ckpt: CheckpointDir, group: RankGroup, marker: bytes) -> None:
    """Step 3 (collective): C writes the marker and the record, installs; all learn."""
    session = _session(ckpt)
    outcome: tuple[str, str] = ("ok", "")
    error: BaseException | None = None
    if group.is_coordinator:
        assert session is not None, "commit() without an Opening"
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


__all__ = [
    "COMMIT_MARKER",
    "Opening",
    "SaveSession",
    "abort",
    "cleanup",
    "commit",
    "is_protocol_file",
    "read_record",
    "recover",
    "replace_files",
]
