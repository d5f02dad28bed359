"""Running checkpoint writes in the background and finalizing them on every rank.

A save is split into a short blocking part (staging: copy tensors off the
accelerator) and a long part (writing files) that runs in another process while
training goes on. :class:`AsyncRequest` describes one such save,
:class:`AsyncCallsQueue` runs requests and later finalizes them (for example
writes the checkpoint metadata) once *every* rank has finished writing.

Two kinds of background process (:class:`AsyncCaller`) are available:

- :class:`TemporalAsyncCaller` forks a fresh process per request. Arguments need
  not be picklable, and the child sees a copy-on-write snapshot of the caller's
  memory taken when the request is scheduled.
- :class:`PersistentAsyncCaller` keeps one long-lived worker process per rank and
  ships each request to it by pickling. There is no fork cost per checkpoint,
  but ``async_fn`` must be picklable (a module-level function) and CPU tensors in
  the arguments are *shared* with the worker, not copied (see its docstring).

Failures never hang: a request whose ``async_fn`` raised, or whose process died,
becomes a :class:`~dist_checkpointing.errors.CheckpointWriteError` raised on every
rank of the process group by :meth:`AsyncCallsQueue.maybe_finalize_async_calls`,
and the finalize functions of that request are not run.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import io
import logging
import os
import pickle
import queue
import signal
import time
import traceback
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp  # importing it registers the shared-memory reductions
from torch.multiprocessing.reductions import reduce_tensor

from ..._torch_compat import new_shared_tensor_like
from ...errors import CheckpointingException, CheckpointWriteError
from ..process import describe_exit

logger = logging.getLogger(__name__)

# A child's error text travels through a pipe the parent reads only after the child
# exits; keeping it below the smallest common pipe buffer (16 KiB) means the child
# can never block on that write.
_MAX_ERROR_CHARS = 8000
# How often blocking waits re-check a persistent worker's liveness. This bounds
# how long a worker killed by a signal goes unnoticed.
_POLL_INTERVAL_S = 0.05
# How often an idle persistent worker checks whether its parent is still alive.
_WORKER_IDLE_CHECK_S = 1.0
# How long close() and interpreter exit wait for a persistent worker to finish
# the requests it already holds before killing it.
_WORKER_JOIN_TIMEOUT_S = 300.0


@dataclass(frozen=True, eq=False)
class AsyncRequest:
    """One checkpoint save to run in the background and finalize afterwards.

    Args:
        async_fn: the long-running part, called as ``async_fn(*async_fn_args,
            **async_fn_kwargs)`` in a background process. ``None`` means no-op
            (the rank still takes part in finalization).
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: called in order, in the calling process, once ``async_fn``
            has finished successfully *on all ranks*.
        async_fn_kwargs: keyword arguments of ``async_fn``.
        preload_fn: the staging step (e.g. copy tensors to host memory), run in the
            calling process when the request is scheduled; it is the only blocking
            part of an async save. If it returns ``None`` it works by side effect
            on the arguments; otherwise its result replaces ``async_fn_args[1]``
            (Megatron-Core's convention, where that argument holds the write
            buckets).
        is_frozen: a frozen request accepts no more finalize functions.
        call_idx: the id given by :meth:`AsyncCallsQueue.schedule_async_request`;
            ranks check that they finalize the same call.
    """

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple[Any, ...]
    finalize_fns: list[Callable[[], Any]]
    async_fn_kwargs: dict[str, Any] = field(default_factory=dict)
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    call_idx: int = 0

    def __post_init__(self) -> None:
        if self.async_fn is not None and not callable(self.async_fn):
            raise CheckpointingException(
                f"AsyncRequest.async_fn must be callable or None, got {type(self.async_fn)!r}"
            )
        if self.preload_fn is not None and not callable(self.preload_fn):
            raise CheckpointingException(
                f"AsyncRequest.preload_fn must be callable or None, got {type(self.preload_fn)!r}"
            )
        bad = [i for i, fn in enumerate(self.finalize_fns) if not callable(fn)]
        if bad:
            raise CheckpointingException(
                f"AsyncRequest.finalize_fns must all be callable; entries {bad} are not"
            )
        # Frozen dataclass: normalising a field needs object.__setattr__.
        object.__setattr__(self, "async_fn_args", tuple(self.async_fn_args))

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Append ``fn`` to the finalize functions (run after the existing ones).

        Raises:
            CheckpointingException: if the request is frozen (already scheduled).
        """
        if self.is_frozen:
            raise CheckpointingException(
                f"cannot add finalize function {fn!r} to frozen AsyncRequest "
                f"(call {self.call_idx}): add finalize functions before scheduling it"
            )
        if not callable(fn):
            raise CheckpointingException(f"finalize function must be callable, got {type(fn)!r}")
        self.finalize_fns.append(fn)

    def freeze(self) -> AsyncRequest:
        """Return a frozen copy of this request (with its own finalize list)."""
        return dataclasses.replace(self, is_frozen=True, finalize_fns=list(self.finalize_fns))

    def execute_sync(
        self, process_group: dist.ProcessGroup | None = None, no_dist: bool = False
    ) -> None:
        """Run the request in this process: preload, ``async_fn``, then finalize.

        This is what a synchronous save does. Unless ``no_dist`` (or
        torch.distributed is not initialized), all ranks of ``process_group``
        must call it: they agree on success before any finalize function runs,
        exactly as an async save does.

        Raises:
            CheckpointWriteError: on every rank, if staging or ``async_fn`` failed
                on any rank, or a finalize function failed on any rank.
        """
        status = _CallStatus(self.call_idx, _State.DONE)
        try:
            args = _staged_args(self)
            if self.async_fn is not None:
                self.async_fn(*args, **self.async_fn_kwargs)
        except Exception:
            status = _CallStatus(self.call_idx, _State.FAILED, _format_exc("async_fn raised"))
        _raise_on_failure(_settle(status, process_group, no_dist), "synchronous checkpoint save")
        _run_finalize_fns(self, process_group, no_dist)


