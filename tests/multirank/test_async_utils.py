"""Tests of the async save machinery: AsyncRequest, the two callers and AsyncCallsQueue.

Multi-rank cases run in real gloo process groups (tests.support.harness); every ``_rank_*`` function
runs on every rank. Both caller kinds are covered (``persistent`` True/False).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

from dist_checkpointing.errors import CheckpointingException, CheckpointWriteError
from dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
)
from tests.support.harness import run_distributed

pytestmark = pytest.mark.timeout(120)

BOTH_KINDS = pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
FLAG_WAIT_S = 30.0


# ----------------------------------------------------------------------------- async functions
# Module level, so that the persistent worker can unpickle them.


def _write_text(path: str, content: str) -> None:
    Path(path).write_text(content)


def _write_pid(path: str) -> None:
    Path(path).write_text(str(os.getpid()))


def _write_tensor(path: str, tensor: torch.Tensor) -> None:
    Path(path).write_text(",".join(f"{v:g}" for v in tensor.tolist()))


def _wait_then_write(flag: str, path: str, content: str) -> None:
    """Block until ``flag`` exists (bounded), then write ``content``."""
    deadline = time.monotonic() + FLAG_WAIT_S
    while not os.path.exists(flag):
        if time.monotonic() > deadline:
            raise TimeoutError(f"flag {flag} never appeared")
        time.sleep(0.01)
    Path(path).write_text(content)


def _raise_value_error(message: str) -> None:
    raise ValueError(message)


def _record_pid_then_sigkill(path: str) -> None:
    Path(path).write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + FLAG_WAIT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


# ----------------------------------------------------------------------------- single process


def test_freeze_forbids_add_finalize_fn_and_copies_the_list() -> None:
    calls: list[str] = []
    request = AsyncRequest(None, (), [partial(calls.append, "a")])
    request.add_finalize_fn(partial(calls.append, "b"))
    frozen = request.freeze()
    assert frozen.is_frozen and not request.is_frozen
    with pytest.raises(CheckpointingException, match="frozen"):
        frozen.add_finalize_fn(partial(calls.append, "c"))
    request.add_finalize_fn(partial(calls.append, "d"))  # the original stays open
    assert len(frozen.finalize_fns) == 2 and len(request.finalize_fns) == 3


def test_request_validates_its_fields() -> None:
    with pytest.raises(CheckpointingException, match="async_fn must be callable"):
        AsyncRequest("not callable", (), [])  # type: ignore[arg-type]
    with pytest.raises(CheckpointingException, match=r"entries \[1\]"):
        AsyncRequest(None, (), [print, 3])  # type: ignore[list-item]
    request = AsyncRequest(None, [1, 2], [])  # type: ignore[arg-type]
    assert request.async_fn_args == (1, 2)
    assert (
        request.async_fn_kwargs == {}
        and request.async_fn_kwargs is not AsyncRequest(None, (), []).async_fn_kwargs
    )


def test_execute_sync_runs_in_process_without_dist(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    log: list[Any] = []
    tensor = torch.zeros(3)
    request = AsyncRequest(
        _write_tensor,
        (str(tmp_path / "t.txt"), tensor),
        [partial(log.append, "fin1"), partial(log.append, "fin2")],
        preload_fn=lambda: (tensor.fill_(7), log.append(("preload", os.getpid())), None)[-1],
    )
    request.execute_sync()
    assert (tmp_path / "t.txt").read_text() == "7,7,7"
    assert log == [("preload", os.getpid()), "fin1", "fin2"]


def test_execute_sync_failure_skips_finalize() -> None:
    log: list[str] = []
    request = AsyncRequest(_raise_value_error, ("sync-marker",), [partial(log.append, "fin")])
    with pytest.raises(CheckpointWriteError, match="sync-marker") as info:
        request.execute_sync()
    assert "rank(s) [0]" in str(info.value)
    assert log == []


@BOTH_KINDS
def test_queue_without_dist_is_local(tmp_path: Path, persistent: bool) -> None:
    """Without an initialized process group the queue decides from this process alone."""
    queue = AsyncCallsQueue(persistent=persistent)
    log: list[int] = []
    try:
        idx = queue.schedule_async_request(
            AsyncRequest(_write_text, (str(tmp_path / "a"), "x"), [partial(log.append, 1)])
        )
        assert queue.maybe_finalize_async_calls(blocking=True) == [idx] == [0]
        assert (tmp_path / "a").read_text() == "x" and log == [1]
    finally:
        queue.close()


class _Built:
    """Stands for what a finalize function builds and the request keeps (a save's plan)."""


def test_finalize_runs_with_the_collector_paused_and_frees_the_call_first(
    tmp_path: Path,
) -> None:
    """A torch_dist finalize builds objects per tensor: the collector is paused while the
    finalize functions run, and the queue lets go of the call (whose functions hold what
    they built) before it resumes, so that nothing of it is left for the next collection."""
    built = _Built()
    seen: list[bool] = []
    freed: list[bool] = []
    weakref.finalize(built, lambda: freed.append(gc.isenabled()))

    def finalize(kept: _Built = built) -> None:
        seen.append(gc.isenabled())

    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(
            AsyncRequest(_write_text, (str(tmp_path / "a"), "x"), [finalize])
        )
        del finalize, built  # the queue holds the only references now
        assert gc.isenabled()
        queue.maybe_finalize_async_calls(blocking=True)
        assert seen == [False]  # paused while the finalize function ran
        assert freed == [False]  # freed by reference counting, still inside the pause
        assert gc.isenabled()  # and resumed afterwards
    finally:
        queue.close()


def _write_gc_state(path: str) -> None:

    Path(path).write_text(str(gc.isenabled()))


def _write_gc_state_after_the_call(path: str) -> None:
    """Records the collector's state once the call has returned (a thread in the
    worker: during the call the worker keeps the collector paused)."""

    def later() -> None:
        time.sleep(0.5)
        Path(path + ".tmp").write_text(str(gc.isenabled()))
        os.replace(path + ".tmp", path)  # whole when it appears

    threading.Thread(target=later, daemon=True).start()


@BOTH_KINDS
def test_scheduling_and_the_call_run_with_the_collector_paused(
    tmp_path: Path, persistent: bool
) -> None:
    """Staging a call (a snapshot, a pickle of the plan for the persistent worker) runs
    with the collector paused and the caller gets it back; the call itself runs paused
    too (in the worker, or in the forked child of a temporal call)."""
    seen: list[bool] = []
    queue = AsyncCallsQueue(persistent=persistent)
    try:
        queue.schedule_async_request(
            AsyncRequest(
                _write_gc_state,
                (str(tmp_path / "worker"),),
                [],
                preload_fn=lambda: seen.append(gc.isenabled()),
            )
        )
        assert seen == [False] and gc.isenabled()
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    assert (tmp_path / "worker").read_text() == "False"


def _rank_restart(tmp: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    queue = AsyncCallsQueue(persistent=True)
    try:
        caller = queue.persistent_caller
        assert caller is not None and caller.worker_pid is not None
        first = caller.worker_pid
        os.kill(first, signal.SIGKILL)
        while caller.process is not None and caller.process.poll() is None:
            time.sleep(0.01)  # (reaped by the caller: a second waiter would hide the exit)
        out = tmp / f"w{rank}"
        queue.schedule_async_request(AsyncRequest(_write_gc_state_after_the_call, (str(out),), []))
        queue.maybe_finalize_async_calls(blocking=True)
        second = caller.worker_pid
        _wait_for_file(out)
    finally:
        queue.close()
    return {"first": first, "second": second, "collects": out.read_text()}


def test_a_worker_restarted_while_scheduling_collects_its_garbage(tmp_path: Path) -> None:
    """A persistent worker that died is started again by the next schedule, inside its
    pause of the collector: the new worker must not inherit the pause."""
    for result in run_distributed(_rank_restart, 2, tmp_path, timeout=120.0):
        assert result["second"] not in (None, result["first"])  # a new worker ran the call
        assert result["collects"] == "True"


_SIGCHLD_IGNORED = """
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps children: no exit status
from dist_checkpointing.errors import CheckpointWriteError
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from tests.multirank.test_async_utils import _wait_then_write, _write_text

tmp = Path(sys.argv[2])


def settle(queue):
    deadline = time.monotonic() + 60
    while True:
        try:
            done = queue.maybe_finalize_async_calls(blocking=False)
        except CheckpointWriteError as err:
            return str(err)
        if done:
            return done
        assert time.monotonic() < deadline, "the call never settled"
        time.sleep(0.02)


for persistent in (False, True):
    kind = "persistent" if persistent else "temporal"
    queue = AsyncCallsQueue(persistent=persistent)
    # 1. A call that succeeds is finalized (non-blocking checks), not failed.
    queue.schedule_async_request(AsyncRequest(_write_text, (str(tmp / kind), "x"), []))
    print(kind, "ok", settle(queue) == [0], (tmp / kind).read_text() == "x")
    # 2. A writer killed mid-call fails it, naming why no exit status is known.
    flag = tmp / (kind + ".never")
    queue.schedule_async_request(AsyncRequest(_wait_then_write, (str(flag), str(tmp / "n"), "n"), []))
    time.sleep(0.5)
    caller = queue.async_calls[0].async_caller
    pid = caller.worker_pid if persistent else caller.process.pid
    os.kill(pid, signal.SIGKILL)
    error = settle(queue)
    print(kind, "killed", isinstance(error, str) and "another waiter" in error, error[:300])
    queue.close()  # no error from a child whose status is gone
    print(kind, "closed")
"""


def test_children_whose_exit_status_is_taken_elsewhere(tmp_path: Path) -> None:
    """With SIGCHLD ignored the kernel reaps our children and multiprocessing reports
    them as running for ever: a successful temporal call was failed ("still running
    before reporting"), a killed writer was never noticed by non-blocking checks, and
    closing the persistent worker raised TimeoutExpired."""
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", _SIGCHLD_IGNORED, root, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for kind in ("temporal", "persistent"):
        assert f"{kind} ok True True" in lines, out.stdout
        assert any(line.startswith(f"{kind} killed True") for line in lines), out.stdout
        assert f"{kind} closed" in lines, out.stdout


def test_persistent_mode_reports_unpicklable_async_fn(tmp_path: Path) -> None:
    queue = AsyncCallsQueue(persistent=True)
    target = tmp_path / "never"
    try:
        queue.schedule_async_request(
            AsyncRequest(lambda: target.write_text("x"), (), [])  # a lambda does not pickle
        )
        with pytest.raises(CheckpointWriteError, match="module-level function"):
            queue.maybe_finalize_async_calls(blocking=True)
        assert queue.get_num_unfinalized_calls() == 0
        # The same lambda works in temporal (fork) mode: nothing is pickled there.
    finally:
        queue.close()
    assert not target.exists()


def test_temporal_caller_serves_one_request() -> None:
    caller = TemporalAsyncCaller()
    caller.schedule_async_call(AsyncRequest(None, (), []))
    with pytest.raises(CheckpointingException, match="serves one"):
        caller.schedule_async_call(AsyncRequest(None, (), [], call_idx=1))
    assert caller.is_current_async_call_done(blocking=True)
    caller.close()


# ----------------------------------------------------------------------------- multi-rank bodies


def _rank_basic(tmp: Path, persistent: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    queue = AsyncCallsQueue(persistent=persistent)
    log_file = tmp / f"finalize_rank{rank}.log"
    log: list[str] = []

    def finalize(name: str) -> None:
        log.append(name)
        with open(log_file, "a") as f:
            f.write(name + "\n")

    request = AsyncRequest(
        _write_text,
        (str(tmp / f"data_rank{rank}.txt"),),
        [partial(finalize, "first")],
        async_fn_kwargs={"content": f"payload of rank {rank}"},
    )
    request.add_finalize_fn(partial(finalize, "second"))
    idx = queue.schedule_async_request(request)
    counts = [queue.get_num_unfinalized_calls()]
    log_after_schedule = list(log)
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    counts.append(queue.get_num_unfinalized_calls())
    # Every rank's data must exist once any rank finalized (finalization is collective).
    others = [(tmp / f"data_rank{r}.txt").exists() for r in range(dist.get_world_size())]
    queue.close()
    return {
        "idx": idx,
        "finalized": finalized,
        "counts": counts,
        "log_after_schedule": log_after_schedule,
        "log": log,
        "others_written": others,
    }


@pytest.mark.parametrize(
    ("world_size", "persistent"),
    [(1, False), (2, False), (4, False), (1, True), (2, True)],
    ids=["ws1-temporal", "ws2-temporal", "ws4-temporal", "ws1-persistent", "ws2-persistent"],
)
def test_write_then_finalize_in_order(tmp_path: Path, world_size: int, persistent: bool) -> None:
    results = run_distributed(_rank_basic, world_size, tmp_path, persistent, timeout=60.0)
    for rank, result in enumerate(results):
        assert result["idx"] == 0
        assert result["finalized"] == [0]
        assert result["counts"] == [1, 0]
        assert result["log_after_schedule"] == []  # finalize waits for finalization
        assert result["log"] == ["first", "second"]
        assert all(result["others_written"])
        assert (tmp_path / f"data_rank{rank}.txt").read_text() == f"payload of rank {rank}"
        assert (tmp_path / f"finalize_rank{rank}.log").read_text() == "first\nsecond\n"


def _fill(tensor: torch.Tensor, value: float, log: list[int]) -> None:
    log.append(os.getpid())
    tensor.fill_(value)


def _rank_preload(tmp: Path, persistent: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    queue = AsyncCallsQueue(persistent=persistent)
    preload_pids: list[int] = []
    # 1. preload works by side effect on a tensor that is one of async_fn's arguments.
    tensor = torch.zeros(1000)
    queue.schedule_async_request(
        AsyncRequest(
            _write_tensor,
            (str(tmp / f"side_rank{rank}.txt"), tensor),
            [],
            preload_fn=partial(_fill, tensor, rank + 1.5, preload_pids),
        )
    )
    # 2. Megatron's convention: a returned value replaces async_fn_args[1].
    queue.schedule_async_request(
        AsyncRequest(
            _write_tensor,
            (str(tmp / f"returned_rank{rank}.txt"), None),
            [],
            preload_fn=lambda: torch.full((3,), float(rank + 10)),
        )
    )
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    return {
        "finalized": finalized,
        "preload_pids": preload_pids,
        "pid": os.getpid(),
        # Persistent mode hands a *copy* of CPU tensors over in shared memory: the
        # caller's tensor itself is never moved (it may be updated right after).
        "shared": tensor.is_shared(),
    }


@BOTH_KINDS
def test_preload_runs_in_caller_before_async_fn(tmp_path: Path, persistent: bool) -> None:
    results = run_distributed(_rank_preload, 2, tmp_path, persistent, timeout=60.0)
    for rank, result in enumerate(results):
        assert result["finalized"] == [0, 1]
        assert result["preload_pids"] == [result["pid"]]  # staged in the rank itself
        assert result["shared"] is False
        side = (tmp_path / f"side_rank{rank}.txt").read_text().split(",")
        assert side == [f"{rank + 1.5:g}"] * 1000
        assert (tmp_path / f"returned_rank{rank}.txt").read_text() == ",".join(
            [f"{rank + 10:g}"] * 3
        )


def _rank_depth_two(tmp: Path, persistent: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    queue = AsyncCallsQueue(persistent=persistent)
    log: list[int] = []
    flag = tmp / f"release_rank{rank}"
    # Call 0 waits for a flag; call 1 could finish first but must finalize second.
    for idx, async_fn, args in [
        (0, _wait_then_write, (str(flag), str(tmp / f"c0_rank{rank}"), "zero")),
        (1, _write_text, (str(tmp / f"c1_rank{rank}"), "one")),
    ]:
        assert (
            queue.schedule_async_request(AsyncRequest(async_fn, args, [partial(log.append, idx)]))
            == idx
        )
    if not persistent:  # temporal calls run concurrently: call 1 finishes while 0 waits
        _wait_for_file(tmp / f"c1_rank{rank}")
    early = queue.maybe_finalize_async_calls(blocking=False)
    log_early = list(log)
    flag.touch()
    blocking = queue.maybe_finalize_async_calls(blocking=True)
    # Two more, left pending for close() to finalize.
    for idx in (2, 3):
        queue.schedule_async_request(
            AsyncRequest(
                _write_text,
                (str(tmp / f"c{idx}_rank{rank}"), f"v{idx}"),
                [partial(log.append, idx)],
            )
        )
    pending_before_close = queue.get_num_unfinalized_calls()
    queue.close()
    queue.close()  # idempotent
    return {
        "early": early,
        "log_early": log_early,
        "blocking": blocking,
        "pending_before_close": pending_before_close,
        "pending_after_close": queue.get_num_unfinalized_calls(),
        "log": log,
    }


@BOTH_KINDS
def test_queue_depth_two_finalizes_in_order(tmp_path: Path, persistent: bool) -> None:
    results = run_distributed(_rank_depth_two, 2, tmp_path, persistent, timeout=60.0)
    for rank, result in enumerate(results):
        assert result["early"] == [] and result["log_early"] == []
        assert result["blocking"] == [0, 1]
        assert result["pending_before_close"] == 2 and result["pending_after_close"] == 0
        assert result["log"] == [0, 1, 2, 3]
        for idx, content in enumerate(["zero", "one", "v2", "v3"]):
            assert (tmp_path / f"c{idx}_rank{rank}").read_text() == content


def _rank_nonblocking(tmp: Path, persistent: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    queue = AsyncCallsQueue(persistent=persistent)
    log: list[str] = []
    out = tmp / f"out_rank{rank}"
    flag = tmp / f"flag_rank{rank}"
    queue.schedule_async_request(
        AsyncRequest(_wait_then_write, (str(flag), str(out), "done"), [partial(log.append, "fin")])
    )
    if rank == 0:  # rank 0 finishes its part right away; rank 1 is held back
        flag.touch()
        _wait_for_file(out)
        time.sleep(0.3)  # let the outcome reach this process
    first_poll = queue.maybe_finalize_async_calls(blocking=False)
    state_after_first = (list(log), queue.get_num_unfinalized_calls(), out.exists())
    dist.barrier()
    if rank == 1:
        flag.touch()
    polls = 1
    finalized: list[int] = []
    deadline = time.monotonic() + FLAG_WAIT_S
    while not finalized:  # every iteration is collective, so all ranks leave together
        assert time.monotonic() < deadline, "call never finalized"
        time.sleep(0.02)
        finalized = queue.maybe_finalize_async_calls(blocking=False)
        polls += 1
    queue.close()
    return {
        "first_poll": first_poll,
        "state_after_first": state_after_first,
        "finalized": finalized,
        "log": log,
        "polls": polls,
        "num_after": queue.get_num_unfinalized_calls(),
    }


@BOTH_KINDS
def test_nonblocking_poll_waits_for_the_slowest_rank(tmp_path: Path, persistent: bool) -> None:
    rank0, rank1 = run_distributed(_rank_nonblocking, 2, tmp_path, persistent, timeout=60.0)
    # Rank 0 had written its data, yet did not finalize while rank 1 was still writing.
    assert rank0["state_after_first"] == ([], 1, True)
    assert rank1["state_after_first"] == ([], 1, False)
    for result in (rank0, rank1):
        assert result["first_poll"] == []
        assert result["finalized"] == [0]
        assert result["log"] == ["fin"]
        assert result["num_after"] == 0
    assert rank0["polls"] == rank1["polls"]


def _rank_failure(tmp: Path, persistent: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    queue = AsyncCallsQueue(persistent=persistent)
    log: list[str] = []
    if rank == 1:
        request = AsyncRequest(_raise_value_error, ("disk full on rank one (marker-7f3a)",), [])
    else:
        request = AsyncRequest(_write_text, (str(tmp / "rank0_first"), "ok"), [])
    request.add_finalize_fn(partial(log.append, "first-save-finalized"))
    queue.schedule_async_request(request)
    error = ""
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointWriteError as exc:
        error = str(exc)
    state = (list(log), queue.get_num_unfinalized_calls())
    # The queue stays usable.
    queue.schedule_async_request(
        AsyncRequest(
            _write_text, (str(tmp / f"second_rank{rank}"), "again"), [partial(log.append, "second")]
        )
    )
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    return {"error": error, "state": state, "finalized": finalized, "log": log}


@BOTH_KINDS
def test_failure_on_one_rank_raises_on_every_rank(tmp_path: Path, persistent: bool) -> None:
    results = run_distributed(_rank_failure, 2, tmp_path, persistent, timeout=60.0)
    for result in results:
        assert "rank(s) [1]" in result["error"], result["error"]
        assert "ValueError: disk full on rank one (marker-7f3a)" in result["error"]
        assert "call 0" in result["error"]
        assert result["state"] == ([], 0)  # finalize functions did not run
        assert result["finalized"] == [1]
        assert result["log"] == ["second"]
    for rank in range(2):
        assert (tmp_path / f"second_rank{rank}").read_text() == "again"


def _rank_sigkill(tmp: Path, persistent: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    queue = AsyncCallsQueue(persistent=persistent)
    log: list[str] = []
    first_pid_file = tmp / f"pid0_rank{rank}"
    async_fn = _record_pid_then_sigkill if rank == 1 else _write_pid
    queue.schedule_async_request(
        AsyncRequest(async_fn, (str(first_pid_file),), [partial(log.append, "x")])
    )
    start = time.monotonic()
    error = ""
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointWriteError as exc:
        error = str(exc)
    elapsed = time.monotonic() - start
    second_pid_file = tmp / f"pid1_rank{rank}"
    queue.schedule_async_request(
        AsyncRequest(_write_pid, (str(second_pid_file),), [partial(log.append, "ok")])
    )
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    return {
        "error": error,
        "elapsed": elapsed,
        "finalized": finalized,
        "log": log,
        "pids": (int(first_pid_file.read_text()), int(second_pid_file.read_text())),
    }


@BOTH_KINDS
def test_killed_worker_raises_on_every_rank_and_recovers(tmp_path: Path, persistent: bool) -> None:
    rank0, rank1 = run_distributed(_rank_sigkill, 2, tmp_path, persistent, timeout=90.0)
    for result in (rank0, rank1):
        assert "rank(s) [1]" in result["error"], result["error"]
        assert "SIGKILL" in result["error"]
        assert result["elapsed"] < 30.0
        assert result["finalized"] == [1]
        assert result["log"] == ["ok"]
    killed, replacement = rank1["pids"]
    assert killed != replacement  # a new process served the next save
    survivor_first, survivor_second = rank0["pids"]
    # The persistent worker of the healthy rank is reused; temporal forks a new process.
    assert (survivor_first == survivor_second) == persistent


def _rank_worker_reuse(tmp: Path, persistent: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    queue = AsyncCallsQueue(persistent=persistent)
    pids = []
    for save in range(2):
        path = tmp / f"pid_save{save}_rank{rank}"
        queue.schedule_async_request(AsyncRequest(_write_pid, (str(path),), []))
        queue.maybe_finalize_async_calls(blocking=True)
        pids.append(int(path.read_text()))
    caller = queue.persistent_caller
    worker_pid = caller.worker_pid if isinstance(caller, PersistentAsyncCaller) else None
    queue.close()
    still_alive = any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids
    )
    return {
        "pids": pids,
        "worker_pid": worker_pid,
        "rank_pid": os.getpid(),
        "alive_after_close": still_alive,
    }


@BOTH_KINDS
def test_persistent_worker_is_reused_and_stopped_by_close(tmp_path: Path, persistent: bool) -> None:
    for result in run_distributed(_rank_worker_reuse, 2, tmp_path, persistent, timeout=60.0):
        first, second = result["pids"]
        assert result["rank_pid"] not in (first, second)  # written in the background
        if persistent:
            assert first == second == result["worker_pid"]
        else:
            assert first != second and result["worker_pid"] is None
        assert not result["alive_after_close"]


def _rank_execute_sync(tmp: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    log: list[Any] = []
    ok = AsyncRequest(_write_pid, (str(tmp / f"sync_rank{rank}"),), [partial(log.append, "a")])
    ok.add_finalize_fn(partial(log.append, "b"))
    ok.execute_sync()
    written_by = int((tmp / f"sync_rank{rank}").read_text())
    async_fn = _raise_value_error if rank == 1 else _write_text
    args = ("sync failure marker",) if rank == 1 else (str(tmp / "unused"), "x")
    error = ""
    try:
        AsyncRequest(async_fn, args, [partial(log.append, "never")]).execute_sync()
    except CheckpointWriteError as exc:
        error = str(exc)
    return {"log": log, "written_by": written_by, "pid": os.getpid(), "error": error}


def test_execute_sync_is_collective(tmp_path: Path) -> None:
    for result in run_distributed(_rank_execute_sync, 2, tmp_path, timeout=60.0):
        assert result["written_by"] == result["pid"]  # ran in-process
        assert result["log"] == ["a", "b"]
        assert "rank(s) [1]" in result["error"] and "sync failure marker" in result["error"]


def _rank_staging_and_finalize_failures(tmp: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    queue = AsyncCallsQueue()
    errors = []

    def bad_preload() -> None:
        raise RuntimeError("staging marker")

    # Staging fails on rank 1 only: no error at schedule time, every rank raises at finalize.
    queue.schedule_async_request(
        AsyncRequest(
            _write_text,
            (str(tmp / f"a{rank}"), "x"),
            [],
            preload_fn=bad_preload if rank == 1 else None,
        )
    )
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointWriteError as exc:
        errors.append(str(exc))

    def bad_finalize() -> None:
        raise OSError("metadata write marker")

    # A finalize function fails on rank 0 only: every rank raises.
    queue.schedule_async_request(
        AsyncRequest(_write_text, (str(tmp / f"b{rank}"), "x"), [bad_finalize] if rank == 0 else [])
    )
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointWriteError as exc:
        errors.append(str(exc))
    num = queue.get_num_unfinalized_calls()
    queue.close()
    return {"errors": errors, "num": num}


def test_staging_and_finalize_failures_raise_on_every_rank(tmp_path: Path) -> None:
    for result in run_distributed(_rank_staging_and_finalize_failures, 2, tmp_path, timeout=60.0):
        staging, finalize = result["errors"]
        assert "rank(s) [1]" in staging and "staging marker" in staging
        assert "rank(s) [0]" in finalize and "metadata write marker" in finalize
        assert result["num"] == 0


def _rank_subgroups(tmp: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    group = groups[rank // 2]
    queue = AsyncCallsQueue(process_group=group)
    if rank == 3:
        request = AsyncRequest(_raise_value_error, ("subgroup marker",), [])
    else:
        request = AsyncRequest(_write_text, (str(tmp / f"r{rank}"), "x"), [])
    queue.schedule_async_request(request)
    error = ""
    try:
        finalized = queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointWriteError as exc:
        finalized, error = [], str(exc)
    queue.close()
    return {"finalized": finalized, "error": error}


def test_queue_works_inside_a_subgroup(tmp_path: Path) -> None:
    results = run_distributed(_rank_subgroups, 4, tmp_path, timeout=60.0)
    for rank in (0, 1):
        assert results[rank] == {"finalized": [0], "error": ""}
    for rank in (2, 3):
        assert results[rank]["finalized"] == []
        assert "rank(s) [3]" in results[rank]["error"]
        assert "subgroup marker" in results[rank]["error"]


def _rank_no_dist(tmp: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    queue = AsyncCallsQueue()
    flag = tmp / "never_created"
    if rank == 1:  # never finishes on its own: rank 0 must not wait for it
        request = AsyncRequest(_wait_then_write, (str(flag), str(tmp / "r1"), "x"), [])
    else:
        request = AsyncRequest(_write_text, (str(tmp / "r0"), "x"), [])
    queue.schedule_async_request(request)
    if rank == 0:
        finalized = queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    else:
        finalized = queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
        flag.touch()
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    queue.close()
    return {"finalized": finalized}


def test_no_dist_finalizes_without_waiting_for_other_ranks(tmp_path: Path) -> None:
    rank0, rank1 = run_distributed(_rank_no_dist, 2, tmp_path, timeout=60.0)
    assert rank0["finalized"] == [0]
    assert rank1["finalized"] == []


def _rank_shared_mode(tmp: Path) -> dict[str, Any]:
    """Persistent caller without snapshots: the caller's own tensor goes to shared memory."""
    queue = AsyncCallsQueue(persistent=True, snapshot_cpu_tensors=False)
    tensor = torch.full((1000,), 3.0)
    queue.schedule_async_request(
        AsyncRequest(_write_tensor, (str(tmp / f"shared_rank{dist.get_rank()}.txt"), tensor), [])
    )
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    return {"finalized": finalized, "shared": tensor.is_shared()}


def test_persistent_without_snapshot_shares_the_live_tensor(tmp_path: Path) -> None:
    (result,) = run_distributed(_rank_shared_mode, 1, tmp_path, timeout=60.0)
    assert result == {"finalized": [0], "shared": True}
    assert (tmp_path / "shared_rank0.txt").read_text().split(",")[0].startswith("3")


def _rank_execute_sync_forks_nothing(tmp: Path) -> dict[str, Any]:
    import dist_checkpointing as dc
    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    forks: list[int] = []
    os.register_at_fork(before=lambda: forks.append(1))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = {
        k: torch.arange(4096, dtype=torch.float32) * (i + 1) + rank for i, k in enumerate("ab")
    }
    sd = {k: ShardedTensor.from_rank_offsets(k, v, (0, rank, world)) for k, v in local.items()}
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=2)  # two files
    (tmp / "ckpt").mkdir(exist_ok=True)
    request = dc.save(sd, str(tmp / "ckpt"), strategy, async_sharded_save=True)
    assert request is not None
    request.execute_sync()
    saved_forks = len(forks)
    target = {
        k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v), (0, rank, world))
        for k, v in local.items()
    }
    loaded = dc.load(target, str(tmp / "ckpt"))
    exact = all(torch.equal(loaded[k], v) for k, v in local.items())
    files = sorted(p.name for p in (tmp / "ckpt").glob("*.distcp"))
    return {"forks": saved_forks, "exact": exact, "files": files}


def test_execute_sync_writes_with_threads_never_forking_the_trainer(tmp_path: Path) -> None:
    """An async request run in the caller (execute_sync) writes its several files from
    threads: a fork would leave every page of the trainer copy-on-write."""
    for result in run_distributed(_rank_execute_sync_forks_nothing, 2, tmp_path, timeout=60.0):
        assert result["forks"] == 0 and result["exact"]
        assert len(result["files"]) == 4  # 2 ranks x 2 files: several buckets per rank
