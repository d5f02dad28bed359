"""The persistent caller: one long-lived worker process per rank.

There is no fork cost per checkpoint, but ``async_fn`` must be picklable (a
module-level function); a save's tensors are copied into the caller's snapshot arena
(shared memory reused from save to save, mapped by the worker once) when the request is
scheduled (see :class:`PersistentAsyncCaller`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import multiprocessing
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  (importing it registers the shared-memory reductions)

from .. import knobs
from ..process import describe_exit, format_current_exception
from ..storage.host_staging import StagingStep
from .agreement import _CallStatus, _global_rank, _State
from .caller import AsyncCaller
from .request import AsyncRequest
from .snapshot import ArenaPickler, SnapshotArena
from .worker import ForkedProcess, FrameReader, worker_command, write_frame

logger = logging.getLogger(__name__)


class PersistentAsyncCaller(AsyncCaller):
    """Runs requests in one long-lived worker process per rank.

    The worker (:mod:`.worker`) is started on the first request, reused by every
    later one (no process start per checkpoint), restarted on the next request if
    it died, and stopped by :meth:`close`. It is forked from the trainer (ready in
    milliseconds) or, with ``DIST_CKPT_ASYNC_WORKER_FORK=0``, a fresh interpreter
    that imports this package; either way it never runs the script's ``__main__``
    again (a training script needs no ``if __name__ == "__main__":`` guard) and
    never touches CUDA. Starting it does not block the caller:
    requests wait in its pipe until it is ready, and one that is not ready within
    ``DIST_CKPT_ASYNC_WORKER_START_TIMEOUT_S`` fails the calls it holds. Requests
    run in the worker one at a time, in scheduling order; several may be pending.

    Requests travel to the worker pickled with torch.multiprocessing's pickler
    (:class:`~.snapshot.ArenaPickler`):

    - ``async_fn`` must be picklable, i.e. a module-level function of an
      importable module (no lambda, no local function, nothing defined in
      ``__main__``); otherwise the request fails at finalization.
    - The tensors a save writes (its staging step is a
      :class:`~dist_checkpointing.engine.storage.host_staging.StagingStep`) are
      copied, when the request is scheduled, into the caller's
      :class:`~.snapshot.SnapshotArena`: shared memory (pinned when CUDA is
      available) that is reused by later saves and that the worker maps once.
      Accelerator tensors are always copied (device to host, the blocking part);
      CPU tensors too, so that the checkpoint holds the values at scheduling time
      even if training updates the tensors in place right after (the temporal
      caller gets the same guarantee from fork's copy-on-write). The copy costs a
      memcpy (~0.25 s for 512 MB here) while the caller is blocked, and the arena
      holds one snapshot per save in flight, between saves too.
      With ``snapshot_cpu_tensors=False`` CPU tensors are not copied: they are
      moved into shared memory and the worker reads them live, so the caller must
      not modify them until the call is finalized. With the default
      ``file_descriptor`` sharing strategy each shared storage holds a file
      descriptor until the call ends, so prefer few large tensors.
    - Other CPU tensors in the arguments are copied into fresh shared memory
      (unless ``snapshot_cpu_tensors=False``); other arguments are pickled.

    Call sequence: see :class:`AsyncCaller`. A result pipe carries each call's
    outcome (``None`` or the traceback text) back; a worker that dies fails all
    calls it held, naming its exit code or signal.
    """

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, snapshot_cpu_tensors: bool = True
    ) -> None:
        super().__init__(process_group)
        self.snapshot_cpu_tensors = snapshot_cpu_tensors
        self.arena = SnapshotArena()
        self._sent: set[str] = set()  # arena segments the current worker has mapped
        self._leases: dict[int, str | None] = {}  # ticket -> arena segment it uses
        self.process: _Worker | None = None
        self._exit_hook: Callable[[], None] | None = None
        self._next_ticket = 0
        # Calls in scheduling order: (ticket, call_idx), and what is known of them.
        self._pending: deque[tuple[int, int]] = deque()
        self._known: dict[int, _CallStatus] = {}

    @property
    def worker_pid(self) -> int | None:
        """Process id of the current worker, or None if none is running."""
        return self.process.pid if self.process is not None else None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Stage ``async_req`` here, then hand it to the worker (started if needed)."""
        ticket = self._next_ticket
        self._next_ticket += 1
        call_idx = async_req.call_idx
        self._pending.append((ticket, call_idx))
        try:
            args = self._stage(ticket, async_req)
        except Exception:
            self._fail(ticket, call_idx, format_current_exception("preload_fn raised"))
            return
        if async_req.async_fn is None:
            self._known[ticket] = _CallStatus(call_idx, _State.DONE)
            return
        if getattr(async_req.async_fn, "__module__", None) == "__main__":
            self._fail(
                ticket,
                call_idx,
                f"async_fn {async_req.async_fn!r} is defined in the script's __main__, which "
                "the persistent worker does not run: move it to an importable module (or use "
                "persistent=False)",
            )
            return
        try:
            self._ensure_worker()  # first: a new worker has mapped no arena segment yet
            assert self.process is not None
        except Exception:
            self._fail(
                ticket, call_idx, format_current_exception("could not reach the persistent worker")
            )
            return
        try:
            # Pickled here, not in the queue's feeder thread, so that what the
            # worker receives is fixed when this call returns.
            payload, delivered = ArenaPickler.request_bytes(
                (async_req.async_fn, args, async_req.async_fn_kwargs),
                self.arena,
                self._sent,
                self.snapshot_cpu_tensors,
            )
        except Exception:
            self._fail(
                ticket,
                call_idx,
                format_current_exception(
                    "could not pickle the request for the persistent worker (async_fn and its "
                    "arguments must be picklable; use a module-level function)"
                ),
            )
            return
        try:
            self.process.send_request(ticket, payload)
        except Exception:
            self._fail(
                ticket, call_idx, format_current_exception("could not reach the persistent worker")
            )
            return
        delivered()
        logger.debug(
            "rank %d: call %d sent to worker %d",
            _global_rank(),
            call_idx,
            self.process.pid if self.process is not None else -1,
        )

    def _stage(self, ticket: int, async_req: AsyncRequest) -> tuple[Any, ...]:
        """Run the request's staging step: a save's tensors go into the arena."""
        stage = async_req.preload_fn
        if not isinstance(stage, StagingStep):
            return async_req.staged_args()
        self._leases[ticket] = self.arena.stage(stage, self.snapshot_cpu_tensors)
        return async_req.staged_args(stage.result())

    def _fail(self, ticket: int, call_idx: int, error: str) -> None:
        logger.error("rank %d: async call %d failed: %s", _global_rank(), call_idx, error)
        self._known[ticket] = _CallStatus(call_idx, _State.FAILED, error)

    def start_worker(self) -> None:
        """Start the worker now (if none is running), without waiting for it to be
        ready, so that the first request does not wait for its start-up."""
        self._ensure_worker()

    def _ensure_worker(self) -> None:
        self._check_worker()
        if self.process is None:
            self._sent.clear()  # a new worker has mapped nothing
            self.arena.retired.clear()
            self.process = _Worker.start()
            # Best effort for a caller that never calls close(): at interpreter exit
            # let the worker finish what it holds and stop.
            self._exit_hook = functools.partial(self.process.stop, False)
            atexit.register(self._exit_hook)
            logger.debug("rank %d: persistent worker %d started", _global_rank(), self.process.pid)

    def _drain_results(self) -> None:
        if self.process is None:
            return
        for frame in self.process.read_frames():
            ticket, error = frame[1], frame[2]
            call_idx = next((idx for t, idx in self._pending if t == ticket), None)
            if call_idx is None:
                continue  # a call already settled as failed by another rank
            state = _State.DONE if error is None else _State.FAILED
            self._known[ticket] = _CallStatus(call_idx, state, error)

    def _check_worker(self) -> None:
        """Collect results; if the worker died or did not start in time, fail every
        call it still held and let the next request start a fresh one."""
        if self.process is None:
            return
        exitcode = self.process.poll()
        self._drain_results()  # after the liveness check: catches results sent before death
        cause = self.process.failure(exitcode)
        if cause is None:
            return
        for ticket, call_idx in self._pending:
            if ticket in self.process.tickets and ticket not in self._known:
                self._fail(ticket, call_idx, f"{cause} (call {call_idx} was pending)")
        self._release_worker(abort=True)

    def _current_status(self, blocking: bool) -> _CallStatus:
        if not self._pending:
            return _CallStatus(0, _State.DONE)
        ticket, call_idx = self._pending[0]
        while True:
            if ticket not in self._known:
                self._check_worker()
            if ticket in self._known:
                return self._known[ticket]
            if not blocking:
                return _CallStatus(call_idx, _State.RUNNING)
            time.sleep(knobs.ASYNC_POLL_INTERVAL_S.get())

    def _forget_current(self) -> None:
        if self._pending:
            ticket, _ = self._pending.popleft()
            self._known.pop(ticket, None)
            self.arena.release(self._leases.pop(ticket, None))

    def _release_worker(self, abort: bool) -> None:
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        if self.process is not None:
            self.process.stop(abort)
        self.process = None

    def close(self, abort: bool = False) -> None:
        """Stop the worker after it finished the requests it holds (``abort``: kill
        it now). Calls not finalized yet are forgotten. Idempotent."""
        if self.process is not None and abort:
            logger.warning(
                "rank %d: killing persistent worker %d",
                _global_rank(),
                self.process.pid,
            )
        self._release_worker(abort)
        self._pending.clear()
        self._known.clear()
        self._leases.clear()
        self.arena.close()  # the worker is gone: nothing maps the segments any more


_FEEDER_EXIT = object()
# After the worker exited, its feeder's last write fails at once, unless a child of
# the worker still holds the pipe open; then the pipe is left to the garbage collector.
_FEEDER_JOIN_TIMEOUT_S = 1.0


class _ProcessHandle(Protocol):
    """What :class:`_Worker` needs of its process: a ``subprocess.Popen`` or a
    :class:`~.worker.ForkedProcess`."""

    pid: int

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class _Worker:
    """The parent's handle on one persistent worker (:mod:`.worker`): its process,
    the pipe that carries requests and the one that carries results back."""

    def __init__(self, proc: _ProcessHandle, requests_fd: int, results_fd: int) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.requests_fd = requests_fd
        self.results = FrameReader(results_fd)
        self.started = time.monotonic()
        self._started_wall = time.time()  # the worker reports when it was ready by this clock
        self.ready_after_s: float | None = None
        self.start_error: str | None = None
        self.outstanding = 0  # requests sent, results not received yet
        self.tickets: set[int] = set()  # every request sent to this worker
        # Frames go out through a feeder thread, in order: a sender never waits for
        # the worker to read (it reads only once ready, and a payload may exceed the
        # pipe's buffer), so a worker that never starts cannot block the trainer.
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._feeder = threading.Thread(
            target=self._feed, name=f"dist-ckpt-worker-{self.pid}-feeder", daemon=True
        )
        self._feeder.start()

    @classmethod
    def start(cls) -> _Worker:
        """Start a worker (without waiting for it to be ready) and send it its setup:
        forked from this process, or a fresh interpreter (knob ``ASYNC_WORKER_FORK``)."""
        req_read, req_write = os.pipe()
        res_read, res_write = os.pipe()
        proc: _ProcessHandle
        try:
            if knobs.ASYNC_WORKER_FORK.get() and hasattr(os, "fork"):
                proc = ForkedProcess(req_read, res_write, parent_ends=(req_write, res_read))
            else:
                proc = subprocess.Popen(
                    worker_command(req_read, res_write),
                    pass_fds=(req_read, res_write),
                    stdin=subprocess.DEVNULL,
                )
        except BaseException:
            for fd in (req_write, res_read):
                os.close(fd)
            raise
        finally:
            os.close(req_read)  # the child holds its own copies
            os.close(res_write)
        worker = cls(proc, req_write, res_read)
        authkey = bytes(multiprocessing.current_process().authkey)
        worker.send((list(sys.path), authkey, os.getpid(), logger.getEffectiveLevel()))
        return worker

    def send(self, item: Any) -> None:
        self._outbox.put(item)

    def _feed(self) -> None:
        while True:
            item = self._outbox.get()
            if item is _FEEDER_EXIT:
                return
            try:
                write_frame(self.requests_fd, item)
            except OSError:  # the worker is gone: poll() tells the caller
                return

    def send_request(self, ticket: int, payload: bytes) -> None:
        self.send((ticket, payload))
        self.outstanding += 1
        self.tickets.add(ticket)

    def poll(self) -> int | None:
        return self.proc.poll()

    def read_frames(self) -> list[Any]:
        """The results received so far; start-up frames are consumed here."""
        results = []
        for frame in self.results.read_available():
            if frame[0] == "ready":
                self.ready_after_s = frame[1] - self._started_wall
                logger.debug("persistent worker %d ready after %.3fs", self.pid, self.ready_after_s)
            elif frame[0] == "start-failed":
                self.start_error = frame[1]
            else:
                self.outstanding -= 1
                results.append(frame)
        return results

    def failure(self, exitcode: int | None) -> str | None:
        """Why this worker can no longer run requests, or None if it still can."""
        name = f"persistent worker (pid {self.pid})"
        if exitcode is not None:
            when = "" if self.ready_after_s is not None else " before it was ready"
            detail = f":\n{self.start_error}" if self.start_error else ""
            return f"{name} {describe_exit(exitcode)}{when}{detail}"
        timeout = knobs.ASYNC_WORKER_START_TIMEOUT_S.get()
        if self.ready_after_s is None and time.monotonic() - self.started > timeout:
            return (
                f"{name} did not start within {timeout:g}s (set "
                f"{knobs.ASYNC_WORKER_START_TIMEOUT_S.env_var} to wait longer; its stderr "
                "may say why)"
            )
        return None

    def stop(self, abort: bool) -> None:
        """Ask the worker to finish what it holds and exit (``abort``: kill it now);
        kill it if it does not stop within the join timeout. One still starting up
        with nothing to do is killed at once (close() need not wait for its imports)."""
        self.read_frames()
        if not self.outstanding and self.ready_after_s is None:
            abort = True
        if not abort and self.proc.poll() is None:
            self.send(None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(knobs.ASYNC_WORKER_JOIN_TIMEOUT_S.get())
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._outbox.put(_FEEDER_EXIT)
        self._feeder.join(_FEEDER_JOIN_TIMEOUT_S)  # its writes now fail or complete
        fds = [self.results.fd] + ([] if self._feeder.is_alive() else [self.requests_fd])
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
