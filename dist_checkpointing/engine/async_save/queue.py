"""The queue of async requests: schedule, then finalize on every rank.

:class:`AsyncCallsQueue` runs requests through an :class:`~.caller.AsyncCaller`
and, in :meth:`~AsyncCallsQueue.maybe_finalize_async_calls`, finalizes every call
that all ranks have finished (for example writes the checkpoint metadata).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch.distributed as dist

from ...errors import CheckpointWriteError
from ..process import gc_paused
from .agreement import _global_rank, _run_finalize_fns
from .caller import AsyncCaller
from .persistent import PersistentAsyncCaller
from .request import AsyncRequest
from .temporal import TemporalAsyncCaller

logger = logging.getLogger(__name__)


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
            (:class:`PersistentAsyncCaller`, started here, in the background)
            instead of one forked process per request (:class:`TemporalAsyncCaller`).
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
        if persistent:  # its start-up (an interpreter importing torch) overlaps training
            self._get_async_caller()
            assert self.persistent_caller is not None
            self.persistent_caller.start_worker()

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
        # Staging and handing over (a snapshot, a pickle of the plan) allocate objects
        # per tensor while the plan is alive: the collector is paused, as in save()
        # (its passes took 40-45% of a persistent schedule of 10,000-100,000 tensors).
        with gc_paused():
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
                self._drop_oldest(abort=True)  # this rank may still be writing it
                active.async_request.run_abort_fns()
                raise
            if not done:
                break
            self._drop_oldest()
            # The collector stays paused until this queue has let go of the call: what
            # its finalize functions built is then freed by reference counting, not
            # scanned by the first collection after the pause (0.6-0.8 s for a
            # torch_dist save of 100,000 tensors).
            with gc_paused():
                finalized.append(self._finalize(active, no_dist))
                del active
        return finalized

    def _finalize(self, active: _ActiveAsyncRequest, no_dist: bool) -> int:
        """Run the finalize functions of ``active`` (done on every rank); its id."""
        start = time.monotonic()
        try:
            _run_finalize_fns(
                active.async_request.call_idx,
                active.async_request.finalize_fns,
                self.process_group,
                no_dist,
            )
        except BaseException:
            active.async_request.run_abort_fns()
            raise
        logger.debug(
            "rank %d: finalized async call %d in %.3fs",
            _global_rank(),
            active.idx,
            time.monotonic() - start,
        )
        return active.idx

    def _drop_oldest(self, abort: bool = False) -> None:
        active = self.async_calls.popleft()
        if isinstance(active.async_caller, TemporalAsyncCaller):
            active.async_caller.close(abort=abort)

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
