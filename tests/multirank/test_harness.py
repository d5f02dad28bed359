"""Tests of the multi-rank harness itself (tests/support/harness.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from tests.support import harness
from tests.support.harness import (
    DistributedTestError,
    launch,
    requires_cuda,
    run_distributed,
    world_sizes,
)

# ---------------------------------------------------------------------------- rank functions


def _read_env(name: str) -> str | None:
    return os.environ.get(name)


def _rank_and_sum() -> tuple[int, int, float, dict[str, str]]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tensor = torch.tensor([float(rank + 1)])
    dist.all_reduce(tensor)
    env = {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    return rank, world_size, tensor.item(), env


def _echo(path: Path, scale: int, *, offset: int = 0) -> tuple[str, int, torch.Tensor]:
    rank = dist.get_rank()
    return str(path), rank * scale + offset, torch.arange(4, dtype=torch.bfloat16) * rank


def _fail_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    return dist.get_rank()


def _fail_on_rank_1_inside_collective() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 waits here for a peer that is gone


def _record_pids(tmp_path: Path) -> None:
    """Write this rank's pid and the pid of a child it started to tmp_path."""
    rank = dist.get_rank()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    (tmp_path / f"rank{rank}.pids").write_text(f"{os.getpid()} {child.pid}")


def _hang_on_rank_1(tmp_path: Path) -> None:
    _record_pids(tmp_path)
    if dist.get_rank() == 1:
        _sleep_forever()
    dist.barrier()


def _sleep_forever() -> None:
    while True:
        time.sleep(1000)


def _die_on_rank_1(how: str) -> int:
    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return dist.get_rank()


def _unpicklable_result() -> object:
    return lambda: None


def _return_then_hang_at_exit() -> int:
    # A non-daemonic child that never ends makes multiprocessing wait for it at exit.
    multiprocessing.get_context("fork").Process(target=_sleep_forever, daemon=False).start()
    return dist.get_rank()


def _square_into(queue: multiprocessing.queues.Queue, value: int) -> None:  # type: ignore[type-arg]
    queue.put(value * value)


def _start_worker(method: str) -> int:
    """Start a worker process with the given start method from inside a rank."""
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    worker = ctx.Process(target=_square_into, args=(queue, dist.get_rank() + 2), daemon=True)
    worker.start()
    result = queue.get(timeout=60)
    worker.join(10)
    assert worker.exitcode == 0
    return int(result)


def _cuda_rank() -> int:
    return torch.cuda.current_device()


# ---------------------------------------------------------------------------- helpers


def _read_pids(tmp_path: Path) -> list[int]:
    pids = []
    for path in sorted(tmp_path.glob("rank*.pids")):
        pids.extend(int(pid) for pid in path.read_text().split())
    return pids


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_all_dead(pids: list[int], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if _alive(pid)], "processes left running"


# ---------------------------------------------------------------------------- tests


@world_sizes(1, 2, 4)
def test_every_rank_returns_and_all_reduce_works(world_size: int) -> None:
    results = run_distributed(_rank_and_sum, world_size)

    expected_sum = world_size * (world_size + 1) / 2
    assert [r[:3] for r in results] == [
        (rank, world_size, expected_sum) for rank in range(world_size)
    ]
    for rank, (*_, env) in enumerate(results):
        assert env == {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
        }


def test_world_size_fixture_defaults_to_1_2_4(
    request: pytest.FixtureRequest, world_size: int
) -> None:
    assert request.node.callspec.id == f"ws{world_size}"
    assert world_size in (1, 2, 4)


def test_ranks_see_the_parent_environment_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIST_CKPT_HARNESS_PROBE", "first")
    assert run_distributed(_read_env, 2, "DIST_CKPT_HARNESS_PROBE") == ["first", "first"]
    monkeypatch.setenv("DIST_CKPT_HARNESS_PROBE", "second")
    assert run_distributed(_read_env, 1, "DIST_CKPT_HARNESS_PROBE") == ["second"]
    monkeypatch.delenv("DIST_CKPT_HARNESS_PROBE")
    assert run_distributed(_read_env, 1, "DIST_CKPT_HARNESS_PROBE") == [None]


