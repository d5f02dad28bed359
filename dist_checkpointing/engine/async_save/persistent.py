"""The persistent caller: one long-lived worker process per rank.

There is no fork cost per checkpoint, but ``async_fn`` must be picklable (a
module-level function); CPU tensors of the arguments are copied into shared memory
when the request is scheduled (see :class:`PersistentAsyncCaller`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import logging
import os
import pickle
import queue
import signal
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp  # importing it registers the shared-memory reductions
from torch.multiprocessing.reductions import reduce_tensor

from ..._torch_compat import new_shared_tensor_like
from .. import knobs
from ..process import describe_exit, format_current_exception
from .agreement import _CallStatus, _global_rank, _State
from .caller import AsyncCaller
from .request import AsyncRequest

logger = logging.getLogger(__name__)


class _SnapshotPickler(ForkingPickler):
    """torch.multiprocessing's pickler, but CPU tensors are copied (once, straight
    into shared memory) before they are shared, so the receiver sees their values
    at pickling time."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            isinstance(obj, torch.Tensor)
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
        ):
            snapshot = new_shared_tensor_like(obj)
            snapshot.copy_(obj.detach())
            return reduce_tensor(snapshot)
        return NotImplemented

    @classmethod
    def dumps(cls, obj: Any, protocol: int | None = None) -> bytes:  # type: ignore[override]
        buf = io.BytesIO()
        cls(buf, protocol).dump(obj)
        return buf.getvalue()


class PersistentAsyncCaller(AsyncCaller):
    """Runs requests in one long-lived worker process per rank.

    The worker is started (``spawn``) on the first request, reused by every later
    one (no process start per checkpoint), restarted on the next request if it
    died, and stopped by :meth:`close`. Requests run in the worker one at a time,
    in scheduling order; several may be pending.

    Requests travel to the worker pickled with torch.multiprocessing's pickler:

    - ``async_fn`` must be picklable, i.e. a module-level function (no lambda,
      no local function); otherwise the request fails at finalization.
    - CPU tensors in the arguments are *copied* into shared memory when the
      request is scheduled, and the worker maps that copy: the checkpoint holds
      the values at scheduling time even if training updates the tensors in
      place right after (the temporal caller gets the same guarantee from
      fork's copy-on-write, for free). The copy costs a memcpy into fresh
      shared memory (~0.25 s for 512 MB here) while the caller is blocked.
      With ``snapshot_cpu_tensors=False`` the tensors themselves are moved into
      shared memory and the worker reads them live: no copy, but the caller must
      not modify them until the call is finalized (fine for accelerator state,
      whose staged host copies are private to the request). With the default
      ``file_descriptor`` sharing strategy each shared storage holds a file
      descriptor until the call ends, so prefer few large tensors.
    - Other arguments (bytes, numpy arrays, ...) are copied.

    Call sequence: see :class:`AsyncCaller`. A result queue carries each call's
    outcome (``None`` or the traceback text) back; a worker that dies fails all
    calls it held, naming its exit code or signal.
    """

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, snapshot_cpu_tensors: bool = True
    ) -> None:
        super().__init__(process_group)
        self.snapshot_cpu_tensors = snapshot_cpu_tensors
        self._ctx = torch_mp.get_context("spawn")
        self.process: Any = None
        self._requests: Any = None  # ctx.Queue of (ticket, payload) or None (stop)
        self._results: Any = None  # ctx.Queue of (ticket, error text or None)
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
            args = async_req.staged_args()
        except Exception:
            self._fail(ticket, call_idx, format_current_exception("preload_fn raised"))
            return
        if async_req.async_fn is None:
            self._known[ticket] = _CallStatus(call_idx, _State.DONE)
            return
        try:
            # Pickled here, not in the queue's feeder thread, so that what the
            # worker receives is fixed when this call returns.
            pickler = _SnapshotPickler if self.snapshot_cpu_tensors else ForkingPickler
            payload = bytes(pickler.dumps((async_req.async_fn, args, async_req.async_fn_kwargs)))
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
            self._ensure_worker()
            self._requests.put((ticket, payload))
        except Exception:
            self._fail(
                ticket, call_idx, format_current_exception("could not reach the persistent worker")
            )
            return
        logger.debug(
            "rank %d: call %d sent to worker %d",
            _global_rank(),
            call_idx,
            self.process.pid,
        )

    def _fail(self, ticket: int, call_idx: int, error: str) -> None:
        logger.error("rank %d: async call %d failed: %s", _global_rank(), call_idx, error)
        self._known[ticket] = _CallStatus(call_idx, _State.FAILED, error)

    def _ensure_worker(self) -> None:
        self._check_worker()
        if self.process is not None:
            return
        self._requests = self._ctx.Queue()
        self._results = self._ctx.Queue()
        self.process = self._ctx.Process(
            target=_persistent_worker_main,
            args=(
                self._requests,
                self._results,
                os.getpid(),
                logger.getEffectiveLevel(),
            ),
            name=f"dist-ckpt-async-worker-rank{_global_rank()}",
        )
        self.process.start()
        # Best effort for a caller that never calls close(): at interpreter exit
        # let the worker finish what it holds and stop. Registered after
        # multiprocessing's own exit hook, so it runs first (atexit is LIFO) and
        # that hook's join of non-daemonic children does not wait forever.
        self._exit_hook = functools.partial(
            _stop_worker, self.process, self._requests, self._results, False
        )
        atexit.register(self._exit_hook)
        logger.debug("rank %d: persistent worker %d started", _global_rank(), self.process.pid)

    def _drain_results(self) -> None:
        while True:
            try:
                ticket, error = self._results.get_nowait()
            except queue.Empty:
                return
            call_idx = next((idx for t, idx in self._pending if t == ticket), -1)
            state = _State.DONE if error is None else _State.FAILED
            self._known[ticket] = _CallStatus(call_idx, state, error)

    def _check_worker(self) -> None:
        """Collect results; if the worker died, fail every call it still held."""
        if self.process is None:
            return
        alive = self.process.is_alive()
        self._drain_results()  # after the liveness check: catches results sent before death
        if alive:
            return
        cause = f"persistent worker (pid {self.process.pid}) {describe_exit(self.process.exitcode)}"
        for ticket, call_idx in self._pending:
            if ticket not in self._known:
                self._fail(ticket, call_idx, f"{cause} while call {call_idx} was pending")
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

    def _release_worker(self, abort: bool) -> None:
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        if self.process is not None:
            _stop_worker(self.process, self._requests, self._results, abort)
        self.process = self._requests = self._results = None

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


