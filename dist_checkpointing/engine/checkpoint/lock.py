"""The save lock: one save at a time in a checkpoint directory.

The coordinator of a save creates ``.save.lock`` exclusively (``O_EXCL``, which
is atomic on local and NFS filesystems) before anything is written, and removes
it after the commit or a failure. A second job that finds it gets
:class:`~dist_checkpointing.errors.ConcurrentSaveError` on every rank. A lock
left by a save that died is stale when its process is gone (same host) or when
it is older than the ``SAVE_LOCK_STALE_S`` knob (another host); a stale lock is
taken over.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass
from typing import Any

from ...errors import ConcurrentSaveError
from .. import knobs
from ..storage.location import CheckpointDir

logger = logging.getLogger(__name__)

LOCK_NAME = ".save.lock"

# Saves of this process that may still commit, by save id: a lock of this process
# whose save is gone (failed, and its request dropped) is stale.
_LIVE: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class LockInfo:
    """Who holds the lock."""

    save_id: str
    host: str
    pid: int
    since: float

    def to_bytes(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def parse(cls, data: bytes) -> LockInfo | None:
        try:
            raw = json.loads(data[:4096])
            return cls(str(raw["save_id"]), str(raw["host"]), int(raw["pid"]), float(raw["since"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        age = time.time() - self.since
        return f"save {self.save_id} by pid {self.pid} on {self.host}, started {age:.0f}s ago"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_stale(info: LockInfo | None) -> bool:
    if info is None:
        return True  # unreadable: written by a save that died mid-write
    if info.host == socket.gethostname():
        if info.pid == os.getpid():
            return info.save_id not in _LIVE
        return not _pid_alive(info.pid)
    return time.time() - info.since > knobs.SAVE_LOCK_STALE_S.get()


def _holder(ckpt: CheckpointDir) -> LockInfo | None:
    try:
        with ckpt.fs.open_read(ckpt.fs.join(ckpt.root, LOCK_NAME)) as stream:
            return LockInfo.parse(stream.read(4096))
    except FileNotFoundError:
        return None


def acquire(ckpt: CheckpointDir, save_id: str, owner: Any) -> None:
    """Take the lock for ``save_id`` (coordinator only); the lock counts as live
    while ``owner`` (the save's session) exists.

    Raises:
        ConcurrentSaveError: another live save holds it (the message names it).
    """
    mine = LockInfo(save_id, socket.gethostname(), os.getpid(), time.time())
    path = ckpt.fs.join(ckpt.root, LOCK_NAME)
    for _ in range(2):
        if ckpt.fs.create_exclusive(path, mine.to_bytes()):
            _LIVE[save_id] = owner
            return
        holder = _holder(ckpt)
        if not _is_stale(holder):
            assert holder is not None
            raise ConcurrentSaveError(
                f"{ckpt}: another save is writing this checkpoint directory "
                f"({holder.describe()}); this save was not started. If no such save is "
                f"running, delete {path}"
            )
        logger.warning(
            "%s: taking over the stale save lock (%s)",
            ckpt,
            holder.describe() if holder else "unreadable",
        )
        with contextlib.suppress(FileNotFoundError):
            ckpt.fs.remove(path)
    raise ConcurrentSaveError(f"{ckpt}: could not take the save lock {path}")


def release(ckpt: CheckpointDir, save_id: str) -> None:
    """Remove the lock if ``save_id`` holds it (coordinator only; never raises)."""
    _LIVE.pop(save_id, None)
    try:
        holder = _holder(ckpt)
        if holder is not None and holder.save_id == save_id:
            ckpt.fs.remove(ckpt.fs.join(ckpt.root, LOCK_NAME))
    except OSError as exc:
        logger.warning("%s: could not release the save lock: %s", ckpt, exc)


__all__ = ["LOCK_NAME", "LockInfo", "acquire", "release"]
