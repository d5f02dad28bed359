"""The persistent writer worker: a process that never runs the user's script again.

:class:`~.persistent.PersistentAsyncCaller` starts it one of two ways, neither of
them multiprocessing's ``spawn`` (which re-imports the parent's ``__main__`` in the
child, so a training script without an ``if __name__ == "__main__":`` guard ran
again in the worker, blocked in its own ``save`` and hung the trainer in
``close()``):

- forked from the trainer (:class:`ForkedProcess`, the default where ``os.fork``
  exists, knob ``ASYNC_WORKER_FORK``): ready in milliseconds, since torch and this
  package are already imported; the child runs only :func:`main`, with torch set to
  one intra-op thread (as forked data-loader workers are). It never touches CUDA:
  requests carry CPU tensors in shared memory;
- a fresh interpreter (``ASYNC_WORKER_FORK=0``): ``python -c BOOTSTRAP``
  (:func:`worker_command`) through :mod:`subprocess`, whose ``__main__`` is the
  bootstrap line; it imports only this package and torch (seconds).

The two processes talk over two pipes in length-prefixed frames of pickled
tuples (:func:`write_frame`, :class:`FrameReader`):

- parent to worker: first ``(sys_path, authkey, parent_pid, log_level)``, then
  ``(ticket, payload)`` per request, ``None`` to stop;
- worker to parent: ``("ready", its clock)`` once it can run requests (or ``("start-failed",
  error text)``), then ``("result", ticket, error text or None)`` per request.

The worker takes the parent's ``authkey`` so that CPU tensors shared by file
descriptor (torch's default sharing strategy, through multiprocessing's
``resource_sharer``) reach it as they reached a ``spawn`` child; so the request
format (:class:`~.persistent._SnapshotPickler`) is unchanged.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from ..fork_memory import tensors_wiped_on_fork
from ..process import child_exitcode, format_current_exception, gc_paused

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")
# Runs as the worker's __main__ (argv: package root, requests fd, results fd).
_BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from dist_checkpointing.engine.async_save.worker import main; "
    "main(int(sys.argv[2]), int(sys.argv[3]))"
)


def worker_command(requests_fd: int, results_fd: int) -> list[str]:
    """The command line that starts a worker reading ``requests_fd``, writing ``results_fd``."""
    package_root = Path(__file__).resolve().parents[3]
    return [sys.executable, "-c", _BOOTSTRAP, str(package_root), str(requests_fd), str(results_fd)]


class ForkedProcess:
    """A worker forked from this process, with the part of :class:`subprocess.Popen`'s
    interface the parent uses (``pid``, ``poll``, ``kill``, ``wait``).

    ``parent_ends`` are the pipe ends only the parent must hold: the child closes its
    copies, so that it sees end-of-file when the parent goes away."""

    def __init__(self, requests_fd: int, results_fd: int, parent_ends: tuple[int, ...]) -> None:
        context = multiprocessing.get_context("fork")
        self._process = context.Process(
            target=_forked_main,
            args=(requests_fd, results_fd, parent_ends),
            name="dist-ckpt-persistent-worker",
        )
        with warnings.catch_warnings(), tensors_wiped_on_fork():
            # Python 3.12+ warns when a process with threads forks; the child runs
            # only :func:`main` (its own threads) and no intra-op thread pool.
            warnings.simplefilter("ignore", DeprecationWarning)
            self._process.start()
        assert self._process.pid is not None  # set by start()
        self.pid: int = self._process.pid

    def poll(self) -> int | None:
        return child_exitcode(self._process)

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired("persistent worker", timeout or 0.0)
        return code


def _forked_main(requests_fd: int, results_fd: int, parent_ends: tuple[int, ...]) -> None:
    # What the trainer left here is never collected nor traversed: a collection would
    # touch (copy) its pages and could tear down objects (CUDA state, wiped tensors:
    # see fork_memory) that only the trainer may release.
    gc.freeze()
    # The worker collects its own garbage, whether or not the trainer had the collector
    # paused when it forked (the queue starts the worker while it schedules a call).
    gc.enable()
    for fd in parent_ends:
        os.close(fd)
    import torch

    torch.set_num_threads(1)  # the worker only moves bytes; no pool inherited mid-use
    main(requests_fd, results_fd)


def write_frame(fd: int, obj: Any) -> None:
    """Pickle ``obj`` and write it to ``fd`` as one length-prefixed frame (blocking)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, size: int) -> bytes | None:
    """``size`` bytes from a blocking ``fd``; None at end of file."""
    chunks: list[bytes] = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> tuple[bool, Any]:
    """The next frame of a blocking ``fd``: ``(True, obj)``, or ``(False, None)`` at EOF."""
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return False, None
    data = _read_exact(fd, _HEADER.unpack(header)[0])
    if data is None:
        return False, None
    return True, pickle.loads(data)


