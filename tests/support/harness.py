"""The multi-rank test harness: run a function on N real processes in a gloo process group.

Usage::

    from tests.support.harness import run_distributed, world_sizes


    def _roundtrip(ckpt_dir):  # module level, so that it pickles by reference
        rank = torch.distributed.get_rank()
        ...
        return result  # must be picklable


    @world_sizes(1, 2, 4)
    def test_roundtrip(tmp_path, world_size):
        results = run_distributed(_roundtrip, world_size, tmp_path, timeout=60.0)
        assert results[1] == ...

How a run works (one call of :func:`run_distributed`):

1. The parent pickles ``(fn, args, kwargs)`` with plain :mod:`pickle` (tensors travel by value,
   never through shared memory) and starts ``world_size`` processes from a forkserver that has
   already imported torch, so a rank starts in ~20 ms instead of ~2 s for ``spawn``, and without
   inheriting the pytest process's threads (which a plain ``fork`` would).
2. Each rank moves into its own process group (so it can be killed with all its children),
   asks the kernel to SIGKILL it if its parent dies, sets ``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and initializes the default process group
   with a :class:`~torch.distributed.FileStore` in a private temporary directory (no TCP port
   to race for; gloo itself binds ephemeral ports on the loopback interface).
3. The rank runs ``fn(*args, **kwargs)``, destroys the process group, and sends back either
   the pickled return value or its formatted traceback through its own pipe.
4. The parent waits on all pipes and process sentinels until ``timeout``. After the first
   failure the other ranks get :data:`FAILURE_GRACE_S` seconds to finish or fail (a rank
   blocked in a collective with a dead peer usually fails at once), then every rank still
   running is killed with its process group and descendants, and :class:`DistributedTestError`
   lists each failing rank's traceback. A timeout also dumps the hung ranks' Python stacks
   (via :mod:`faulthandler` on SIGUSR1) into the error message.

Ranks are ordinary non-daemonic processes, so they may start their own worker processes
(``fork``, ``forkserver`` or ``spawn``), as the async checkpoint writer does. Workers left
behind in a rank's process group are killed when the run ends.

Set ``DIST_CKPT_TEST_START_METHOD=fork|spawn`` to debug with another start method.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FAILURE_GRACE_S",
    "START_METHOD_ENV",
    "DistributedTestError",
    "RankFailure",
    "cuda_device_count",
    "launch",
    "requires_cuda",
    "requires_gpus",
    "run_distributed",
    "world_sizes",
]

DEFAULT_TIMEOUT_S = 120.0
"""Default wall-clock limit of one :func:`run_distributed` call."""

FAILURE_GRACE_S = 3.0
"""How long the other ranks may still run after one rank failed, before they are killed."""

EXIT_GRACE_S = 10.0
"""How long a rank may take to exit after it sent its result."""

START_METHOD_ENV = "DIST_CKPT_TEST_START_METHOD"
"""Environment variable overriding the multiprocessing start method (default forkserver)."""

_STACK_DUMP_SIGNAL = signal.SIGUSR1
_STACK_DUMP_WAIT_S = 0.5
_MAX_STACK_CHARS = 6000
_MAX_SUMMARY_CHARS = 200  # of the one-line summary; the full message is in the traceback
_PR_SET_PDEATHSIG = 1
# Modules the forkserver imports once, so that each rank starts without importing them.
_ALWAYS_PRELOAD = (
    "torch",
    "tests.support.fork_server",  # before any test module: no thread pool to inherit
    "torch.distributed",
    "torch.distributed.checkpoint",  # ~3 s to import per rank otherwise
    "dist_checkpointing.strategies.torch",
    "numpy",
    "psutil",
    "pytest",
    "tests.support.harness",
)
# Modules preloaded too when the parent has imported them already (so they are known to import).
_PRELOAD_PREFIXES = ("torch.distributed.checkpoint", "dist_checkpointing", "tests.")


# --------------------------------------------------------------------------------------------
# Pytest helpers
# --------------------------------------------------------------------------------------------


def cuda_device_count() -> int:
    """Number of usable CUDA devices (0 on CPU-only builds).

    Counted through NVML where torch can (``torch.cuda.device_count``), never through
    ``torch.cuda.is_available``: that one initializes the CUDA runtime, after which
    torch refuses CUDA in every forked child, and the harness's forkserver imports this
    module before it forks the ranks.
    """
    return torch.cuda.device_count()


requires_cuda = pytest.mark.skipif(cuda_device_count() == 0, reason="needs a CUDA device")
"""Skip marker for tests that need at least one CUDA device (tests marked ``gpu`` skip too)."""


def requires_gpus(count: int) -> pytest.MarkDecorator:
    """Skip marker for tests that need at least ``count`` CUDA devices."""
    return pytest.mark.skipif(cuda_device_count() < count, reason=f"needs {count} CUDA devices")


def world_sizes(*sizes: int) -> pytest.MarkDecorator:
    """Parametrize a test over ``world_size`` (its test ids read ``ws1``, ``ws2``, ...).

    Example: ``@world_sizes(1, 2, 4)`` then ``def test_x(tmp_path, world_size): ...``.
    """
    return pytest.mark.parametrize("world_size", sizes, ids=[f"ws{size}" for size in sizes])


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankFailure:
    """Why one rank did not deliver a result.

    ``kind`` is one of ``"exception"`` (fn raised), ``"died"`` (the process exited without a
    result), ``"timeout"`` (still running at the deadline), ``"killed"`` (still running when
    another rank failed) or ``"exit"`` (returned, but then hung or crashed while exiting).
    """

    rank: int
    kind: str
    summary: str
    exc_type: str | None = None
    details: str = ""

    def render(self) -> str:
        header = f"--- rank {self.rank}: {self.summary} ---"
        return f"{header}\n{self.details.rstrip()}" if self.details else header


class DistributedTestError(AssertionError):
    """One or more ranks of a :func:`run_distributed` call failed, died or timed out.

    It is an :class:`AssertionError`, so pytest reports it as a test failure. ``failures`` maps
    each failing rank to its :class:`RankFailure` (the traceback is in ``details``);
    ``timed_out`` tells whether the run hit its timeout with no rank having failed first.
    """

    def __init__(
        self,
        description: str,
        world_size: int,
        failures: dict[int, RankFailure],
        timed_out: bool = False,
    ) -> None:
        self.description = description
        self.world_size = world_size
        self.failures = dict(failures)
        self.timed_out = timed_out
        super().__init__(self._render())

    def _render(self) -> str:
        failed = sorted(self.failures)
        what = "timed out" if self.timed_out else "failed"
        lines = [f"{self.description} {what} on ranks {failed} (world size {self.world_size})"]
        lines += [self.failures[rank].render() for rank in failed]
        return "\n".join(lines)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.description, self.world_size, self.failures, self.timed_out)


# --------------------------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------------------------


def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphaned ranks)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _set_rank_env(rank: int, world_size: int, parent_env: dict[str, str]) -> None:
    # The forkserver's environment is a snapshot from its start: use the parent's current one,
    # so that a test's monkeypatch.setenv reaches the ranks.
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
    )
    if os.path.exists("/sys/class/net/lo"):
        # Keep gloo on the loopback interface whatever the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _describe_exception(exc: BaseException) -> tuple[str, str, str]:
    """(summary, qualified type name, full formatted traceback) of ``exc``."""
    exc_type = type(exc)
    name = exc_type.__qualname__
    if exc_type.__module__ not in ("builtins", "__main__"):
        name = f"{exc_type.__module__}.{name}"
    details = "".join(traceback.format_exception(exc))
    first_line = next(iter(str(exc).splitlines()), "")
    if len(first_line) > _MAX_SUMMARY_CHARS:
        first_line = first_line[:_MAX_SUMMARY_CHARS] + "..."
    return f"raised {exc_type.__qualname__}: {first_line}", name, details


def _run_fn(
    payload: bytes, rank: int, world_size: int, backend: str, store_path: str, timeout_s: float
) -> Any:
    fn, args, kwargs = pickle.loads(payload)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        # Every rank has joined the mesh before fn runs: a rank that fails at once must not
        # break a peer's connection setup, which would report a spurious second failure.
        dist.barrier()
        return fn(*args, **kwargs)
    finally:
        # Destroying the group closes this rank's connections, so that peers still waiting in
        # a collective on a failed rank fail at once instead of hanging until the timeout.
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_main(
    rank: int,
    world_size: int,
    payload: bytes,
    conn: Connection,
    run_dir: str,
    backend: str,
    timeout_s: float,
    parent_env: dict[str, str],
) -> None:
    """Entry point of one rank process."""
    with contextlib.suppress(OSError):
        os.setpgrp()  # own process group: the parent kills the rank with all its children
    _set_parent_death_signal()
    stack_file = open(os.path.join(run_dir, f"stacks_rank{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.register(_STACK_DUMP_SIGNAL, file=stack_file, all_threads=True)
    _set_rank_env(rank, world_size, parent_env)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        value = _run_fn(
            payload, rank, world_size, backend, os.path.join(run_dir, "filestore"), timeout_s
        )
        message = pickle.dumps(("ok", value), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # SystemExit etc. are failures of the rank too
        message = pickle.dumps(("error", _describe_exception(exc)))
    conn.send_bytes(message)
    conn.close()
    faulthandler.unregister(_STACK_DUMP_SIGNAL)
    stack_file.close()


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


def _preload_modules() -> list[str]:
    loaded = [
        name
        for name, module in list(sys.modules.items())
        if name.startswith(_PRELOAD_PREFIXES) and getattr(module, "__file__", None)
    ]
    return list(_ALWAYS_PRELOAD) + sorted(set(loaded) - set(_ALWAYS_PRELOAD))


def _mp_context() -> Any:  # typeshed's BaseContext lacks .Process
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # Takes effect when the forkserver starts (first run of the session), ignored after.
        ctx.set_forkserver_preload(_preload_modules())
    return ctx


def _fn_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class _Run:
    """The parent's view of one run: processes, pipes and what each rank reported."""

    def __init__(self, ctx: Any, world_size: int, run_dir: str) -> None:
        self.ctx = ctx
        self.world_size = world_size
        self.run_dir = run_dir
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.results: dict[int, Any] = {}
        self.failures: dict[int, RankFailure] = {}

    def start(self, payload: bytes, backend: str, timeout_s: float) -> None:
        for rank in range(self.world_size):
            reader, writer = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(
                target=_rank_main,
                args=(
                    rank,
                    self.world_size,
                    payload,
                    writer,
                    self.run_dir,
                    backend,
                    timeout_s,
                    dict(os.environ),
                ),
                name=f"rank{rank}",
                daemon=False,  # ranks may start worker processes of their own
            )
            proc.start()
            writer.close()
            self.procs.append(proc)
            self.conns.append(reader)

    def pending(self) -> list[int]:
        done = self.results.keys() | self.failures.keys()
        return [rank for rank in range(self.world_size) if rank not in done]

    def _receive(self, rank: int) -> None:
        try:
            status, value = pickle.loads(self.conns[rank].recv_bytes())
        except EOFError:
            proc = self.procs[rank]
            proc.join(1.0)
            self.failures[rank] = RankFailure(
                rank, "died", f"process {_describe_exit(proc.exitcode)} without a result"
            )
            return
        except Exception as exc:  # e.g. a result that cannot be unpickled here
            summary, exc_type, details = _describe_exception(exc)
            self.failures[rank] = RankFailure(
                rank,
                "exception",
                f"its result could not be received: {summary}",
                exc_type,
                details,
            )
            return
        if status == "ok":
            self.results[rank] = value
        else:
            summary, exc_type, details = value
            self.failures[rank] = RankFailure(rank, "exception", summary, exc_type, details)

    def wait(self, deadline: float) -> None:
        """Collect results until every rank reported or ``deadline`` (with failure grace)."""
        while pending := self.pending():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            waitables: dict[Any, int] = {}
            for rank in pending:
                waitables[self.conns[rank]] = rank
                waitables[self.procs[rank].sentinel] = rank
            ready = multiprocessing.connection.wait(list(waitables), timeout=remaining)
            for rank in sorted({waitables[obj] for obj in ready}):
                self._receive(rank)  # EOF on the pipe means the process died
            if self.failures:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)

    def check_exits(self) -> None:
        """Ranks that returned must also exit cleanly and promptly."""
        deadline = time.monotonic() + EXIT_GRACE_S
        for rank in sorted(self.results):
            proc = self.procs[rank]
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                self.failures[rank] = RankFailure(
                    rank,
                    "exit",
                    f"returned but did not exit within {EXIT_GRACE_S:.0f} s",
                    details=self.dump_stacks([rank]).get(rank, ""),
                )
            elif proc.exitcode != 0:
                self.failures[rank] = RankFailure(
                    rank, "exit", f"returned but then {_describe_exit(proc.exitcode)}"
                )

    def dump_stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Python stacks of the given live ranks, via their faulthandler signal."""
        signalled = []
        for rank in ranks:
            pid = self.procs[rank].pid
            if pid is not None and self.procs[rank].exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, _STACK_DUMP_SIGNAL)
                    signalled.append(rank)
        if not signalled:
            return {}
        time.sleep(_STACK_DUMP_WAIT_S)
        stacks = {}
        for rank in signalled:
            path = os.path.join(self.run_dir, f"stacks_rank{rank}.txt")
            with contextlib.suppress(OSError), open(path) as f:
                text = f.read()
                if len(text) > _MAX_STACK_CHARS:
                    text = "...\n" + text[-_MAX_STACK_CHARS:]
                stacks[rank] = f"Python stacks when it was killed:\n{text}" if text else ""
        return stacks

    def kill_all(self) -> None:
        """SIGKILL every rank, its process group and its descendants; reap the ranks."""
        victims: list[psutil.Process] = []
        for proc in self.procs:
            if proc.pid is None:
                continue
            with contextlib.suppress(psutil.Error):
                victims.extend(psutil.Process(proc.pid).children(recursive=True))
            # The group outlives its leader: this also reaches orphaned workers of the rank.
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.exitcode is None:
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGKILL)
        for victim in victims:
            with contextlib.suppress(psutil.Error):
                victim.kill()
        for proc in self.procs:
            proc.join(5.0)
        _wait_gone(victims, timeout_s=5.0)
        for conn in self.conns:
            conn.close()


def _wait_gone(procs: Sequence[psutil.Process], timeout_s: float) -> None:
    """Wait until the processes are gone; a zombie counts as gone (its parent may be dead and
    PID 1 of a container may never reap it)."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        while time.monotonic() < deadline:
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.Error:
                break
            time.sleep(0.01)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
) -> list[Any]:
    """Like :func:`run_distributed`, with the harness options as explicit arguments.

    ``backend`` is ``"gloo"`` (CPU, default) or ``"nccl"`` (rank r uses CUDA device
    ``r % device_count``).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    description = f"run_distributed({_fn_name(fn)})"
    try:
        payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})), pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"{description}: fn and its arguments must be picklable (fn defined at module "
            f"level): {exc!r}"
        ) from exc

    run_dir = tempfile.mkdtemp(prefix="dist-ckpt-harness-")
    run = _Run(_mp_context(), world_size, run_dir)
    try:
        run.start(payload, backend, timeout)
        run.wait(time.monotonic() + timeout)
        unfinished = run.pending()
        timed_out = bool(unfinished) and not run.failures
        if unfinished:
            stacks = run.dump_stacks(unfinished)
            summary = (
                f"had not finished after {timeout:g} s"
                if timed_out
                else "was still running when another rank failed, killed"
            )
            for rank in unfinished:
                run.failures[rank] = RankFailure(
                    rank,
                    "timeout" if timed_out else "killed",
                    summary,
                    details=stacks.get(rank, ""),
                )
        else:
            run.check_exits()
    finally:
        run.kill_all()
        shutil.rmtree(run_dir, ignore_errors=True)
    if run.failures:
        raise DistributedTestError(description, world_size, run.failures, timed_out)
    return [run.results[rank] for rank in range(world_size)]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` processes joined in a gloo process group.

    ``fn`` must be a module-level function, and its arguments and return value picklable.
    Returns the per-rank return values, indexed by rank. Raises :class:`DistributedTestError`
    (an ``AssertionError``) with every failing rank's traceback if a rank raises or dies, or
    with the hung ranks' stacks if the run takes longer than ``timeout`` seconds; all rank
    processes and their children are gone when it returns or raises.
    """
    return launch(fn, world_size, args, kwargs, timeout=timeout)
