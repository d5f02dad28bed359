"""A checkpoint manager for training loops: step directories, a ``latest`` pointer,
sync or async saves, and retention that never deletes the wrong checkpoint.

Layout under ``root`` (Megatron-LM's)::

    root/iter_0000100/                       one checkpoint per step
    root/latest_checkpointed_iteration.txt   the ``latest`` pointer: "100"

Guarantees:

- the pointer moves (atomically, durably) only after the save is committed on
  every rank (after :func:`dist_checkpointing.save`'s commit barrier, or, for
  an async save, in a finalize function that runs after the commit);
- :meth:`steps` and :meth:`latest` list only complete checkpoints (a directory
  without the commit marker is skipped with a warning, unless this manager is
  still writing it);
- retention runs after a save is committed and deletes only complete
  checkpoints older than it, never one in flight or being loaded; a deleted
  checkpoint loses its commit marker first, so a deletion cut short leaves a
  directory that no longer looks complete.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from .engine.checkpoint.commit import COMMIT_MARKER
from .engine.collectives import ProcessGroup, RankGroup
from .engine.storage.location import CheckpointDir
from .errors import CheckpointNotFoundError, InvalidArgumentError
from .mapping import ShardedStateDict, StateDict
from .serialization import load, save
from .strategies.async_utils import AsyncCallsQueue

logger = logging.getLogger(__name__)

LATEST_FNAME = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"iter_(\d+)$")

__all__ = ["LATEST_FNAME", "CheckpointManager"]


class CheckpointManager:
    """Save, find, load and prune the checkpoints of one training run.

    Every rank of ``process_group`` creates the manager and calls :meth:`save`,
    :meth:`load`, :meth:`maybe_finalize` and :meth:`close` together.

    Args:
        root: the directory that holds the step directories (created if missing).
        keep_last: keep the newest ``keep_last`` complete checkpoints (None: all).
        keep_every: also keep every checkpoint whose step is a multiple of it.
        async_save: save in the background through an :class:`AsyncCallsQueue`;
            call :meth:`maybe_finalize` now and then (e.g. every step).
        persistent: use one long-lived writer process per rank (async only).
        process_group: the ranks that save together (default: the world).

    Example::

        manager = CheckpointManager("/ckpts", keep_last=2, keep_every=1000)
        start = manager.latest()
        if start is not None:
            state = manager.load(model_sharded_sd, start)
        for step in range(start or 0, steps):
            ...
            manager.maybe_finalize()
            if step % 100 == 0:
                manager.save(model_sharded_sd, step)
        manager.close()
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep_last: int | None = None,
        keep_every: int | None = None,
        *,
        async_save: bool = False,
        persistent: bool = False,
        process_group: ProcessGroup = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise InvalidArgumentError(f"keep_last must be at least 1, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise InvalidArgumentError(f"keep_every must be at least 1, got {keep_every}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.process_group = process_group
        self.group = RankGroup(process_group)
        self.queue = AsyncCallsQueue(persistent, process_group) if async_save else None
        self._in_flight: set[int] = set()
        self._loading: set[int] = set()
        self.root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ naming

    def path(self, step: int) -> Path:
        """The directory of ``step`` (``iter_0000100``)."""
        if step < 0:
            raise InvalidArgumentError(f"step must be non-negative, got {step}")
        return self.root / f"iter_{step:07d}"

    @staticmethod
    def is_complete(path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` holds a committed checkpoint (its commit marker exists)."""
        return (Path(path) / COMMIT_MARKER).is_file()

    def steps(self) -> list[int]:
        """The steps with a complete checkpoint, oldest first.

        A step directory without the commit marker is skipped with a warning
        (an interrupted save), unless this manager is writing it right now.
        """
        found = []
        for entry in sorted(os.listdir(self.root)):
            match = _STEP_DIR.match(entry)
            if match is None or not (self.root / entry).is_dir():
                continue
            step = int(match.group(1))
            if self.is_complete(self.root / entry):
                found.append(step)
            elif step not in self._in_flight:
                warnings.warn(
                    f"{self.root / entry}: skipping an incomplete checkpoint (no "
                    f"{COMMIT_MARKER}: its save was interrupted)",
                    stacklevel=2,
                )
        return sorted(found)

    def latest(self) -> int | None:
        """The newest complete step, or None when there is none.

        The pointer file is what other tools read; a pointer naming a checkpoint
        that is not complete (edited, or its directory removed) is ignored with a
        warning and the newest complete step is returned.
        """
        steps = self.steps()
        pointer = self.read_pointer()
        if pointer is not None and pointer not in steps:
            warnings.warn(
                f"{self.root / LATEST_FNAME} names step {pointer}, which has no complete "
                "checkpoint; using the newest complete one",
                stacklevel=2,
            )
        return steps[-1] if steps else None

    def read_pointer(self) -> int | None:
        """The step in the ``latest`` pointer file, or None (missing or unreadable)."""
        try:
            return int((self.root / LATEST_FNAME).read_text().strip())
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------------ save

    def save(self, sharded_state_dict: ShardedStateDict, step: int, **save_kwargs: Any) -> None:
        """Save ``sharded_state_dict`` as ``step`` (collective).

        Synchronous: returns once the checkpoint is committed, the pointer moved
        and retention applied. Async: returns after staging; all of that happens
        in :meth:`maybe_finalize` once every rank has written.
        """
        path = self.path(step)
        if step in self._in_flight:
            raise InvalidArgumentError(f"step {step} is already being saved")
        path.mkdir(exist_ok=True)
        self.group.barrier()  # every rank sees the directory before anyone writes
        self._in_flight.add(step)
        kwargs = dict(save_kwargs, process_group=self.process_group)
        if self.queue is None:
            try:
                save(sharded_state_dict, path, **kwargs)
            finally:
                self._in_flight.discard(step)
            self._committed(step)
            return
        try:
            request = save(sharded_state_dict, path, async_sharded_save=True, **kwargs)
            assert request is not None
            request.add_finalize_fn(lambda: self._committed(step))
            # A failed save (any rank) can be retried: the step is no longer in flight.
            request.add_abort_fn(lambda: self._in_flight.discard(step))
            self.queue.schedule_async_request(request)
        except BaseException:
            self._in_flight.discard(step)
            raise

    def _committed(self, step: int) -> None:
        """Runs on every rank after ``step`` is committed everywhere: the coordinator
        moves the pointer and applies retention; a failure there raises on every rank."""
        self._in_flight.discard(step)
        error: BaseException | None = None
        if self.group.is_coordinator:
            try:
                current = self.read_pointer()
                if current is None or current <= step or not self.is_complete(self.path(current)):
                    CheckpointDir.of(self.root).atomic_write(LATEST_FNAME, f"{step}\n".encode())
                self._apply_retention(step)
            except Exception as exc:  # noqa: BLE001 - raised on every rank by fail_together
                error = exc
        self.group.fail_together(error, f"Pointing {self.root / LATEST_FNAME} at step {step}")
        logger.info("checkpoint %s committed", self.path(step))

    def to_delete(self, newest: int) -> list[int]:
        """The complete steps older than ``newest`` that retention removes now."""
        steps = [s for s in self.steps() if s <= newest]
        keep = set(steps if self.keep_last is None else steps[-self.keep_last :])
        if self.keep_every is not None:
            keep |= {s for s in steps if s % self.keep_every == 0}
        keep |= self._in_flight | self._loading | {newest}
        return [s for s in steps if s not in keep]

    def _apply_retention(self, newest: int) -> None:
        for step in self.to_delete(newest):
            path = self.path(step)
            logger.info("retention: removing %s", path)
            (path / COMMIT_MARKER).unlink(missing_ok=True)  # no longer looks complete
            shutil.rmtree(path, ignore_errors=True)

    def maybe_finalize(self, blocking: bool = False) -> list[int]:
        """Finalize finished async saves (collective); returns their call ids."""
        if self.queue is None:
            return []
        return self.queue.maybe_finalize_async_calls(blocking=blocking)

    def close(self) -> None:
        """Finalize every pending save and stop the writer (collective)."""
        if self.queue is not None:
            self.queue.close()

    # ------------------------------------------------------------------ load

    def load(
        self, sharded_state_dict: ShardedStateDict, step: int | None = None, **load_kwargs: Any
    ) -> StateDict | tuple[StateDict, set[str], set[str]]:
        """Load ``step`` (default: :meth:`latest`) into ``sharded_state_dict`` (collective)."""
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointNotFoundError(f"{self.root}: no complete checkpoint")
        self._loading.add(step)
        try:
            loaded = load(
                sharded_state_dict,
                self.path(step),
                process_group=self.process_group,
                **load_kwargs,
            )
        finally:
            self._loading.discard(step)
        return loaded
