"""A parse of untrusted bytes, tried first under a CPU-time limit: :func:`run_cpu_bounded`.

Some parses cannot be stopped from inside. One ``SETITEMS`` opcode of a crafted pickle
inserts thousands of dict keys whose hashes collide, in C, without returning to Python:
0.5 MB takes minutes, and neither a signal handler nor a meter on the input runs
meanwhile. So the parse runs first in a forked child limited by ``RLIMIT_CPU``:

* the child is a copy of this process: same code, same data, and the same ``str`` hash
  seed, so a parse that finishes within the limit there costs the same here;
* the kernel stops it at the limit (``SIGXCPU``; ``SIGKILL`` one second later) whatever
  it is doing; the parent also kills it after a generous wall-clock time;
* it only parses: it logs nothing, drops inherited file descriptors and Python signal
  handlers, never dumps core, reports one line over a pipe and leaves with ``os._exit``.

The child's verdict is only about time: a parse that raises an ordinary error there is
parsed again by the caller, whose own error is the one users see.

Example:
    >>> run_cpu_bounded(lambda: sum(range(1000)), cpu_s=5, source="f", hint="")
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import select
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from dist_checkpointing.errors import CorruptCheckpointError

from ..fork_memory import tensors_wiped_on_fork
from ..process import describe_exit

try:
    import resource
except ImportError:  # pragma: no cover - not on every platform
    resource = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

# A report is one write of at most this many bytes (below PIPE_BUF: atomic, never blocks).
_REPORT_BYTES = 1024
# Where the child cannot be waited for with a pidfd: how often the parent looks.
_POLL_S = 0.05
# The wall-clock limit: this many times the CPU limit, plus a margin.
WALL_FACTOR = 10
WALL_MARGIN_S = 30.0


def unsupported() -> str | None:
    """Why no bounded run is possible on this platform, or None."""
    if not hasattr(os, "fork"):
        return "os.fork is not available"
    if resource is None or not hasattr(resource, "RLIMIT_CPU"):
        return "resource.RLIMIT_CPU is not available"
    return None


def run_cpu_bounded(fn: Callable[[], object], *, cpu_s: float, source: str, hint: str) -> bool:
    """Run ``fn()`` in a forked child limited to ``cpu_s`` CPU-seconds.

    Returns True when ``fn`` returned or raised an ordinary exception within the limit
    (the caller may now run it itself), False when no bounded run could be made (no
    ``os.fork`` or ``resource``, or the fork failed: logged).

    Raises:
        CorruptCheckpointError: naming ``source``, when the child ran out of CPU time or
            of wall-clock time, or died some other way (a crash, the OOM killer); ``hint``
            ends the message (how to raise the limit or turn the check off).
    """
    why = unsupported()
    if why is not None:
        logger.debug("%s: parsed without a CPU-time bound (%s)", source, why)
        return False
    soft, hard = _limits(cpu_s)
    rfd, wfd = os.pipe()
    try:
        # The child only parses: it need not share the large tensors, and sharing them
        # would make the load that follows fault on every page it writes (see fork_memory).
        with warnings.catch_warnings(), tensors_wiped_on_fork():
            # Python 3.12+ warns when a process with threads forks: the child only parses.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as exc:
        os.close(rfd)
        os.close(wfd)
        logger.warning("%s: parsed without a CPU-time bound (fork failed: %s)", source, exc)
        return False
    if pid == 0:
        _child_main(fn, wfd, soft, hard)
    os.close(wfd)
    wall_s = WALL_FACTOR * cpu_s + WALL_MARGIN_S
    try:
        outcome = _wait(pid, rfd, wall_s)
    finally:
        os.close(rfd)
    return _verdict(outcome, source, soft, wall_s, hint)


def _limits(cpu_s: float) -> tuple[int, int]:
    """``(soft, hard)`` RLIMIT_CPU for the child: whole seconds, within the inherited hard
    limit (which an unprivileged process cannot raise)."""
    soft = max(1, math.ceil(cpu_s))
    hard = soft + 1
    inherited = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if inherited != resource.RLIM_INFINITY:
        hard = min(hard, inherited)
        soft = min(soft, hard)
    return soft, hard


def _child_main(fn: Callable[[], object], wfd: int, soft: int, hard: int) -> NoReturn:
    """The forked child: isolate, parse, report one line, ``os._exit``. Never returns."""
    code = 1
    try:
        try:
            _isolate(wfd, soft, hard)
        except Exception as exc:  # noqa: BLE001 - reported: the parent parses unbounded
            os.write(wfd, f"setup {type(exc).__name__}: {exc}".encode()[:_REPORT_BYTES])
            code = 0
        else:
            try:
                fn()
                report = "ok"
            except Exception as exc:  # noqa: BLE001 - the parent's own parse reports it
                report = f"error {type(exc).__name__}: {str(exc)[:_REPORT_BYTES]}"
            os.write(wfd, report.encode(errors="replace")[:_REPORT_BYTES])
            code = 0
    finally:
        os._exit(code)


def _isolate(wfd: int, soft: int, hard: int) -> None:
    """Make the child harmless: no logging or warnings, no Python signal handler (a
    trainer's SIGTERM handler must not run here), no inherited descriptor but the
    report pipe (and 0-2), no core dump, and the CPU limit."""
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    gc.disable()
    for sig in signal.valid_signals():
        try:
            if callable(signal.getsignal(sig)) or sig == signal.SIGXCPU:
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, TypeError):
            continue  # SIGKILL, SIGSTOP and the like
    os.closerange(3, wfd)
    os.closerange(wfd + 1, _max_fd())
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _max_fd() -> int:
    try:
        return max(int(os.sysconf("SC_OPEN_MAX")), 256)
    except (ValueError, OSError):
        return 65536


@dataclass(frozen=True)
class _Outcome:
    exitcode: int | None  # negative: killed by that signal; None: reaped elsewhere
    cpu_s: float
    report: str
    timed_out: bool = False


class _Child:
    """A forked child being waited for: its report so far and, once reaped, its end."""

    def __init__(self, pid: int, rfd: int) -> None:
        self.pid = pid
        self.rfd = rfd
        self.report = bytearray()
        self.done: _Outcome | None = None

    def read(self) -> bool:
        """Read what the child wrote; False at end of file (it is exiting)."""
        chunk = os.read(self.rfd, _REPORT_BYTES)
        self.report += chunk
        return bool(chunk)

    def reap(self, *, block: bool) -> bool:
        """Whether the child has ended (then ``done`` says how)."""
        if self.done is not None:
            return True
        try:
            pid, status, usage = os.wait4(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: SIGCHLD ignored, or handled
            code, used = None, math.nan
        else:
            if pid == 0:
                return False
            code, used = os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
        os.set_blocking(self.rfd, False)  # what it wrote is all in the pipe now
        with contextlib.suppress(BlockingIOError):
            while self.read():
                pass
        self.done = _Outcome(code, used, self.report.decode(errors="replace"))
        return True

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def _wait(pid: int, rfd: int, wall_s: float) -> _Outcome:
    """How child ``pid`` ended (it is reaped), with its report.

    The report ends at end of file on ``rfd``; the exit is seen through a pidfd where
    there is one, else by polling (another process forked meanwhile may hold the
    pipe's write end open)."""
    deadline = time.monotonic() + wall_s
    child = _Child(pid, rfd)
    pidfd = _pidfd(pid)
    poller = select.poll()
    poller.register(rfd, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    try:
        while not child.reap(block=False):
            left = deadline - time.monotonic()
            if left <= 0:
                child.kill()
                child.reap(block=True)
                assert child.done is not None
                return dataclasses.replace(child.done, timed_out=True)
            wait_s = left if pidfd is not None else min(left, _POLL_S)
            for fd, _ in poller.poll(max(1, int(wait_s * 1000))):
                if fd == rfd and not child.read():
                    child.reap(block=True)
        assert child.done is not None
        return child.done
    finally:
        if child.done is None:  # interrupted (KeyboardInterrupt, ...): leave no child
            child.kill()
            child.reap(block=True)
        if pidfd is not None:
            os.close(pidfd)


def _pidfd(pid: int) -> int | None:
    open_pidfd = getattr(os, "pidfd_open", None)
    if open_pidfd is None:
        return None
    try:
        return int(open_pidfd(pid))
    except OSError:
        return None


def _verdict(outcome: _Outcome, source: str, soft: int, wall_s: float, hint: str) -> bool:
    """True: parse it here; False: no bound was possible (logged); else raises."""
    code, used, text = outcome.exitcode, outcome.cpu_s, outcome.report
    if code is None:  # its exit status went elsewhere: its report decides
        if not text.startswith(("ok", "error ", "setup ")):
            raise CorruptCheckpointError(
                f"{source}: the forked check of its parse ended without reporting (its exit "
                f"status went elsewhere: SIGCHLD is ignored or handled in this process); "
                f"refusing to parse it in this process{hint}"
            )
        code = 0
    if outcome.timed_out:
        raise CorruptCheckpointError(
            f"{source}: parsing it did not finish within {wall_s:.0f} s of wall-clock time "
            f"(in a forked check, which had used {used:.1f} of {soft} CPU-seconds); "
            f"refusing to parse it in this process{hint}"
        )
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and used >= soft):
        raise CorruptCheckpointError(
            f"{source}: parsing it takes more than {soft} CPU-second{'s' * (soft != 1)} "
            f"(stopped in a forked check); the file is likely crafted, e.g. with dict keys "
            f"whose hashes collide{hint}"
        )
    if code == 0 and text.startswith("setup "):
        logger.warning("%s: parsed without a CPU-time bound (%s)", source, text[6:])
        return False
    if code == 0 and (text == "ok" or text.startswith("error ")):
        if text != "ok":
            logger.debug("%s: the forked check's parse failed (%s)", source, text[6:])
        return True
    raise CorruptCheckpointError(
        f"{source}: the forked check of its parse {describe_exit(code)} (after {used:.1f} "
        f"CPU-seconds) without reporting; refusing to parse it in this process{hint}"
    )


__all__ = ["WALL_FACTOR", "WALL_MARGIN_S", "run_cpu_bounded", "unsupported"]