def _stop_worker(process: Any, requests: Any, results: Any, abort: bool) -> None:
    """Stop a persistent worker: ask it to finish and exit, kill it if it will not."""
    if process.is_alive() and not abort:
        with contextlib.suppress(OSError, ValueError):  # queue already closed or broken
            requests.put(None)
        process.join(knobs.ASYNC_WORKER_JOIN_TIMEOUT_S.get())
    if process.is_alive():
        process.kill()
    process.join()
    for q in (requests, results):
        q.close()
        q.cancel_join_thread()  # whatever is still buffered has no reader any more


def _persistent_worker_main(requests: Any, results: Any, parent_pid: int, log_level: int) -> None:
    """Entry point of the persistent worker: run requests until told to stop."""
    logging.getLogger(__name__).setLevel(log_level)
    # Ctrl-C reaches the whole process group; the trainer decides what happens,
    # and the worker finishes what it holds instead of dying mid-write.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            item = requests.get(timeout=knobs.ASYNC_WORKER_IDLE_CHECK_S.get())
        except queue.Empty:
            if os.getppid() != parent_pid:  # orphaned: nobody will collect results
                return
            continue
        if item is None:
            return
        ticket, payload = item
        results.put((ticket, _run_payload(payload)))


def _run_payload(payload: bytes) -> str | None:
    """Unpickle and run one request; return None on success, else the error text."""
    try:
        async_fn, args, kwargs = pickle.loads(payload)
    except BaseException:
        return format_current_exception("persistent worker could not unpickle the request")
    try:
        async_fn(*args, **kwargs)
    except BaseException:  # sys.exit() in async_fn must not end the worker silently
        return format_current_exception("async_fn raised")
    return None
