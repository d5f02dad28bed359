"""Process-level helpers shared by the save and load paths.

Child processes (the temporal async caller's writer and the bucket writer workers)
are started one way (:func:`child_context`: ``fork`` where available, so nothing is
re-imported and arguments need not be picklable; else ``spawn``; the persistent
async worker is forked, or a fresh interpreter, see :mod:`.async_save.worker`) and report their
errors one way (:func:`traceback_text`, :func:`format_current_exception`,
bounded by :func:`truncate_text`); the parent describes a child that died
without reporting with :func:`describe_exit`. How many ranks share the host, each rank's
share of its cores, and whether a core is left for a helper thread:
:func:`ranks_on_this_host`, :func:`cores_per_rank`, :func:`spare_core`.
"""

from __future__ import annotations

import contextvars
import gc
import multiprocessing
import os
import signal
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Set while an async request runs synchronously in the caller (the trainer) itself.
_IN_CALLER: contextvars.ContextVar[bool] = contextvars.ContextVar("in_caller", default=False)


@contextmanager
def running_in_caller() -> Iterator[None]:
    """Mark the block as an async request run in the trainer's own process
    (``AsyncRequest.execute_sync``): its writers then use threads, not forked processes,
    since a fork would make every page of the trainer copy-on-write (its next write to
    each page faults, and copies the page while the child lives)."""
    token = _IN_CALLER.set(True)
    try:
        yield
    finally:
        _IN_CALLER.reset(token)


def in_caller() -> bool:
    """Whether this runs inside :func:`running_in_caller`."""
    return _IN_CALLER.get()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the duration of the block.

    Planning a checkpoint of many small tensors allocates many small objects
    while a large object graph (the state dict) is alive; the collector's
    full passes then take about half of the time. In a forked writer process,
    a collection could also free objects inherited from the parent (e.g. CUDA
    tensors) whose teardown is only valid in the parent. Reference counting
    still frees everything that is not in a cycle.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


#: The exit code :func:`child_exitcode` gives a child that is gone while its exit status
#: went to another waiter of this process (SIGCHLD ignored, or a handler that waits).
EXIT_STATUS_LOST = -(1 << 16)


def child_exitcode(process: Any) -> int | None:
    """``process.exitcode`` of a ``multiprocessing`` child, or :data:`EXIT_STATUS_LOST`
    for one that is gone but whose exit status another waiter collected (``multiprocessing``
    then reports it as running for ever). Checked with ``waitid(WNOWAIT)``, which never
    collects the status itself."""
    code: int | None = process.exitcode
    if code is not None or not hasattr(os, "waitid"):
        return code
    try:
        os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return EXIT_STATUS_LOST
    return None  # running (or exited just now: the next look collects its code)


def describe_exit(exitcode: int | None) -> str:
    """How a child process ended, for error messages ("was killed by signal SIGKILL")."""
    if exitcode is None:
        return "is still running"
    if exitcode == EXIT_STATUS_LOST:
        return (
            "exited, its exit status taken by another waiter in this process (is SIGCHLD "
            "ignored, or handled by a function that waits?)"
        )
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        hint = " (file size limit exceeded)" if name == "SIGXFSZ" else ""
        return f"was killed by signal {name}{hint}"
    return f"exited with code {exitcode}"


# A child's error text travels through a pipe the parent may read only after the
# child exits; keeping it below the smallest common pipe buffer (16 KiB) means the
# child can never block on that write.
MAX_ERROR_CHARS = 8000


def child_context() -> Any:
    """The multiprocessing context for writer children: ``fork`` where available."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def truncate_text(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Keep the head and the tail of a long error (the tail names the exception)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters cut ...]\n{text[-half:]}"


def traceback_text(exc: BaseException) -> str:
    """The full traceback of ``exc`` as text."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


def format_current_exception(prefix: str) -> str:
    """``prefix`` and the traceback of the exception being handled, bounded in size."""
    return truncate_text(f"{prefix}:\n{traceback.format_exc()}")


def ranks_on_this_host() -> int:
    """How many ranks share this host: the launcher's ``LOCAL_WORLD_SIZE`` (torchrun) or
    ``SLURM_NTASKS_PER_NODE``, else 1."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        raw = os.environ.get(name, "").split("(")[0]  # SLURM may write "4(x2)"
        if raw.strip().isdigit() and int(raw) > 0:
            return int(raw)
    return 1


def cores_available() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cores_per_rank() -> int:
    """This rank's share of the host's cores (at least 1)."""
    return max(1, cores_available() // ranks_on_this_host())


def spare_core(busy: int = 1) -> bool:
    """Whether this host has more CPU cores available to this process than its ranks keep
    busy, each with ``busy`` threads: only then does a helper thread run beside the main
    work instead of taking its turn."""
    return cores_available() > ranks_on_this_host() * busy