class FrameReader:
    """Reads frames from a non-blocking ``fd`` without ever waiting: a frame cut
    short by a killed writer stays buffered and is never returned."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.eof = False
        self._buffer = bytearray()

    def read_available(self) -> list[Any]:
        """Every complete frame that can be read now."""
        while not self.eof:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
            self._buffer += chunk
        frames = []
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            end = _HEADER.size + size
            if len(self._buffer) < end:
                break
            frames.append(pickle.loads(bytes(self._buffer[_HEADER.size : end])))
            del self._buffer[:end]
        return frames


def main(requests_fd: int, results_fd: int) -> None:
    """Entry point of the worker: set up like the parent, report ready, run requests."""
    # Ctrl-C reaches the whole process group; the trainer decides what happens,
    # and the worker finishes what it holds instead of dying mid-write.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ok, init = read_frame(requests_fd)
        if not ok:
            return  # the parent went away before sending anything
        sys_path, authkey, parent_pid, log_level = init
        # The parent's path first (async_fn's module must import as it did there).
        sys.path[:] = list(sys_path) + [p for p in sys.path if p not in sys_path]
        multiprocessing.current_process().authkey = authkey
        logging.getLogger("dist_checkpointing").setLevel(log_level)
        import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)
    except BaseException:
        write_frame(results_fd, ("start-failed", format_current_exception("worker start-up")))
        raise
    write_frame(results_fd, ("ready", time.time()))
    _serve(requests_fd, results_fd, parent_pid)


def _serve(requests_fd: int, results_fd: int, parent_pid: int) -> None:
    from .. import knobs

    # A reader thread drains the requests pipe while a request runs, so the
    # parent's writes never wait for the worker to finish a checkpoint.
    inbox: queue.Queue[Any] = queue.Queue()
    threading.Thread(target=_receive, args=(requests_fd, inbox), daemon=True).start()
    while True:
        try:
            item = inbox.get(timeout=knobs.ASYNC_WORKER_IDLE_CHECK_S.get())
        except queue.Empty:
            if os.getppid() != parent_pid:  # orphaned: nobody will collect results
                return
            continue
        if item is None:  # stop, or the parent closed the pipe
            return
        ticket, payload = item
        write_frame(results_fd, ("result", ticket, run_payload(payload)))


def _receive(fd: int, inbox: queue.Queue[Any]) -> None:
    while True:
        ok, item = read_frame(fd)
        inbox.put(item if ok else None)
        if not ok or item is None:
            return


def run_payload(payload: bytes) -> str | None:
    """Unpickle and run one request; return None on success, else the error text.

    The collector is paused meanwhile: the request holds objects per tensor (its plan),
    and collections over them while it is unpickled and written only delay the write.
    """
    with gc_paused():
        try:
            async_fn, args, kwargs = pickle.loads(payload)
        except BaseException:
            return format_current_exception(
                "persistent worker could not unpickle the request (the worker does not run "
                "the script's __main__: async_fn and the classes of its arguments must come "
                "from importable modules)"
            )
        try:
            async_fn(*args, **kwargs)
        except BaseException:  # sys.exit() in async_fn must not end the worker silently
            return format_current_exception("async_fn raised")
        finally:
            del args, kwargs  # freed before the collector resumes
        return None
