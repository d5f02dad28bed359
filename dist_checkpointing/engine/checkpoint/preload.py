"""A load's small files, read once for every rank: :func:`preload_small_files`.

A load's first steps read whole files one after another on every rank: the commit
record, ``metadata.json``, ``common.pt``, ``.metadata``. On an object store each is
a request with a round trip, so N ranks send 4N requests, each rank waiting for its
own in sequence (plus a listing to learn that the "directory" exists and the sizes of
its data files). Here the coordinator fetches them for everyone:

1. (coordinator) GETs the commit record and the ``names`` the caller expects, all at
   once (threads: one round trip). A missing file is recorded as missing.
2. (coordinator) With a record: GETs the other whole files it names (and the staged
   names of an interrupted commit) that fit in ``LOAD_PRELOAD_BYTES``, again at once;
   the data files' sizes come from the record. Without one (a checkpoint written by
   Megatron-Core or plain DCP): one listing gives the data files' sizes.
3. (every rank, one broadcast) The bytes and sizes go to every rank; each rank's
   :class:`~dist_checkpointing.engine.storage.location.CheckpointDir` serves them from
   memory (:meth:`~dist_checkpointing.engine.storage.location.CheckpointDir.preload`).

Nothing changes in what a load checks: the preloaded bytes pass through the same
reads, checked against the commit record as any file read through the handle. The
step only saves requests: if the coordinator fails to fetch anything (storage
errors, a damaged record), it logs why and hands out what it has, possibly nothing,
and each rank reads the rest itself, with the usual errors on every rank.

By default only object stores (``msc://``) do this (``LOAD_PRELOAD``: 0 never, 1
object stores, 2 every backend, e.g. a shared file system at thousands of ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import knobs
from ..collectives import RankGroup
from ..storage.location import CheckpointDir
from .record import COMMIT_RECORD, CommitRecord

logger = logging.getLogger(__name__)

_MAX_THREADS = 16


@dataclass
class Preloaded:
    """What the coordinator read: ``files`` (name -> bytes, None: missing) and the
    ``sizes`` of other files (the data files)."""

    files: dict[str, bytes | None] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)


def wanted(ckpt: CheckpointDir) -> bool:
    """Whether a load of ``ckpt`` preloads its small files (the ``LOAD_PRELOAD`` knob)."""
    mode = knobs.LOAD_PRELOAD.get()
    return mode >= 2 or (mode == 1 and ckpt.fs.implicit_directories)


def preload_small_files(ckpt: CheckpointDir, group: RankGroup, names: Sequence[str]) -> None:
    """(every rank of the load, collectively) Read ``ckpt``'s commit record, ``names``
    and the other whole files the record names once, on the coordinator, and hand
    them to every rank's handle (see the module doc). Never raises for the storage:
    whatever could not be fetched is read by each rank later, as without this step."""
    found = Preloaded()
    if group.is_coordinator:
        try:
            found = _fetch(ckpt, names)
        except Exception as exc:  # noqa: BLE001 - an optimization: each rank reads instead
            logger.info("%s: not preloading the small files (%s)", ckpt, exc)
            found = Preloaded()
    found = group.broadcast(found)
    ckpt.preload(found.files, found.sizes)


def _fetch(ckpt: CheckpointDir, names: Sequence[str]) -> Preloaded:
    """(coordinator) The files, in at most two parallel rounds, and the sizes."""
    out = Preloaded()
    out.files.update(_get_all(ckpt, [COMMIT_RECORD, *names]))
    raw = out.files[COMMIT_RECORD]
    if raw is None:
        if any(data is not None for data in out.files.values()):
            out.sizes = ckpt.fs.listdir_sizes(ckpt.root)
        return out
    record = CommitRecord.from_bytes(raw, ckpt.path(COMMIT_RECORD))
    budget = knobs.LOAD_PRELOAD_BYTES.get() - sum(len(d or b"") for d in out.files.values())
    more = []
    for name, entry in sorted(record.files.items(), key=lambda kv: kv[1].size):
        if name not in out.files and entry.size <= budget:
            more.append(name)
            budget -= entry.size
    more += [staged for staged in record.install.values() if staged not in out.files]
    out.files.update(_get_all(ckpt, more))
    out.sizes = {name: entry.size for name, entry in record.data_files.items()}
    return out


def _get_all(ckpt: CheckpointDir, names: Sequence[str]) -> dict[str, bytes | None]:
    """``{name: content or None (missing)}``, fetched in parallel."""
    if not names:
        return {}

    def one(name: str) -> bytes | None:
        try:
            return ckpt.fs.read_whole(ckpt.fs.join(ckpt.root, name))
        except FileNotFoundError:
            return None

    with ThreadPoolExecutor(min(len(names), _MAX_THREADS), "dist-ckpt-preload") as pool:
        return dict(zip(names, pool.map(one, names), strict=True))


__all__ = ["Preloaded", "preload_small_files", "wanted"]
