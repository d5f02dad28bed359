"""The temporal caller: a fresh process per request.

Arguments need not be picklable, and the child sees a copy-on-write snapshot of the
caller's memory taken when the request is scheduled (``fork`` where available).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from ...errors import CheckpointingException
from ..process import (
    EXIT_STATUS_LOST,
    child_context,
    child_exitcode,
    describe_exit,
    format_current_exception,
)
from .agreement import _CallStatus, _global_rank, _State
from .caller import AsyncCaller
from .request import AsyncRequest

logger = logging.getLogger(__name__)


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
            args = async_req.staged_args()
        except Exception:
            self._fail(format_current_exception("preload_fn raised"))
            return
        if async_req.async_fn is None:
            self._status = _CallStatus(self._call_idx, _State.DONE)
            return
        ctx: Any = child_context()
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
            self._fail(format_current_exception("could not start the async process"))
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
        elif child_exitcode(self.process) is None:
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
        exitcode = child_exitcode(self.process)
        pid = self.process.pid
        self.process = None
        # A child whose exit status another waiter took (SIGCHLD ignored...) is trusted
        # by its report: it reports last, just before it exits.
        if reported and error is None and exitcode in (0, EXIT_STATUS_LOST):
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
        error = format_current_exception("async_fn raised")
    writer.send(error)
    writer.close()
