"""How the ranks agree on the state of an async call.

Each rank knows only its own writer; a call succeeded once every rank of the
process group is done with it, and it failed as soon as any rank failed (a dead
writer is noticed at the next check on every rank, not after the slowest rank
finished writing). A rank still writing a failed call then stops waiting for it:
the temporal caller kills its process, the persistent worker finishes that write
(its later requests are queued behind it) and its result is ignored. One small all-reduce
per check (:meth:`RankGroup.all_reduce_ints`); the causes are gathered only when
some rank failed (:meth:`RankGroup.gather_failures`). A failed call raises
:class:`~dist_checkpointing.errors.CheckpointWriteError` on every rank and its
finalize functions are not run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch.distributed as dist

from ...errors import CheckpointingException, CheckpointWriteError
from ..collectives import RankGroup, dist_active, format_failures
from ..process import format_current_exception, gc_paused


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


def _global_rank() -> int:
    return dist.get_rank() if dist_active() else 0


def _settle(
    status: _CallStatus, group: dist.ProcessGroup | None, no_dist: bool = False
) -> _Outcome:
    """Turn one rank's view of a call into the view every rank of ``group`` shares.

    A call succeeded when every rank is done with it; it failed as soon as any rank
    failed (the others need not finish first). One small all-reduce (MAX) per
    check; the error texts are gathered only when some rank failed.
    """
    failed = status.state is _State.FAILED
    if no_dist or not dist_active():
        local = {_global_rank(): status.error or "unknown error"} if failed else {}
        return _Outcome(status.call_idx, status.state is _State.RUNNING, local)
    ranks = RankGroup(group)
    any_running, any_failed, max_idx, neg_min_idx = ranks.all_reduce_ints(
        [int(status.state is _State.RUNNING), int(failed), status.call_idx, -status.call_idx],
        op=dist.ReduceOp.MAX,
    )
    if max_idx != -neg_min_idx:
        raise CheckpointingException(
            f"ranks are finalizing different async calls (call ids {-neg_min_idx}..{max_idx}, "
            f"rank {_global_rank()} has {status.call_idx}): every rank of the process group "
            "must schedule and finalize the same requests"
        )
    if any_failed:  # settled now, even if a rank still writes: see the module docstring
        failures = ranks.gather_failures(status.error or "unknown error" if failed else None)
        return _Outcome(status.call_idx, False, failures)
    return _Outcome(status.call_idx, bool(any_running), {})


def _raise_on_failure(outcome: _Outcome, what: str) -> None:
    if not outcome.failures:
        return
    ranks = sorted(outcome.failures)
    causes = format_failures({rank: outcome.failures[rank] for rank in ranks}, separator="\n--- ")
    error = CheckpointWriteError(
        f"{what} (call {outcome.call_idx}) failed on rank(s) {ranks}; its finalize "
        f"functions were not run, so no checkpoint metadata was written.\n--- {causes}"
    )
    error.failures = dict(outcome.failures)
    raise error


def _run_finalize_fns(
    call_idx: int,
    finalize_fns: Sequence[Callable[[], None]],
    group: dist.ProcessGroup | None,
    no_dist: bool,
    what: str = "finalizing async checkpoint save",
) -> None:
    """Run the finalize functions in order, then make a failure on any rank an
    error on every rank (so no rank goes on believing the checkpoint is complete)."""
    status = _CallStatus(call_idx, _State.DONE)
    try:
        # The collector is paused as in save() and load(): a torch_dist finalize builds
        # the .metadata of every chunk (objects per tensor), and its automatic collections
        # took 4.5-7.4 s of a 100,000-tensor finalize.
        with gc_paused():
            for fn in finalize_fns:
                fn()
    except Exception:
        status = _CallStatus(
            call_idx, _State.FAILED, format_current_exception("a finalize function raised")
        )
    _raise_on_failure(_settle(status, group, no_dist), what)
