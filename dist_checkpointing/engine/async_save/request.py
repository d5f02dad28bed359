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
  but ``async_fn`` must be picklable (a module-level function); a save's tensors
  are staged into the caller's reusable snapshot arena, which the worker maps once
  (see its docstring).

Failures never hang: a request whose ``async_fn`` raised, or whose process died,
becomes a :class:`~dist_checkpointing.errors.CheckpointWriteError` raised on every
rank of the process group by :meth:`AsyncCallsQueue.maybe_finalize_async_calls`,
and the finalize functions of that request are not run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ...errors import CheckpointingException
from ..process import format_current_exception, running_in_caller
from .agreement import _CallStatus, _raise_on_failure, _run_finalize_fns, _settle, _State

logger = logging.getLogger(__name__)

_RUN_PRELOAD: Any = object()  # staged_args: no staged value given, run preload_fn


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
        abort_fns: called (each once, errors logged) when the call failed on any
            rank or a finalize function raised, instead of the rest of the
            finalization (e.g. to release the save lock of the commit protocol).
    """

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple[Any, ...]
    finalize_fns: list[Callable[[], Any]]
    async_fn_kwargs: dict[str, Any] = field(default_factory=dict)
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    call_idx: int = 0
    abort_fns: list[Callable[[], Any]] = field(default_factory=list)

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

    def add_abort_fn(self, fn: Callable[[], Any]) -> None:
        """Append ``fn`` to the functions run when the request fails."""
        self.abort_fns.append(fn)

    def run_abort_fns(self) -> None:
        """Run the abort functions (after a failure; never raises)."""
        fns, self.abort_fns[:] = list(self.abort_fns), []
        for fn in fns:
            try:
                fn()
            except Exception:  # noqa: BLE001 - the original failure is what matters
                logger.exception("abort function %r of call %d raised", fn, self.call_idx)

    def freeze(self) -> AsyncRequest:
        """Return a frozen copy of this request (with its own finalize list)."""
        return dataclasses.replace(self, is_frozen=True, finalize_fns=list(self.finalize_fns))

    def staged_args(self, staged: Any = _RUN_PRELOAD) -> tuple[Any, ...]:
        """Run ``preload_fn`` (in this process) and return ``async_fn``'s arguments.

        A value returned by ``preload_fn`` replaces ``async_fn_args[1]`` (the staged
        data); None keeps the arguments as they are. A caller that staged the request
        itself passes what ``preload_fn`` would have returned as ``staged``.
        """
        args = self.async_fn_args
        if staged is _RUN_PRELOAD:
            if self.preload_fn is None:
                return args
            staged = self.preload_fn()
        if staged is None:
            return args
        if len(args) < 2:
            raise CheckpointingException(
                f"preload_fn of call {self.call_idx} returned a value, which replaces "
                f"async_fn_args[1], but async_fn_args has only {len(args)} element(s)"
            )
        return (args[0], staged, *args[2:])

    def execute_sync(
        self, process_group: dist.ProcessGroup | None = None, no_dist: bool = False
    ) -> None:
        """Run the request in this process: preload, ``async_fn``, then finalize.

        This is what a synchronous save does. Nothing is forked from this process
        meanwhile: writers that would run one process per file run threads here (a fork
        would leave every page of the trainer copy-on-write). Unless ``no_dist`` (or
        torch.distributed is not initialized), all ranks of ``process_group``
        must call it: they agree on success before any finalize function runs,
        exactly as an async save does.

        Raises:
            CheckpointWriteError: on every rank, if staging or ``async_fn`` failed
                on any rank, or a finalize function failed on any rank.
        """
        status = _CallStatus(self.call_idx, _State.DONE)
        try:
            with running_in_caller():  # no process forked from the trainer
                args = self.staged_args()
                if self.async_fn is not None:
                    self.async_fn(*args, **self.async_fn_kwargs)
        except Exception:
            status = _CallStatus(
                self.call_idx, _State.FAILED, format_current_exception("async_fn raised")
            )
        try:
            outcome = _settle(status, process_group, no_dist)
            _raise_on_failure(outcome, "synchronous checkpoint save")
            _run_finalize_fns(
                self.call_idx,
                self.finalize_fns,
                process_group,
                no_dist,
                "finalizing synchronous checkpoint save",
            )
        except BaseException:
            self.run_abort_fns()
            raise
