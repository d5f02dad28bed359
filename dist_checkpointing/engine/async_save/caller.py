"""The interface of the background processes that run async requests.

Call sequence (every rank, in order): ``schedule_async_call(request)`` starts the
write; ``is_current_async_call_done(blocking)`` (a collective: every rank of the
group calls it) reports whether every rank finished; ``close()`` waits for what is
still running. :class:`~.temporal.TemporalAsyncCaller` forks a process per request;
:class:`~.persistent.PersistentAsyncCaller` keeps one worker per rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch.distributed as dist

from ..collectives import RankGroup
from .agreement import _CallStatus, _raise_on_failure, _settle
from .request import AsyncRequest


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
        (any_alive,) = RankGroup(self.process_group).all_reduce_ints(
            [int(is_alive)], op=dist.ReduceOp.MAX
        )
        return any_alive == 0

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