# --------------------------------------------------------------------------- agreement


class _State(Enum):
    RUNNING = 0
    DONE = 1
    FAILED = 2


@dataclass(frozen=True)
class _CallStatus:
    """What one rank knows about its oldest unfinalized call."""

    call_idx: int
    state: _State
    error: str | None = None


@dataclass(frozen=True)
class _Outcome:
    """What the ranks agreed on about a call: still running, or settled with
    ``failures`` mapping each failing global rank to its cause (empty = success)."""

    call_idx: int
    running: bool
    failures: dict[int, str]


def _dist_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def _global_rank() -> int:
    return dist.get_rank() if _dist_active() else 0


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _settle(
    status: _CallStatus, group: dist.ProcessGroup | None, no_dist: bool = False
) -> _Outcome:
    """Turn one rank's view of a call into the view every rank of ``group`` shares.

    A call is settled when no rank is still running it; it failed if any rank
    failed. One small all_reduce per check; an all_gather of the error texts
    follows only when some rank failed.
    """
    local_failures = {_global_rank(): status.error or "unknown error"}
    if no_dist or not _dist_active():
        running = status.state is _State.RUNNING
        failed = status.state is _State.FAILED
        return _Outcome(status.call_idx, running, local_failures if failed else {})
    flags = torch.tensor(
        [
            int(status.state is _State.RUNNING),
            int(status.state is _State.FAILED),
            status.call_idx,
            -status.call_idx,
        ],
        dtype=torch.int64,
        device=_collective_device(group),
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    any_running, any_failed, max_idx, neg_min_idx = (int(v) for v in flags.tolist())
    if max_idx != -neg_min_idx:
        raise CheckpointingException(
            f"ranks are finalizing different async calls (call ids {-neg_min_idx}..{max_idx}, "
            f"rank {_global_rank()} has {status.call_idx}): every rank of the process group "
            "must schedule and finalize the same requests"
        )
    if any_running:
        return _Outcome(status.call_idx, True, {})
    failures: dict[int, str] = {}
    if any_failed:
        mine = (_global_rank(), status.error if status.state is _State.FAILED else None)
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        failures = {rank: error for rank, error in gathered if error is not None}
    return _Outcome(status.call_idx, False, failures)


def _raise_on_failure(outcome: _Outcome, what: str) -> None:
    if not outcome.failures:
        return
    ranks = sorted(outcome.failures)
    causes = "\n".join(f"--- rank {rank}: {outcome.failures[rank]}" for rank in ranks)
    raise CheckpointWriteError(
        f"{what} (call {outcome.call_idx}) failed on rank(s) {ranks}; its finalize "
        f"functions were not run, so no checkpoint metadata was written.\n{causes}"
    )


def _run_finalize_fns(
    request: AsyncRequest, group: dist.ProcessGroup | None, no_dist: bool
) -> None:
    """Run the finalize functions in order, then make a failure on any rank an
    error on every rank (so no rank goes on believing the checkpoint is complete)."""
    status = _CallStatus(request.call_idx, _State.DONE)
    try:
        for fn in request.finalize_fns:
            fn()
    except Exception:
        status = _CallStatus(
            request.call_idx, _State.FAILED, _format_exc("a finalize function raised")
        )
    _raise_on_failure(_settle(status, group, no_dist), "finalizing async checkpoint save")


# --------------------------------------------------------------------------- helpers


def _format_exc(prefix: str) -> str:
    return _truncate(f"{prefix}:\n{traceback.format_exc()}")


def _truncate(text: str, limit: int = _MAX_ERROR_CHARS) -> str:
    """Keep the head and the tail of a long error (the tail names the exception)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters cut ...]\n{text[-half:]}"


def _staged_args(request: AsyncRequest) -> tuple[Any, ...]:
    """Run the request's preload_fn (in this process) and return async_fn's args."""
    args = request.async_fn_args
    if request.preload_fn is None:
        return args
    staged = request.preload_fn()
    if staged is None:
        return args
    if len(args) < 2:
        raise CheckpointingException(
            f"preload_fn of call {request.call_idx} returned a value, which replaces "
            f"async_fn_args[1], but async_fn_args has only {len(args)} element(s)"
        )
    return (args[0], staged, *args[2:])


# --------------------------------------------------------------------------- callers


class AsyncCaller(ABC):
    """Runs scheduled requests in a background process and tells, collectively,
    when the oldest one is done.

    Call sequence (every rank of ``process_group`` makes every call, in the same
    order, unless ``no_dist=True``):

    1. ``schedule_async_call(request)``: stage (``preload_fn``) in the calling
       process, then start ``async_fn`` in the background. Only local work.
    2. ``is_current_async_call_done(blocking, no_dist)``, repeatedly: each rank
       checks its own oldest call, then one all_reduce makes the answer common.
       Returns ``True`` once the call finished on all ranks (the caller then
       forgets it), ``False`` while any rank still runs it; raises
       :class:`CheckpointWriteError` on every rank if it failed on any rank.
    3. ``close(abort=False)``: release the process(es). Only local work.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group

    @abstractmethod
    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Stage ``async_req`` in this process and start its ``async_fn`` in the background."""

    @abstractmethod
    def _current_status(self, blocking: bool) -> _CallStatus:
        """This rank's state of its oldest unfinalized call; with ``blocking``, wait
        until it is no longer running. A caller with no call reports DONE."""

    @abstractmethod
    def _forget_current(self) -> None:
        """Drop the oldest call once all ranks agreed it is settled."""

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Release the background process(es); ``abort`` kills instead of waiting."""

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """Whether no rank of the process group still has a running call, given
        whether this rank has one (``is_alive``). Collective; kept for
        Megatron-Core compatibility (:meth:`is_current_async_call_done` also
        agrees on failures)."""
        if not _dist_active():
            return not is_alive
        device = _collective_device(self.process_group)
        flag = torch.tensor([int(is_alive)], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(flag.item()) == 0

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """Whether the oldest scheduled call has finished on all ranks.

        Args:
            blocking: wait until it has finished on all ranks.
            no_dist: decide from this rank alone, without a collective.

        Raises:
            CheckpointWriteError: on every rank, if the call failed on any rank
                (the call is then forgotten).
        """
        outcome = _settle(self._current_status(blocking), self.process_group, no_dist)
        if outcome.running:
            return False
        self._forget_current()
        _raise_on_failure(outcome, "async checkpoint save")
        return True


class TemporalAsyncCaller(AsyncCaller):
    """Forks one short-lived process for one request.

    Uses the ``fork`` start method where the platform has it, so ``async_fn``
    and its arguments need not be picklable and the child sees the caller's
    memory as it was when the request was scheduled (copy-on-write); elsewhere
    falls back to ``spawn`` (then they must be picklable). The child reports an
    exception's traceback through a pipe; a child that dies without reporting
    (e.g. SIGKILL) is detected from its exit code.

    Call sequence: see :class:`AsyncCaller`; one caller serves one request.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(process_group)
        self.process: Any = None  # multiprocessing Process of the current call
        self._result_reader: Connection | None = None
        self._status: _CallStatus | None = None  # set once the outcome is known locally
        self._call_idx = 0
        self.start_time: float | None = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Stage ``async_req`` here, then fork a process running its ``async_fn``."""
        if self.process is not None or self._status is not None:
            raise CheckpointingException(
                f"TemporalAsyncCaller already holds call {self._call_idx}; it serves one "
                f"request (cannot schedule call {async_req.call_idx})"
            )
        self._call_idx = async_req.call_idx
        try:
            args = _staged_args(async_req)
        except Exception:
            self._fail(_format_exc("preload_fn raised"))
            return
        if async_req.async_fn is None:
            self._status = _CallStatus(self._call_idx, _State.DONE)
            return
        methods = torch_mp.get_all_start_methods()
        ctx: Any = torch_mp.get_context("fork" if "fork" in methods else "spawn")
        reader, writer = ctx.Pipe(duplex=False)
        self.start_time = time.monotonic()
        try:
            self.process = ctx.Process(
                target=_temporal_child_main,
                args=(writer, async_req.async_fn, args, async_req.async_fn_kwargs),
                name=f"dist-ckpt-async-call{self._call_idx}",
            )
            self.process.start()
        except Exception:
            self.process = None
            reader.close()
            self._fail(_format_exc("could not start the async process"))
            return
        finally:
            writer.close()  # the child holds its own copy
        self._result_reader = reader
        logger.debug(
            "rank %d: call %d started in process %d after %.3fs",
            _global_rank(),
            self._call_idx,
            self.process.pid,
            time.monotonic() - self.start_time,
        )

    def _fail(self, error: str) -> None:
        logger.error("rank %d: async call %d failed: %s", _global_rank(), self._call_idx, error)
        self._status = _CallStatus(self._call_idx, _State.FAILED, error)

    def _current_status(self, blocking: bool) -> _CallStatus:
        if self._status is not None:
            return self._status
        if self.process is None:
            return _CallStatus(self._call_idx, _State.DONE)
        if blocking:
            self.process.join()
        elif self.process.is_alive():
            return _CallStatus(self._call_idx, _State.RUNNING)
        self.process.join()
        self._status = self._collect_child_result()
        return self._status

    def _collect_child_result(self) -> _CallStatus:
        assert self._result_reader is not None  # set whenever a process was started
        error: str | None = None
        try:
            if self._result_reader.poll():
                error = self._result_reader.recv()
                reported = True
            else:
                reported = False
        except (EOFError, OSError):
            reported = False
        finally:
            self._result_reader.close()
            self._result_reader = None
        exitcode = self.process.exitcode
        pid = self.process.pid
        self.process = None
        if reported and error is None and exitcode == 0:
            logger.debug("rank %d: call %d finished locally", _global_rank(), self._call_idx)
            return _CallStatus(self._call_idx, _State.DONE)
        if error is None:
            error = f"async process (pid {pid}) {describe_exit(exitcode)} before reporting a result"
        return _CallStatus(self._call_idx, _State.FAILED, error)

    def _forget_current(self) -> None:
        self._status = None

    def close(self, abort: bool = False) -> None:
        """Wait for (or, with ``abort``, kill) the child process. Idempotent."""
        if self.process is not None:
            if abort:
                logger.warning("rank %d: killing async call %d", _global_rank(), self._call_idx)
                self.process.kill()
            self.process.join()
            self.process = None
        if self._result_reader is not None:
            self._result_reader.close()
            self._result_reader = None
        self._status = None


def _temporal_child_main(
    writer: Connection,
    async_fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Entry point of a TemporalAsyncCaller child: run ``async_fn``, report the outcome."""
    # A collection in a forked child may free objects it inherited (e.g. CUDA
    # tensors) whose teardown is only valid in the parent.
    gc.disable()
    error: str | None = None
    try:
        async_fn(*args, **kwargs)
    except BaseException:  # sys.exit() in async_fn is a failure to report too
        error = _format_exc("async_fn raised")
    writer.send(error)
    writer.close()


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
            args = _staged_args(async_req)
        except Exception:
            self._fail(ticket, call_idx, _format_exc("preload_fn raised"))
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
                _format_exc(
                    "could not pickle the request for the persistent worker (async_fn and its "
                    "arguments must be picklable; use a module-level function)"
                ),
            )
            return
        try:
            self._ensure_worker()
            self._requests.put((ticket, payload))
        except Exception:
            self._fail(ticket, call_idx, _format_exc("could not reach the persistent worker"))
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
            time.sleep(_POLL_INTERVAL_S)

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
        process.join(_WORKER_JOIN_TIMEOUT_S)
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
            item = requests.get(timeout=_WORKER_IDLE_CHECK_S)
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
        return _format_exc("persistent worker could not unpickle the request")
    try:
        async_fn(*args, **kwargs)
    except BaseException:  # sys.exit() in async_fn must not end the worker silently
        return _format_exc("async_fn raised")
    return None


# --------------------------------------------------------------------------- queue


@dataclass(frozen=True)
class _ActiveAsyncRequest:
    """A scheduled, not yet finalized call."""

    idx: int
    async_caller: AsyncCaller
    async_request: AsyncRequest


class AsyncCallsQueue:
    """Schedules async requests and finalizes them in order on all ranks.

    Args:
        persistent: run requests in one long-lived worker per rank
            (:class:`PersistentAsyncCaller`) instead of one forked process per
            request (:class:`TemporalAsyncCaller`).
        process_group: the ranks that save together (default: the world).
        snapshot_cpu_tensors: with ``persistent``, copy CPU tensors when a request
            is scheduled (see :class:`PersistentAsyncCaller`); the temporal caller
            always has a copy-on-write snapshot.

    Call sequence (every rank of ``process_group`` makes calls 1-3, the same
    number of times and in the same order):

    1. ``idx = schedule_async_request(request)``: freezes the request, stages it
       (``preload_fn``, the only blocking part) and starts ``async_fn`` in the
       background. Local; returns the call id (0, 1, 2, ...).
    2. ``maybe_finalize_async_calls(blocking=False)`` now and then (e.g. every
       training step): for the oldest calls, one all_reduce each decides whether
       every rank finished; those that did have their finalize functions run, in
       order, and their ids are returned. With ``blocking=True`` it waits for all
       pending calls. A call that failed on any rank raises
       :class:`CheckpointWriteError` on every rank instead (finalize functions not
       run) and is dropped; the queue stays usable.
    3. ``close()`` at the end: finalizes every pending call (as step 2 with
       ``blocking=True``), then stops the worker. Idempotent.
    """

    def __init__(
        self,
        persistent: bool = False,
        process_group: dist.ProcessGroup | None = None,
        snapshot_cpu_tensors: bool = True,
    ) -> None:
        self.persistent = persistent
        self.process_group = process_group
        self.snapshot_cpu_tensors = snapshot_cpu_tensors
        self.async_calls: deque[_ActiveAsyncRequest] = deque()
        self.call_idx = -1
        self.persistent_caller: PersistentAsyncCaller | None = None

    def _get_async_caller(self) -> AsyncCaller:
        if not self.persistent:
            return TemporalAsyncCaller(self.process_group)
        if self.persistent_caller is None:
            self.persistent_caller = PersistentAsyncCaller(
                self.process_group, self.snapshot_cpu_tensors
            )
        return self.persistent_caller

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Stage ``async_request`` and start it in the background; return its call id.

        A staging failure does not raise here: it is reported like a write
        failure, on every rank, when the call is finalized.
        """
        self.call_idx += 1
        request = dataclasses.replace(async_request.freeze(), call_idx=self.call_idx)
        caller = self._get_async_caller()
        start = time.monotonic()
        # The worker gets no finalize functions: they run here, and need not pickle.
        caller.schedule_async_call(dataclasses.replace(request, finalize_fns=[]))
        logger.debug(
            "rank %d: scheduled async call %d (blocked %.3fs)",
            _global_rank(),
            self.call_idx,
            time.monotonic() - start,
        )
        self.async_calls.append(_ActiveAsyncRequest(self.call_idx, caller, request))
        return self.call_idx

    def maybe_finalize_async_calls(
        self, blocking: bool = False, no_dist: bool = False
    ) -> list[int]:
        """Finalize the oldest calls that are done on all ranks; return their ids.

        Args:
            blocking: wait until every pending call is done, then finalize all.
            no_dist: decide from this rank alone (no collective).

        Raises:
            CheckpointWriteError: on every rank, if the oldest unfinalized call
                failed on any rank (or one of its finalize functions failed).
                The call is dropped; later calls stay pending.
        """
        finalized: list[int] = []
        while self.async_calls:
            active = self.async_calls[0]
            try:
                done = active.async_caller.is_current_async_call_done(blocking, no_dist)
            except CheckpointWriteError:
                self._drop_oldest()
                raise
            if not done:
                break
            self._drop_oldest()
            start = time.monotonic()
            _run_finalize_fns(active.async_request, self.process_group, no_dist)
            logger.debug(
                "rank %d: finalized async call %d in %.3fs",
                _global_rank(),
                active.idx,
                time.monotonic() - start,
            )
            finalized.append(active.idx)
        return finalized

    def _drop_oldest(self) -> None:
        active = self.async_calls.popleft()
        if isinstance(active.async_caller, TemporalAsyncCaller):
            active.async_caller.close()

    def get_num_unfinalized_calls(self) -> int:
        """Number of scheduled calls not finalized yet (on this rank)."""
        return len(self.async_calls)

    def close(self, abort: bool = False) -> None:
        """Finalize every pending call, then stop the worker. Idempotent.

        With ``abort``, kills the background processes instead and finalizes
        nothing (no collective either). Otherwise, if a call failed, the remaining
        calls are still finalized and the worker stopped before the first error is
        raised (on every rank).
        """
        first_error: CheckpointWriteError | None = None
        try:
            while self.async_calls and not abort:
                try:
                    self.maybe_finalize_async_calls(blocking=True)
                except CheckpointWriteError as err:
                    first_error = first_error or err
        finally:
            for active in self.async_calls:
                active.async_caller.close(abort=True)
            self.async_calls.clear()
            if self.persistent_caller is not None:
                self.persistent_caller.close(abort=abort)
                self.persistent_caller = None
        if first_error is not None:
            raise first_error


__all__ = [
    "AsyncCaller",
    "AsyncCallsQueue",
    "AsyncRequest",
    "PersistentAsyncCaller",
    "TemporalAsyncCaller",
]