def test_args_kwargs_and_tensor_results_travel_by_value(tmp_path: Path) -> None:
    results = run_distributed(_echo, 2, tmp_path, 10, offset=5, timeout=30.0)

    assert [r[:2] for r in results] == [(str(tmp_path), 5), (str(tmp_path), 15)]
    for rank, (*_, tensor) in enumerate(results):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, torch.arange(4, dtype=torch.bfloat16) * rank)


def test_failing_rank_reports_its_traceback() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank_1, 2, timeout=30.0)

    message = str(info.value)
    assert "rank 1" in message
    assert "Traceback (most recent call last)" in message
    assert "ValueError: boom from rank 1" in message
    assert "_fail_on_rank_1" in message  # the frame that raised
    assert isinstance(info.value, AssertionError)
    assert set(info.value.failures) == {1}
    failure = info.value.failures[1]
    assert (failure.kind, failure.exc_type) == ("exception", "ValueError")


def test_failure_while_a_peer_waits_in_a_collective_does_not_hang() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank_1_inside_collective, 2, timeout=60.0)

    assert time.monotonic() - start < 20.0
    assert not info.value.timed_out
    assert "ValueError: boom from rank 1" in info.value.failures[1].details
    # Rank 0 either saw the broken connection or was killed after the grace period.
    assert info.value.failures[0].kind in ("exception", "killed")


def test_hanging_rank_times_out_and_leaves_no_process(tmp_path: Path) -> None:
    timeout = 2.0
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hang_on_rank_1, 2, tmp_path, timeout=timeout)
    elapsed = time.monotonic() - start

    assert timeout <= elapsed < timeout + 10.0
    error = info.value
    assert error.timed_out
    assert "timed out" in str(error)
    assert set(error.failures) == {0, 1}
    assert {f.kind for f in error.failures.values()} == {"timeout"}
    # The hung rank's Python stack names the function it was stuck in.
    assert "_sleep_forever" in error.failures[1].details
    pids = _read_pids(tmp_path)
    assert len(pids) == 4  # two ranks, each with one child
    _assert_all_dead(pids)


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_rank_that_dies_is_reported(how: str) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_die_on_rank_1, 2, how, timeout=60.0)

    assert time.monotonic() - start < 20.0
    failure = info.value.failures[1]
    assert failure.kind == "died"
    expected = "exited with code 3" if how == "exit" else "killed by signal SIGKILL"
    assert expected in failure.summary
    assert "rank 1" in str(info.value)


def test_unpicklable_result_is_a_failure_naming_the_rank() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_unpicklable_result, 2, timeout=30.0)

    assert set(info.value.failures) == {0, 1}
    assert "lambda" in info.value.failures[0].details


def test_rank_that_does_not_exit_after_returning_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(harness, "EXIT_GRACE_S", 1.0)
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_return_then_hang_at_exit, 1, timeout=30.0)

    failure = info.value.failures[0]
    assert failure.kind == "exit"
    assert "did not exit" in failure.summary


def test_unpicklable_fn_is_rejected_before_starting() -> None:
    with pytest.raises(TypeError, match="picklable"):
        run_distributed(lambda: None, 2)


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_ranks_can_start_worker_processes(method: str) -> None:
    assert run_distributed(_start_worker, 2, method, timeout=60.0) == [4, 9]


@pytest.mark.gpu
@requires_cuda
def test_nccl_backend_uses_one_device_per_rank() -> None:
    world_size = min(2, torch.cuda.device_count())
    results = launch(_cuda_rank, world_size, backend="nccl", timeout=60.0)
    assert results == [rank % torch.cuda.device_count() for rank in range(world_size)]
