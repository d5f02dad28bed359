"""How a write function hands its outcome back to the process that waits for it.

:class:`ResultsQueue` is what the write functions need (a queue-like ``put``/``get``);
:class:`FileResultsQueue` is the default one: a one-shot channel through a private
temporary file, which works from threads, forked and spawned processes alike.
"""

from __future__ import annotations

import os
import pickle
import queue
import shutil
import tempfile
import weakref
from typing import Any, Protocol


class ResultsQueue(Protocol):
    """What the write function needs to hand its outcome back (a queue-like object)."""

    def put(self, obj: Any) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...


class FileResultsQueue:
    """A one-shot results channel backed by a private temporary file.

    ``put`` (any process, once) writes the pickled object atomically; ``get`` (the
    creating process) reads and deletes it. Unlike a ``multiprocessing.Queue`` it
    never blocks the producer (a process holding unread queue data cannot exit),
    needs no manager process, and pickles as its path, so it reaches forked and
    spawned workers alike. :meth:`close` removes the directory.
    """

    def __init__(self, rank: int) -> None:
        self.directory = tempfile.mkdtemp(prefix=f"dist_ckpt_results_r{rank}_")
        self.path = os.path.join(self.directory, "outcome.pkl")
        # Removed when this (the creating process's) object goes away, also when the
        # save failed and nobody called close(); copies in workers do not remove it.
        self._cleanup: weakref.finalize[Any, Any] | None = weakref.finalize(
            self, shutil.rmtree, self.directory, True
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._cleanup = None

    def put(self, obj: Any) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, self.path)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Return the object put, waiting up to ``timeout`` seconds; ``queue.Empty`` if none."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while not os.path.exists(self.path):
            if not block or (deadline is not None and time.monotonic() >= deadline):
                raise queue.Empty
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        with open(self.path, "rb") as f:
            obj = pickle.load(f)  # our own file in a private (0700) directory
        os.remove(self.path)
        return obj

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup()
        else:
            shutil.rmtree(self.directory, ignore_errors=True)


__all__ = ["FileResultsQueue", "ResultsQueue"]
